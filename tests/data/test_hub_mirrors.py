"""The named hub sources read through the real ``datasets.load_dataset(mirror, config, split=..., streaming=True)``
from local mirrors of their hub repos (real layouts, compression and schemas; real texts: tests/data/mirrors.py),
nothing mocked and the hub switched off: every document once per epoch across ranks x loader workers, a new
shuffle per epoch, exact resume, and token-weighted mixtures that hold their weights where document lengths
differ by orders of magnitude (novels against web pages)."""

from __future__ import annotations

import collections
import itertools

import pytest
import torch

from core.errors import ConfigError
from data import stream_sources
from data.streaming import HUB_SOURCES, StreamConfig, StreamDataset, build_stream_loader, token_counts
from tests.data import mirrors
from tests.data.streams import ByteTokenizer, T, stop_and_resume

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")  # torchdata's, on every loader


@pytest.fixture(autouse=True)
def _no_hub(monkeypatch):
    """Any attempt to reach the Hugging Face hub fails: the mirrors are all there is."""
    import datasets
    import huggingface_hub

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


@pytest.fixture(scope="module")
def hub(tmp_path_factory, shared_data) -> dict[str, tuple[str, dict[str, list[str]]]]:
    """{source: (mirror folder named like the hub repo, {split or config: texts})}."""
    root = tmp_path_factory.mktemp("hub")
    return {
        name: (str(root / HUB_SOURCES[name].path), build(root / HUB_SOURCES[name].path, shared_data))
        for name, build in mirrors.BUILDERS.items()
    }


def epoch_docs(ds: StreamDataset, worker: int, workers: int, epoch: int) -> list:
    out = []
    for doc in ds.documents(worker, workers):
        if doc.epoch > epoch:
            return out
        if doc.epoch == epoch:
            out.append(doc)


# (source, config, split) -> what datasets makes of the mirror: builder, config; and which texts, which label
CASES = [
    ("slimpajama", "", "train", "json", "default", "train", "RedPajamaC4"),
    ("slimpajama", "", "validation", "json", "default", "validation", None),
    ("fineweb-edu", "", "train", "parquet", "sample-10BT", "sample-10BT", mirrors.DUMP),
    ("fineweb-edu", "default", "train", "parquet", "default", "default", mirrors.DUMP),
    ("openwebtext", "", "train", "parquet", "plain_text", "train", None),
    ("pg19", "", "train", "parquet", "default", "train", "Clara"),
    ("pg19", "", "test", "parquet", "default", "test", None),
]


@pytest.mark.parametrize(("name", "config", "split", "builder", "builder_config", "part", "label"), CASES)
def test_a_named_source_streams_its_mirror_through_load_dataset(
    name, config, split, builder, builder_config, part, label, hub
):
    mirror, texts = hub[name]
    ds = StreamDataset(StreamConfig(source=name, path=mirror, config_name=config, split=split, shuffle_window=0))
    info = ds.bases[0].info
    assert (info.builder_name, info.config_name, ds.bases[0].split) == (builder, builder_config, split)
    docs = epoch_docs(ds, 0, 1, 0)
    assert collections.Counter(d.text for d in docs) == collections.Counter(texts[part])
    assert docs[0].id == f"{split}/shard00000:0" and {d.source for d in docs} == {name}
    if label:
        assert label in {d.meta for d in docs}


@pytest.mark.parametrize("name", list(mirrors.BUILDERS))
def test_every_document_once_per_epoch_across_2_ranks_x_2_workers(name, hub):
    mirror, _ = hub[name]
    cfg = StreamConfig(source=name, path=mirror, shuffle_window=4, seed=5)
    ranks = [StreamDataset(cfg, rank=r, world_size=2) for r in range(2)]
    whole = [d.id for d in epoch_docs(StreamDataset(cfg), 0, 1, 0)]
    orders = []
    for epoch in (0, 1):
        parts = [[d.id for d in epoch_docs(ds, w, 2, epoch)] for ds in ranks for w in range(2)]
        flat = [i for p in parts for i in p]
        assert len(flat) == len(set(flat)) == len(whole) and set(flat) == set(whole), f"epoch {epoch}"
        assert all(parts)
        orders.append(parts)
    assert orders[0] != orders[1]  # a new shuffle every epoch
    n_files = ranks[0].bases[0].num_shards
    files_per_worker = {len({i.split(":")[0] for i in p}) for p in orders[0]}
    if n_files % 4 == 0:  # shards mode: a worker reads its own files
        assert files_per_worker == {n_files // 4}
    else:  # examples mode: every worker reads every file and keeps its positions
        assert max(files_per_worker) > 1
    unshuffled = [
        d.id for d in epoch_docs(StreamDataset(StreamConfig(source=name, path=mirror, shuffle_window=0)), 0, 1, 0)
    ]
    assert unshuffled == sorted(unshuffled, key=lambda i: (i.split(":")[0], int(i.split(":")[1]))) != whole


@pytest.mark.parametrize("name", list(mirrors.BUILDERS))
def test_resume_gives_the_next_sequences_exactly_2_ranks_x_2_workers(name, hub, monkeypatch):
    monkeypatch.setattr(stream_sources, "READ_BATCH", 3)  # restores go through datasets' own file states
    mirror, _ = hub[name]
    cfg = StreamConfig(source=name, path=mirror, shuffle_window=4, seed=9, num_workers=2)
    batch, stop, steps = 4, 13, 100
    for rank in range(2):
        run = stop_and_resume(cfg, stop=stop, steps=steps, batch=batch, rank=rank, world_size=2)
        assert all(torch.equal(a, b) for a, b in zip(run.out[stop:], run.after)), f"{name} rank {rank}"
        assert run.resumed.token_counts() == run.loader.token_counts() == {name: (stop + steps) * batch * T}


def mixture_config(hub, weighting: str, **kw) -> StreamConfig:
    weights = {"pg19": 0.3, "fineweb-edu:sample-10BT": 0.5, "slimpajama": 0.2}
    return StreamConfig(
        mixture=weights,
        mirrors={name: hub[name][0] for name in ("pg19", "fineweb-edu", "slimpajama")},
        mixture_weighting=weighting,
        shuffle_window=4,
        seed=3,
        **kw,
    )


def realised_shares(loader, steps: int, every: int) -> tuple[list, list[dict[str, float]]]:
    it, out, shares = iter(loader), [], []
    for step in range(steps):
        out.append(next(it))
        if (step + 1) % every == 0:
            counts = loader.token_counts()
            shares.append({k: v / sum(counts.values()) for k, v in counts.items()})
    return out, shares


def test_token_weighted_mixture_holds_its_weights_with_novels_against_web_pages(hub):
    """Books of 40,000 characters against web pages (~3,000) and Wikipedia articles: weighted by documents, the
    books' share of the tokens swings from none to most; weighted by tokens every source keeps its weight, within
    one sequence per loader worker, from the first steps on."""
    tok, workers, batch, steps, every = ByteTokenizer(), 2, 4, 200, 20
    weights = {"pg19": 0.3, "fineweb-edu:sample-10BT": 0.5, "slimpajama": 0.2}
    shares = {}
    for weighting in ("tokens", "documents"):
        cfg = mixture_config(hub, weighting)
        loader = build_stream_loader(cfg, tok, seq_len=T, batch_size=batch, num_workers=workers)
        shares[weighting] = realised_shares(loader, steps, every)[1]
    for at, share in enumerate(shares["tokens"], 1):
        sequences = at * every * batch
        assert all(abs(share[k] - w) <= workers / sequences + 1e-9 for k, w in weights.items()), (at * every, share)
    books = [s["pg19"] for s in shares["documents"]]
    assert max(books) - min(books) > 0.3 and books[-1] > 0.5, books
    print("\npg19's token share every 20 steps (weight 0.3):")
    for weighting, found in shares.items():
        print(f"  by {weighting}: {[round(s['pg19'], 3) for s in found]}; at the end {found[-1]}")


def test_token_weighted_mixture_of_mirrors_resumes_exactly_on_2_ranks(hub, monkeypatch):
    monkeypatch.setattr(stream_sources, "READ_BATCH", 4)
    cfg = mixture_config(hub, "tokens", num_workers=2)
    stop = 17
    for rank in range(2):
        run = stop_and_resume(cfg, stop=stop, steps=60, batch=4, rank=rank, world_size=2)
        assert run.resumed_counts == run.counts
        assert all(torch.equal(a, b) for a, b in zip(run.out[stop:], run.after)), f"rank {rank}"
        assert token_counts(run.resumed.state_dict()) == run.loader.token_counts()


def test_a_mirror_that_cannot_serve_the_source_is_a_one_line_error(hub, tmp_path):
    train_only = tmp_path / "train-only"
    mirrors._write_zst_jsonl(train_only / "train" / "chunk1" / "example_train_0.jsonl.zst", [{"text": "x"}])
    scripted, renamed = tmp_path / "scripted" / "pg19", tmp_path / "deepmind-pg19"  # clones of the hub repo as is
    for clone in (scripted, renamed):
        clone.mkdir(parents=True)
        (clone / "pg19.py").write_text("# a loading script\n")
    (tmp_path / "empty").mkdir()
    cases = [
        (
            StreamConfig(source="pg19", path=str(tmp_path / "nowhere")),
            r"^data\.path: '.*nowhere' is not a folder; with a named source it is a local mirror of deepmind/pg19 ",
        ),
        (
            StreamConfig(source="pg19", path=str(scripted)),
            r"^data\.path: '.*pg19' holds the loading script pg19\.py, which datasets>=4 no longer runs",
        ),
        (
            StreamConfig(mixture={"pg19": 1.0, "openwebtext": 1.0}, mirrors={"pg19": str(renamed)}),
            r"^data\.mixture: '.*deepmind-pg19' holds the loading script pg19\.py",
        ),
        (
            StreamConfig(source="fineweb-edu", path=hub["fineweb-edu"][0], config_name="sample-100BT"),
            r"^data\.path: the mirror .*fineweb-edu cannot give fineweb-edu \(BuilderConfig 'sample-100BT' not found",
        ),
        (
            StreamConfig(source="slimpajama", path=str(train_only), split="test"),
            r"^data\.path: the mirror .*train-only cannot give slimpajama \(Bad split: test",
        ),
        (
            StreamConfig(mixture={"slimpajama": 1.0, "pg19": 1.0}, mirrors={"slimpajama": str(tmp_path / "empty")}),
            r"^data\.mixture: the mirror .*empty holds no data files of slimpajama; expected <split>/chunk<k>/",
        ),
    ]
    for cfg, message in cases:
        with pytest.raises(ConfigError, match=message) as e:
            StreamDataset(cfg)
        assert "\n" not in str(e.value)


def test_named_sources_take_a_mirror_from_the_data_config(hub):
    from data.config import DataConfig, MixtureEntry

    single = DataConfig(source="pg19", path=hub["pg19"][0], split="validation")
    single.validate()
    assert single.stream_config(seed=0).sources()[0][0].mirror == hub["pg19"][0]
    mixed = DataConfig(
        source="mixture",
        mixture=[
            MixtureEntry(source="fineweb-edu", name="sample-10BT", path=hub["fineweb-edu"][0], weight=3.0),
            MixtureEntry(source="fineweb-edu", name="default", path=hub["fineweb-edu"][0], weight=1.0),
            MixtureEntry(source="pg19", path=hub["pg19"][0], weight=1.0),
        ],
    )
    mixed.validate()
    stream = mixed.stream_config(seed=0)
    assert stream.mixture_weighting == "tokens" and stream.weighting == "tokens"
    assert [(s.name, s.mirror, w) for s, w in stream.sources()] == [
        ("fineweb-edu:sample-10BT", hub["fineweb-edu"][0], 0.6),
        ("fineweb-edu:default", hub["fineweb-edu"][0], 0.2),
        ("pg19", hub["pg19"][0], 0.2),
    ]
    two = DataConfig(
        source="mixture",
        mixture=[MixtureEntry(source="pg19", path=hub["pg19"][0]), MixtureEntry(source="pg19", path="/elsewhere")],
    )
    with pytest.raises(ConfigError, match=r"^data\.mixture: pg19 has two mirrors, "):
        two.validate()
    with pytest.raises(ConfigError, match=r"^data\.mixture_weighting: 'bytes' is not one of tokens, documents$"):
        DataConfig(source="pg19", mixture_weighting="bytes").validate()


def test_a_mirror_trains_through_build_corpus_and_the_trainer_loader(hub, shared_data, tmp_path):
    """data.source = fineweb-edu with data.path = the mirror, as a run config gives it: corpus, loader, steps."""
    from data.build import build_corpus
    from data.config import DataConfig
    from data.loader import StreamBatchLoader

    cfg = DataConfig(
        source="fineweb-edu",
        path=hub["fineweb-edu"][0],
        tokenizer=str(shared_data / "gpt2_bpe" / "gpt2_tokenizer.json"),
        seq_len=64,
        num_workers=0,
        cache_dir=str(tmp_path),
    )
    corpus = build_corpus(cfg, vocab_size=50304, log=lambda _: None)
    loader = StreamBatchLoader(
        corpus.stream, corpus.tokenizer, seq_len=64, batch_size=4, micro_batch_size=2, rank=0, world_size=1
    )
    steps = [loader.next_step() for _ in range(3)]
    assert all(len(s) == 2 and s[0].shape == (2, 65) for s in steps)
    assert loader.token_counts() == {"fineweb-edu": 3 * 4 * 64}


def test_documents_list_what_token_weighted_packing_opens_in_order(hub):
    """Each sequence continues exactly one source's documents (from documents(), EOS after each), one source's
    sequences following each other with a shared token; without a tokenizer, UTF-8 bytes size the documents."""
    cfg, tok = mixture_config(hub, "tokens"), ByteTokenizer()
    docs = [d for d, _ in zip(StreamDataset(cfg, tok, seq_len=T).documents(0, 1), range(150))]
    assert [d.id for d, _ in zip(StreamDataset(cfg, seq_len=T).documents(0, 1), range(150))] == [d.id for d in docs]
    names = list(cfg.mixture)
    streams = {n: [t for d in docs if d.source == n for t in [*d.text.encode(), tok.eos_id]] for n in names}
    at, picked = dict.fromkeys(names, 0), []
    for seq in itertools.islice(StreamDataset(cfg, tok, seq_len=T).sequences(0, 1), 300):
        match = [n for n in names if streams[n][at[n] : at[n] + T + 1] == seq.tolist()]
        assert len(match) == 1
        at[match[0]] += T
        picked.append(match[0])
    assert collections.Counter(picked) == {"pg19": 90, "fineweb-edu:sample-10BT": 150, "slimpajama": 60}
