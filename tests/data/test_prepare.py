from __future__ import annotations

import errno
import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from core.errors import ConfigError
from data.build import _content_hash, split_documents
from data.packing import PackedDataset, pack_documents
from data.prepare import PrepareConfig, prepare
from data.shards import (
    DTYPES,
    INDEX_FILE,
    SplitWriter,
    load_prepared_tokenizer,
    open_prepared,
)
from data.sources import iter_local
from data.tokenizer import load_tokenizer
from tests.data.conftest import write_corpus


class StubTokenizer:
    """A vocabulary above 65536 ids (so shards are uint32): one id per character, offset past 65535."""

    file_name = "stub.json"
    bos_id = None

    def __init__(self, salt: str = ""):
        self.vocab_size, self.eos_id = 70_000, 69_999
        self.fingerprint = hashlib.sha256(f"stub|{salt}".encode()).hexdigest()

    def encode(self, text: str) -> list[int]:
        return [65_000 + ord(c) % 4000 for c in text]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def save(self, directory: Path) -> Path:
        path = Path(directory) / self.file_name
        path.write_text(json.dumps({"stub": self.fingerprint}))
        return path


def run_prepare(path, out, *, tokenizer=None, **options):
    cfg = PrepareConfig(out=str(out), path=str(path), **options)
    return prepare(cfg, tokenizer=tokenizer, log=lambda line: None, progress=False)


@pytest.fixture(scope="module")
def prepared(corpus, sp_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("prepared") / "shards"
    return prepare(
        PrepareConfig(out=str(out), path=str(corpus), tokenizer=str(sp_path), shard_tokens=97),
        log=lambda line: None,
        progress=False,
    )


def raw_stream(out: Path, index: dict, split: str) -> np.ndarray:
    files = [out / s["file"] for s in index["splits"][split]["shards"]]
    return np.concatenate(
        [np.fromfile(f, dtype=DTYPES[index["dtype"]]) for f in files] or [np.zeros(0, DTYPES[index["dtype"]])]
    )


def test_folder_index_fields_and_streams(prepared, corpus, sp_path):
    index, out = prepared.index, prepared.out
    tok = load_tokenizer(sp_path)
    docs = list(iter_local(str(corpus)))
    assert not any("\r" in d.text or "\ufeff" in d.text for d in docs)  # BOM / CRLF normalised before tokenising
    train_docs, val_docs = split_documents(docs, 0.05)
    assert index["format"] == "focused-pretrain-shards" and index["version"] == 1
    assert (index["dtype"], index["vocab_size"], index["eos_id"]) == ("uint16", 300, tok.eos_id)
    assert index["tokenizer"] == {"file": "tokenizer.model", "fingerprint": tok.fingerprint}
    assert (out / "tokenizer.model").read_bytes() == sp_path.read_bytes()
    assert load_prepared_tokenizer(out, index).fingerprint == tok.fingerprint
    assert index["content_sha256"] == _content_hash(docs) and index["shard_tokens"] == 97
    assert len(index["fingerprint"]) == 64
    for name, split_docs in (("train", train_docs), ("val", val_docs)):
        split = index["splits"][name]
        expected = pack_documents((d.text for d in split_docs), tok)
        stream = raw_stream(out, index, name)
        assert np.array_equal(stream, expected)  # the trainer's own packing, byte for byte
        assert split["documents"] == len(split_docs) == sum(s["documents"] for s in split["shards"])
        assert split["content_sha256"] == _content_hash(split_docs)
        assert split["tokens"] == len(expected) == sum(s["tokens"] for s in split["shards"])
        assert [s["file"] for s in split["shards"]] == [f"{name}_{i:05d}.bin" for i in range(len(split["shards"]))]
        assert all(s["tokens"] == 97 for s in split["shards"][:-1])  # documents span shard boundaries
        for s in split["shards"]:
            assert (out / s["file"]).stat().st_size == 2 * s["tokens"]
        assert int((stream == tok.eos_id).sum()) == len(split_docs) and stream[-1] == tok.eos_id
    assert len(index["splits"]["train"]["shards"]) > 3
    assert sorted(p.name for p in out.parent.iterdir()) == ["shards"]  # no temporaries left beside it


def test_jsonl_with_text_field(tmp_path, sp_path):
    src = tmp_path / "data.jsonl"
    rows = [{"body": f"the king of night {i} " * 20, "n": i} for i in range(6)]
    src.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    res = run_prepare(src, tmp_path / "out", tokenizer=load_tokenizer(sp_path), text_field="body")
    splits = res.index["splits"]
    assert splits["train"]["documents"] + splits["val"]["documents"] == 6
    docs = list(iter_local(str(src), "body"))
    assert [d.id for d in docs][:2] == ["data.jsonl:1", "data.jsonl:2"] and res.index[
        "content_sha256"
    ] == _content_hash(docs)
    with pytest.raises(ConfigError, match="^data.text_field: "):
        run_prepare(src, tmp_path / "out2", tokenizer=load_tokenizer(sp_path))


def test_large_vocab_writes_uint32(tmp_path, corpus):
    res = run_prepare(corpus, tmp_path / "out", tokenizer=StubTokenizer(), shard_tokens=1000)
    assert res.index["dtype"] == "uint32" and res.index["tokenizer"]["file"] == "stub.json"
    train, _, _ = open_prepared(tmp_path / "out", seq_len=16)
    docs, _ = split_documents(list(iter_local(str(corpus))), 0.05)
    expected = pack_documents((d.text for d in docs), StubTokenizer())
    assert expected.dtype == np.uint32 and expected.max() > 65535
    assert np.array_equal(np.asarray(train.tokens), expected)
    first = res.index["splits"]["train"]["shards"][0]
    assert (tmp_path / "out" / first["file"]).stat().st_size == 4 * first["tokens"]


@pytest.mark.parametrize("seq_len", [1, 7, 40])
def test_sequences_match_packed_dataset_across_shards(prepared, seq_len):
    train, val, index = open_prepared(prepared.out, seq_len)
    for split, ds in (("train", train), ("val", val)):
        packed = PackedDataset(raw_stream(prepared.out, index, split), seq_len)
        assert len(ds) == len(packed) > 0
        for i in range(len(ds)):
            assert torch.equal(ds[i], packed[i])
        idx = list(range(len(ds)))[::-1] + [0, 0]
        batch = ds.batch(idx)
        assert batch.dtype == torch.int64 and batch.shape == (len(idx), seq_len + 1)
        assert torch.equal(batch, torch.stack([ds[i] for i in idx])) and torch.equal(batch, packed.batch(idx))
        assert ds.batch(np.array([], dtype=np.int64)).shape == (0, seq_len + 1)
        tokens = ds.tokens
        assert len(tokens) == len(packed.tokens) and np.array_equal(tokens[90:300], packed.tokens[90:300])
        assert tokens[-1] == packed.tokens[-1] and np.array_equal(np.asarray(tokens), packed.tokens)
        with pytest.raises(IndexError):
            ds[len(ds)]
        with pytest.raises(IndexError):
            ds.batch([0, -1])


def test_fingerprint_tracks_documents_and_tokenizer(tmp_path, corpus, sp_path, prepared):
    again = run_prepare(corpus, tmp_path / "again", tokenizer=load_tokenizer(sp_path), shard_tokens=10_000, workers=2)
    assert again.index["fingerprint"] == prepared.index["fingerprint"]  # shard size and workers do not matter
    assert (
        raw_stream(again.out, again.index, "train").tobytes()
        == raw_stream(prepared.out, prepared.index, "train").tobytes()
    )
    changed = write_corpus(tmp_path / "changed")
    (changed / "doc03.txt").write_text((changed / "doc03.txt").read_text() + "one more line\n")
    other_docs = run_prepare(changed, tmp_path / "o1", tokenizer=load_tokenizer(sp_path))
    assert other_docs.index["fingerprint"] != prepared.index["fingerprint"]
    stub_a = run_prepare(corpus, tmp_path / "o2", tokenizer=StubTokenizer("a"))
    stub_b = run_prepare(corpus, tmp_path / "o3", tokenizer=StubTokenizer("b"))
    assert len({stub_a.index["fingerprint"], stub_b.index["fingerprint"], prepared.index["fingerprint"]}) == 3


def test_single_document_is_cut_like_build(tmp_path, sp_path):
    src = tmp_path / "one.txt"
    src.write_text("sweet love hath not a word more\n" * 40)
    res = run_prepare(src, tmp_path / "out", tokenizer=load_tokenizer(sp_path), val_fraction=0.1)
    whole = pack_documents([src.read_text()], load_tokenizer(sp_path))
    cut = int(len(whole) * 0.9)
    assert np.array_equal(raw_stream(res.out, res.index, "train"), whole[:cut])
    assert np.array_equal(raw_stream(res.out, res.index, "val"), whole[cut:])
    assert (res.index["splits"]["train"]["documents"], res.index["splits"]["val"]["documents"]) == (1, 0)


class Crash(RuntimeError):
    pass


def crash_after_first_write(monkeypatch):
    original = SplitWriter.write

    def write(self, *args, **kwargs):
        original(self, *args, **kwargs)  # some shard bytes are on disk when the "crash" comes
        raise Crash("simulated crash mid-write")

    monkeypatch.setattr(SplitWriter, "write", write)


def test_crash_mid_write_leaves_nothing_and_keeps_previous_output(tmp_path, corpus, sp_path, monkeypatch):
    tok = load_tokenizer(sp_path)
    crash_after_first_write(monkeypatch)
    with pytest.raises(Crash):
        run_prepare(corpus, tmp_path / "fresh", tokenizer=tok)
    assert list(tmp_path.iterdir()) == []  # neither the output nor its temporary sibling
    monkeypatch.undo()
    good = run_prepare(corpus, tmp_path / "out", tokenizer=tok, shard_tokens=97)
    before = {p.name: p.read_bytes() for p in good.out.iterdir()}
    crash_after_first_write(monkeypatch)
    with pytest.raises(Crash):
        run_prepare(corpus, tmp_path / "out", tokenizer=tok, shard_tokens=50, overwrite=True)
    assert {p.name: p.read_bytes() for p in good.out.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_refuses_to_overwrite_without_the_flag(tmp_path, corpus, sp_path):
    tok = load_tokenizer(sp_path)
    first = run_prepare(corpus, tmp_path / "out", tokenizer=tok, shard_tokens=97)
    with pytest.raises(ConfigError, match=r"^--out: .* already holds prepared shards; pass --overwrite"):
        run_prepare(corpus, tmp_path / "out", tokenizer=tok)
    second = run_prepare(corpus, tmp_path / "out", tokenizer=tok, shard_tokens=100_000, overwrite=True)
    assert len(second.index["splits"]["train"]["shards"]) == 1 < len(first.index["splits"]["train"]["shards"])
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "index.json",
        "tokenizer.model",
        "train_00000.bin",
        "val_00000.bin",
    ]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(ConfigError, match=r"^--out: .* non-empty folder without index.json"):
        run_prepare(corpus, tmp_path / "mine", tokenizer=tok, overwrite=True)


def test_damaged_directory_gives_one_line_errors(tmp_path, corpus, sp_path):
    res = run_prepare(corpus, tmp_path / "out", tokenizer=load_tokenizer(sp_path), shard_tokens=97)
    shard = res.out / "train_00001.bin"
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(ConfigError) as err:
        open_prepared(res.out, 8)
    assert str(err.value).startswith(
        f"data.path: shard {shard} holds 192 bytes but index.json says 97 uint16 tokens (194 bytes)"
    )
    assert "\n" not in str(err.value)
    shard.unlink()
    with pytest.raises(ConfigError, match=r"^data.path: shard .*train_00001.bin listed in index.json is missing"):
        open_prepared(res.out, 8)
    (res.out / INDEX_FILE).write_text("{not json")
    with pytest.raises(ConfigError, match=r"^data.path: .*index.json is not valid JSON"):
        open_prepared(res.out, 8)
    (res.out / INDEX_FILE).write_text(json.dumps({**res.index, "splits": {}}))
    with pytest.raises(ConfigError, match=r"^data.path: .* not a valid shard index \(no field 'splits.train.shards'\)"):
        open_prepared(res.out, 8)
    with pytest.raises(ConfigError, match=r"^data.path: .* has no index.json"):
        open_prepared(tmp_path, 8)


def test_a_token_id_beyond_the_vocabulary_names_the_shard_and_offset(tmp_path, corpus, sp_path):
    """A shard damaged in place (same size) with an id past the vocabulary: the read that meets it is one line
    naming the shard and the token offset in it, not an IndexError in the embedding."""
    import numpy as np

    res = run_prepare(corpus, tmp_path / "out", tokenizer=load_tokenizer(sp_path), shard_tokens=97)
    shard = res.out / "train_00001.bin"
    tokens = np.fromfile(shard, dtype=np.uint16)
    tokens[41] = res.index["vocab_size"] + 3
    tokens.tofile(shard)
    train, _, _ = open_prepared(res.out, 8)
    train.batch(range(10))  # train_00000 only: nothing wrong there
    with pytest.raises(ConfigError) as err:
        train.batch(range(len(train)))
    assert str(err.value).startswith(
        f"data.path: shard {shard} holds token id {res.index['vocab_size'] + 3} at token offset 41, beyond the "
        f"vocabulary of {res.index['vocab_size']} ids"
    )


_WRITE = SplitWriter.write


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.fixture
def small_chunks(monkeypatch):
    """Two documents per tokenisation chunk and a journal after every chunk: resumes at fine grain."""
    import data.prepare
    import data.prepare_output

    monkeypatch.setattr(data.prepare, "CHUNK_DOCS", 2)
    monkeypatch.setattr(data.prepare_output, "JOURNAL_SECONDS", 0.0)


def interrupt_after(monkeypatch, writes: int, *, garbage: bool = False):
    """KeyboardInterrupt after ``writes`` SplitWriter.write calls; ``garbage``: first append bytes the
    journal never recorded, as a kill between a write and its journal entry leaves them."""
    original, count = _WRITE, [0]

    def write(self, *args, **kwargs):
        if count[0] == writes:
            if garbage and self._file is not None:
                self._file.write(b"\xff" * 10)
                self._file.flush()
            raise KeyboardInterrupt
        count[0] += 1
        original(self, *args, **kwargs)

    monkeypatch.setattr(SplitWriter, "write", write)


def restore_write(monkeypatch):
    monkeypatch.setattr(SplitWriter, "write", _WRITE)


@pytest.mark.parametrize("garbage", [False, True])
def test_an_interrupted_prepare_resumes_to_the_same_bytes(
    tmp_path, corpus, sp_path, monkeypatch, small_chunks, garbage
):
    tok = load_tokenizer(sp_path)
    reference = run_prepare(corpus, tmp_path / "reference", tokenizer=tok, shard_tokens=97)
    interrupt_after(monkeypatch, 3, garbage=garbage)
    with pytest.raises(KeyboardInterrupt):
        run_prepare(corpus, tmp_path / "out", tokenizer=tok, shard_tokens=97)
    partial = tmp_path / "out.partial"
    assert (partial / "progress.json").is_file() and not (partial / "owner").exists()
    assert not (tmp_path / "out").exists()
    restore_write(monkeypatch)
    notes: list[str] = []
    cfg = PrepareConfig(out=str(tmp_path / "out"), path=str(corpus), shard_tokens=97)
    resumed = prepare(cfg, tokenizer=tok, log=notes.append, progress=False)
    assert any(n.startswith(f"resuming {partial}: 6 documents") for n in notes), notes
    assert folder_bytes(resumed.out) == folder_bytes(reference.out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "reference"]


def test_a_partial_folder_from_other_inputs_is_discarded(tmp_path, corpus, sp_path, monkeypatch, small_chunks):
    tok = load_tokenizer(sp_path)
    interrupt_after(monkeypatch, 2)
    with pytest.raises(KeyboardInterrupt):
        run_prepare(corpus, tmp_path / "out", tokenizer=tok, shard_tokens=97)
    restore_write(monkeypatch)
    notes: list[str] = []
    cfg = PrepareConfig(out=str(tmp_path / "out"), path=str(corpus), shard_tokens=50)
    done = prepare(cfg, tokenizer=tok, log=notes.append, progress=False)
    assert notes == [f"note: discarding {tmp_path / 'out.partial'} (left by a run with other inputs, or unreadable)"]
    reference = run_prepare(corpus, tmp_path / "reference", tokenizer=tok, shard_tokens=50)
    assert folder_bytes(done.out) == folder_bytes(reference.out)


def test_a_second_live_prepare_on_the_same_out_is_refused(tmp_path, corpus, sp_path):
    partial = tmp_path / "out.partial"
    partial.mkdir()
    (partial / "owner").write_text(f"{os.getppid()}\n")  # a live process that is not this one
    with pytest.raises(ConfigError, match=r"^--out: another data.prepare \(pid \d+\) is writing"):
        run_prepare(corpus, tmp_path / "out", tokenizer=load_tokenizer(sp_path))
    (partial / "owner").write_text("999999999\n")  # a dead one: taken over
    assert run_prepare(corpus, tmp_path / "out", tokenizer=load_tokenizer(sp_path)).out.is_dir()


@pytest.mark.parametrize("where", ["file", "readonly"])
def test_an_unwritable_out_is_refused_before_the_tokenizer_is_trained(tmp_path, corpus, monkeypatch, where):
    import data.prepare
    import data.prepare_output

    def no_training(*args, **kwargs):
        raise AssertionError("the tokenizer was trained before --out was checked")

    monkeypatch.setattr(data.prepare, "resolve_tokenizer", no_training)
    if where == "file":
        (tmp_path / "file").write_text("x")
        out, needle = tmp_path / "file" / "shards", "which is a file"
    else:
        out, needle = Path("/sys/focused-pretrain-shards"), "cannot write in '/sys'"
        if os.access("/sys", os.W_OK) and not Path("/sys/kernel").is_dir():
            # No sysfs here (a sandbox's plain /sys): the refusal a read-only mount gives is simulated instead.
            mkdtemp = data.prepare_output.tempfile.mkdtemp

            def read_only_sys(*args, **kwargs):
                if str(kwargs.get("dir", "")).startswith("/sys"):
                    raise OSError(errno.EROFS, os.strerror(errno.EROFS))
                return mkdtemp(*args, **kwargs)

            monkeypatch.setattr(data.prepare_output.tempfile, "mkdtemp", read_only_sys)
    with pytest.raises(ConfigError) as err:
        run_prepare(corpus, out)
    assert str(err.value).startswith("--out: ") and needle in str(err.value) and "\n" not in str(err.value)


def test_memmap_path_resumes_exactly_on_two_ranks(prepared):
    """After a restart at an arbitrary step the next 1,000 sequences (both ranks together) equal
    an uninterrupted run's. The memmap path needs no loader workers: a batch is a few slices."""
    import torch

    from data.loader import BatchLoader
    from data.shards import open_prepared

    train_set, _, _ = open_prepared(prepared.out, 8)

    def loaders():
        return [
            BatchLoader(train_set, batch_size=8, micro_batch_size=2, rank=r, world_size=2, seed=5) for r in range(2)
        ]

    def draw(ls, steps):
        return [torch.cat([torch.cat(ld.next_step()) for ld in ls]) for _ in range(steps)]

    whole = loaders()
    draw(whole, 37)
    reference = torch.cat(draw(whole, 125))  # 125 steps x 8 = 1,000 sequences
    first = loaders()
    draw(first, 37)
    states = [ld.state_dict() for ld in first]
    resumed = loaders()
    for ld in resumed:
        ld.load_state_dict(states)
    got = torch.cat(draw(resumed, 125))
    assert got.shape == (1000, 9) and torch.equal(got, reference)
    assert len(train_set) < 1000, "the 1,000 sequences cross an epoch boundary (reshuffled per epoch)"
