"""Streaming data: rank x worker sharding, exact resume, packing, world-size changes, hub arguments, document
masks (mixtures: test_mixture.py).

Offline and on CPU. A named source reads a local mirror of its hub repo through the real
``datasets.load_dataset(mirror, config, split=..., streaming=True)`` (here SlimPajama's zstd JSON-lines
layout; every named source's real layout is in test_hub_mirrors.py); only the test of the exact hub
arguments replaces ``load_dataset``. A byte-level tokenizer keeps thousands of sequences cheap and lets
tests read documents back out of packed sequences.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from core.errors import ConfigError
from data import stream_sources
from data.streaming import (
    HUB_SOURCES,
    DocumentBatch,
    StreamConfig,
    StreamDataset,
    build_stream_loader,
    document_mask,
    document_positions,
    token_counts,
)
from tests.data.streams import EOS, ByteTokenizer, T, epoch_ids, make_corpus, stop_and_resume, write_jsonl

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")  # torchdata's, on every loader


@pytest.fixture
def fake_hub(monkeypatch):
    """datasets.load_dataset for hub repo ids records its arguments and streams local jsonl files instead: only for
    checking the exact arguments a named source passes for the hub (its data path is tested on real mirrors)."""
    import datasets

    real = datasets.load_dataset
    calls: list[tuple] = []
    files: dict[str, list[str]] = {}

    def load(path, name=None, *, split=None, streaming=False, **kwargs):
        if path in ("json", "parquet", "text"):
            return real(path, split=split, streaming=streaming, **kwargs)
        calls.append((path, name, split, streaming))
        return real("json", data_files=files[path], split="train", streaming=True)

    monkeypatch.setattr(datasets, "load_dataset", load)
    return calls, files


def source_config(kind: str, tmp_path, **kw) -> tuple[StreamConfig, set[str]]:
    """A local corpus, or 'slimpajama' read from a local mirror of its hub repo (4 files: shards mode for 4
    workers; 3: examples mode)."""
    if kind == "local":
        docs = make_corpus(tmp_path / "corpus")
        return StreamConfig(path=str(tmp_path / "corpus"), **kw), set(docs)
    sizes = (23, 31, 17, 20) if kind == "hub-shards" else (23, 31, 17)
    mirror = tmp_path / "cerebras" / "SlimPajama-627B"
    docs = make_corpus(mirror, sizes, slimpajama=True)
    return StreamConfig(source="slimpajama", path=str(mirror), **kw), set(docs)


# ---- sharding ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["local", "hub-shards", "hub-examples"])
def test_every_document_once_per_epoch_across_ranks_and_workers(kind, tmp_path):
    cfg, ids = source_config(kind, tmp_path, shuffle_window=8, seed=3)
    ranks = [StreamDataset(cfg, rank=r, world_size=2) for r in range(2)]
    for epoch in (0, 1):
        seen = [epoch_ids(ds, w, 2, epoch) for ds in ranks for w in range(2)]
        flat = [i for part in seen for i in part]
        assert len(flat) == len(set(flat)) and set(flat) == ids, f"epoch {epoch}"
        assert all(seen)  # every worker has a share
    orders = [epoch_ids(ranks[0], 0, 2, e) for e in (0, 1)]
    assert orders[0] != orders[1]  # a new shuffle every epoch
    files_per_worker = {len({i.split(":")[0] for i in part}) for part in seen}
    if kind == "hub-shards":
        assert files_per_worker == {1}  # 4 shards for 4 workers: one each
    else:
        assert max(files_per_worker) > 1  # examples mode: documents of every file


def test_real_web_text_is_split_exactly(shared_data):
    folder = shared_data / "web_text_fixtures" / "dolma"
    cfg = StreamConfig(path=str(folder / "*.jsonl"), shuffle_window=4)
    ranks = [StreamDataset(cfg, rank=r, world_size=2) for r in range(2)]
    flat = [i for ds in ranks for w in range(2) for i in epoch_ids(ds, w, 2, 0)]
    assert len(flat) == len(set(flat)) == 20  # 2 files x 10 CCNet documents


def test_local_order_does_not_depend_on_the_world_size(tmp_path):
    make_corpus(tmp_path / "c")
    cfg = StreamConfig(path=str(tmp_path / "c"), shuffle_window=8, seed=1)
    single = epoch_ids(StreamDataset(cfg), 0, 1, 0)
    parts = [epoch_ids(StreamDataset(cfg, rank=r, world_size=3), 0, 1, 0) for r in range(3)]
    assert [parts[i % 3][i // 3] for i in range(len(single))] == single  # position p goes to worker p % G


# ---- exact resume -------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["local", "hub-shards"])
def test_resume_gives_the_next_1000_sequences_2_ranks_x_2_workers(kind, tmp_path, monkeypatch):
    # shards span several datasets reads: restores go through their states
    monkeypatch.setattr(stream_sources, "READ_BATCH", 5)
    cfg, _ = source_config(kind, tmp_path, shuffle_window=8, seed=7, num_workers=2)
    batch, steps = 8, 1000 // 8
    per_rank = []
    for rank, stop in ((0, 37), (1, 50)):  # arbitrary steps: the last batch before each came from worker 0 / 1
        run = stop_and_resume(cfg, stop=stop, steps=steps, batch=batch, rank=rank, world_size=2)
        assert all(a.shape == (batch, T + 1) and a.dtype == torch.int64 for a in run.after)
        assert all(torch.equal(a, b) for a, b in zip(run.out[stop:], run.after)), f"rank {rank}"
        name = "slimpajama" if cfg.source == "slimpajama" else cfg.path
        assert run.resumed.token_counts() == run.loader.token_counts() == {name: len(run.out) * batch * T}
        per_rank.append(run.out[0])
    assert not torch.equal(per_rank[0], per_rank[1])


def test_packing_is_eos_separated_and_overlapping(tmp_path):
    docs = make_corpus(tmp_path / "c", sizes=(5, 4))
    cfg = StreamConfig(path=str(tmp_path / "c"), shuffle_window=0, num_workers=0, document_masking=True)
    loader = build_stream_loader(cfg, ByteTokenizer(), seq_len=T, batch_size=2, seed=0)
    it = iter(loader)
    batches = [next(it) for _ in range(20)]
    assert all(isinstance(b, DocumentBatch) and b.tokens.shape == b.doc_ids.shape == (2, T + 1) for b in batches)
    seqs = [s for b in batches for s in b.tokens.tolist()]
    assert all(a[-1] == b[0] for a, b in itertools.pairwise(seqs))  # every token is a target exactly once
    stream = seqs[0] + [t for s in seqs[1:] for t in s[1:]]
    in_order = [docs[f"part{f}.jsonl:{r}"] for f, n in enumerate((5, 4)) for r in range(n)]
    expected = [t for _ in range(10) for text in in_order for t in [*text.encode(), EOS]]
    assert stream == expected[: len(stream)]
    for b in batches:  # the document index steps right after each EOS
        tokens, ids = b.tokens, b.doc_ids
        assert (ids[:, 0] == 0).all() and torch.equal(ids[:, 1:], ids[:, :-1] + (tokens[:, :-1] == EOS).long())
    assert loader.token_counts() == {cfg.path: 40 * T}


# ---- world-size changes -------------------------------------------------------------------------


def consumed_docs(ds: StreamDataset, worker: int, workers: int, stream: list[int]) -> list:
    """The documents a worker's token stream touched, the last (partly packed) one included."""
    *full, tail = bytes(t if t != EOS else 0 for t in stream).split(b"\0")
    docs = [d for d, _ in zip(ds.documents(worker, workers), range(len(full) + (1 if tail else 0)))]
    assert [d.text.encode() for d in docs[: len(full)]] == full
    assert not tail or docs[-1].text.encode().startswith(tail)
    return docs


def test_resume_on_another_world_size_rederives_local_positions(tmp_path, monkeypatch):
    # a relative path: the source's name seeds its shuffle, so the progress below lands in the same epochs every
    # run (under tmp_path's changing name, worker 2's 60 sequences sometimes reached epoch 2)
    monkeypatch.chdir(tmp_path)
    texts = make_corpus(tmp_path / "c", sizes=(23, 31, 17))
    cfg = StreamConfig(path="c", shuffle_window=8, seed=2)
    tok, states, before = ByteTokenizer(), [], {0: [], 1: []}
    progress = {(0, 0): 9, (0, 1): 14, (1, 0): 60, (1, 1): 0}  # uneven; worker 2 is into its second epoch
    for (rank, w), n in progress.items():
        ds = StreamDataset(cfg, tok, seq_len=T, rank=rank, world_size=2)
        it = ds.sequences(w, 2)
        seqs = [next(it).tolist() for _ in range(n)]
        while n == 0 and not ds.state_dict()["doc_epoch"] > ds.state_dict()["streams"][0]["epoch"]:
            # worker 3 stops right after taking its first epoch-1 document (the saved position is still in epoch 0)
            seqs.append(next(it).tolist())
        progress[rank, w] = len(seqs)
        states.append(ds.state_dict())
        for doc in consumed_docs(
            StreamDataset(cfg, rank=rank, world_size=2), w, 2, seqs[0] + [t for s in seqs[1:] for t in s[1:]]
        ):
            before[doc.epoch].append(doc.id)
    assert before[1] and states[2]["streams"][0]["epoch"] == 1
    new = StreamDataset(cfg, tok, seq_len=T, rank=0, world_size=1, resume_from=[states[:2], states[2:]])
    for epoch in (0, 1):  # the rest of epochs 0 and 1 on 3 workers: each document once
        after = [i for w in range(3) for i in epoch_ids(new, w, 3, epoch)]
        assert sorted(before[epoch] + after) == sorted(texts), f"epoch {epoch}"
    assert len({i for w in range(3) for i in epoch_ids(new, w, 3, 2)}) == len(texts)  # then whole epochs
    assert (
        token_counts(new.state_dict()) == token_counts(states) == {cfg.path: sum(progress.values()) * T}
    )  # kept on worker 0
    assert next(new.sequences(0, 3)).shape == (T + 1,)


def test_changed_worker_count_and_hub_positions_give_one_line_errors(tmp_path):
    cfg, _ = source_config("hub-shards", tmp_path, shuffle_window=8)
    tok = ByteTokenizer()
    ds = StreamDataset(cfg, tok, seq_len=T, rank=0, world_size=2)
    it = ds.sequences(0, 2)
    next(it)
    state = ds.state_dict()
    loader = build_stream_loader(cfg, tok, seq_len=T, batch_size=2, rank=0, world_size=2, num_workers=0)
    with pytest.raises(
        ConfigError,
        match=r"^data: the checkpoint's loader state is for loader workers \[0\] of 4, "
        r"this rank runs \[0\] of 2 .*resume_from",
    ) as e:
        loader.load_state_dict({"x": state})
    assert "\n" not in str(e.value)
    others, iters = [], []  # 2 ranks x 2 workers, one sequence each
    for rank in range(2):
        for w in range(2):
            ds = StreamDataset(cfg, tok, seq_len=T, rank=rank, world_size=2)
            iters.append(ds.sequences(w, 2))
            next(iters[-1])
            others.append(ds.state_dict())
    with pytest.raises(
        ConfigError,
        match=r"^data: source 'slimpajama' streams from the hub, whose position cannot be re-derived.* = 4$",
    ):
        build_stream_loader(cfg, tok, seq_len=T, batch_size=2, num_workers=3, resume_from=[others])
    # 2 ranks x 2 workers -> 4 ranks x 1 worker: the same 4 global workers, positions carry over exactly
    same = build_stream_loader(
        cfg, tok, seq_len=T, batch_size=2, rank=1, world_size=4, num_workers=0, resume_from=[others]
    )
    assert torch.equal(next(iter(same)), torch.stack([next(iters[1]) for _ in range(2)]))


# ---- hub sources and config -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "config", "split", "want_name"),
    [
        ("slimpajama", "", "validation", None),
        ("fineweb-edu", "", "train", "sample-10BT"),
        ("fineweb-edu", "sample-100BT", "train", "sample-100BT"),
        ("openwebtext", "", "train", None),
        ("pg19", "", "test", None),
    ],
)
def test_named_sources_call_load_dataset_streaming(name, config, split, want_name, tmp_path, fake_hub):
    calls, files = fake_hub
    hub = HUB_SOURCES[name]
    rows = [
        {
            "text": f"{name} doc {i}\r\n",
            "meta": {"redpajama_set_name": "RedPajamaBook"},
            "dump": "CC-MAIN-2024-10",
            "short_book_title": "Emma",
            "url": "http://x",
        }
        for i in range(6)
    ]
    write_jsonl(tmp_path / "h.jsonl", rows)
    files[hub.path] = [str(tmp_path / "h.jsonl")]
    ds = StreamDataset(StreamConfig(source=name, config_name=config, split=split, shuffle_window=0))
    assert calls == [(hub.path, want_name, split, True)]
    doc = next(ds.documents(0, 1))
    assert (doc.source, doc.id, doc.text) == (name, f"{split}/shard00000:0", f"{name} doc 0\n")
    assert doc.meta == {"slimpajama": "RedPajamaBook", "fineweb-edu": "CC-MAIN-2024-10", "pg19": "Emma"}.get(name)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"source": "slimpajamma"},
            r"^data\.source: 'slimpajamma' is not one of slimpajama, fineweb-edu, openwebtext, pg19, local$",
        ),
        (
            {"source": "fineweb-edu", "config_name": "sample-1T"},
            r"^data\.config_name: 'sample-1T' is not a config of fineweb-edu; one of sample-10BT, ",
        ),
        ({"source": "openwebtext", "config_name": "en"}, r"^data\.config_name: openwebtext has no configs, got 'en'$"),
        (
            {"source": "pg19", "split": "dev"},
            r"^data\.split: 'dev' is not a split of pg19; one of train, validation, test$",
        ),
        ({"source": "local"}, r"^data\.path: required with data\.source = 'local'"),
        ({"mixture": {"fineweb-edu:x": 1.0}}, r"^data\.mixture: 'x' is not a config of fineweb-edu; one of "),
        ({"mixture": {"nowhere/at/all": 1.0}}, r"^data\.mixture: 'nowhere/at/all' is neither a named source"),
        ({"mixture": {"pg19": 0.0}}, r"^data\.mixture: the weight of 'pg19' must be a finite number > 0, got 0\.0$"),
        (
            {"source": "pg19", "shuffle_window": -1},
            r"^data\.shuffle_window: must be >= 0 \(0 = no shuffling\), got -1$",
        ),
        ({"source": "pg19", "seed": -3}, r"^data\.seed: must be >= 0, got -3$"),
    ],
)
def test_bad_config_gives_one_line_errors(kwargs, message):
    with pytest.raises(ConfigError, match=message) as e:
        StreamConfig(**kwargs).validate()
    assert "\n" not in str(e.value)


def test_local_sources_need_one_file_type_and_the_text_field(tmp_path):
    write_jsonl(tmp_path / "mixed" / "a.jsonl", [{"text": "x"}])
    (tmp_path / "mixed" / "b.txt").write_text("y")
    with pytest.raises(
        ConfigError,
        match=r"^data\.path: '.*mixed' mixes \.jsonl and \.txt files; a streamed source holds one file type",
    ):
        StreamConfig(path=str(tmp_path / "mixed")).validate()
    write_jsonl(tmp_path / "body.jsonl", [{"body": "x"}])
    with pytest.raises(
        ConfigError, match=r"^data\.text_field: source '.*body\.jsonl' has no field 'text' \(fields: body\)$"
    ):
        StreamDataset(StreamConfig(path=str(tmp_path / "body.jsonl")))
    doc = next(StreamDataset(StreamConfig(path=str(tmp_path / "body.jsonl"), text_field="body")).documents(0, 1))
    assert (doc.id, doc.text) == ("body.jsonl:0", "x")


def test_too_few_documents_for_the_workers_is_an_error(tmp_path):
    write_jsonl(tmp_path / "tiny.jsonl", [{"text": "only one"}])
    ds = StreamDataset(StreamConfig(path=str(tmp_path / "tiny.jsonl")), rank=1, world_size=2)
    with pytest.raises(ConfigError, match=r"^data: source '.*tiny\.jsonl' gives loader worker 1 of 2 no documents"):
        next(ds.documents(0, 1))


def test_novels_stream_as_whole_documents_with_bom_and_crlf_removed(shared_data):
    from data.tokenizer import load_tokenizer

    cfg = StreamConfig(path=str(shared_data / "english_novels" / "Woolf_*.txt"), shuffle_window=0)
    docs = [d for d, _ in zip(StreamDataset(cfg).documents(0, 1), range(2))]
    assert [d.id for d in docs] == ["Woolf_Lighthouse_1927.txt", "Woolf_Night_1919.txt"]
    assert all("\r" not in d.text and not d.text.startswith("\ufeff") for d in docs)
    tok = load_tokenizer(shared_data / "gpt2_bpe" / "gpt2_tokenizer.json")
    seq = next(iter(StreamDataset(cfg, tok, seq_len=64)))
    assert seq.tolist()[:8] == tok.encode_batch([docs[0].text[:200]])[0][:8]


# ---- document masking -----------------------------------------------------------------------------


def test_document_mask_is_causal_and_block_diagonal():
    ids = torch.tensor([0, 0, 1, 1, 1, 2])
    allowed = {(0, 0), (1, 0), (1, 1), (2, 2), (3, 2), (3, 3), (4, 2), (4, 3), (4, 4), (5, 5)}
    expected = torch.tensor([[(i, j) in allowed for j in range(6)] for i in range(6)])
    assert torch.equal(document_mask(ids), expected)
    assert torch.equal(document_mask(ids.expand(3, 6)), expected.expand(3, 6, 6))
    assert document_positions(ids).tolist() == [0, 1, 0, 1, 2, 0]
