"""Helpers of the streaming tests: a byte-level tokenizer (documents read back out of sequences exactly),
small corpora of random letters as local files or a SlimPajama mirror, one worker's documents of an epoch, and
a loader run that stops, saves its state and is resumed by a second loader."""

from __future__ import annotations

import itertools
import json
from typing import NamedTuple

import numpy as np
import zstandard

from data.streaming import StreamDataset, StreamLoader, build_stream_loader


class ByteTokenizer:
    """UTF-8 bytes, EOS = 256: decoding is exact, so documents can be read back out of sequences."""

    vocab_size = 257
    eos_id = 256

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(t.encode()) for t in texts]


EOS = ByteTokenizer.eos_id
T = 32


def write_jsonl(path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def make_corpus(root, sizes=(23, 31, 17), alphabet="abcdefgh ", seed=0, *, slimpajama=False) -> dict[str, str]:
    """jsonl files part{i}.jsonl of varied documents; returns {document id: text}. ``slimpajama``: the same rows
    as a SlimPajama mirror (train/chunk<k>/example_train_<i>.jsonl.zst), with ids train/shard<i>:<row>."""
    rng = np.random.default_rng(seed)
    docs = {}
    for f, n in enumerate(sizes):
        rows = []
        for r in range(n):
            text = "".join(rng.choice(list(alphabet), size=int(rng.integers(3, 120))))
            rows.append({"text": text, "meta": {"redpajama_set_name": f"set{f % 2}"}})
            docs[f"train/shard{f:05d}:{r}" if slimpajama else f"part{f}.jsonl:{r}"] = text
        if slimpajama:
            path = root / "train" / f"chunk{1 + f // 2}" / f"example_train_{f % 2}.jsonl.zst"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(zstandard.ZstdCompressor().compress("".join(json.dumps(r) + "\n" for r in rows).encode()))
        else:
            write_jsonl(root / f"part{f}.jsonl", rows)
    return docs


def epoch_docs(ds: StreamDataset, epoch: int) -> list:
    """One worker's (of one) documents of an epoch."""
    return [d for d in itertools.takewhile(lambda d: d.epoch <= epoch, ds.documents(0, 1)) if d.epoch == epoch]


def epoch_ids(ds: StreamDataset, worker: int, workers: int, epoch: int) -> list[str]:
    out = []
    for doc in ds.documents(worker, workers):
        if doc.epoch > epoch:
            return out
        if doc.epoch == epoch:
            out.append(doc.id)


class Resumed(NamedTuple):
    out: list  # the uninterrupted loader's batches, stop + steps of them
    after: list  # the resumed loader's first ``steps`` batches
    loader: StreamLoader
    resumed: StreamLoader
    state: dict  # the loader state after ``stop`` batches
    counts: dict[str, int]  # token counts after ``stop`` batches, and ...
    resumed_counts: dict[str, int]  # ... the resumed loader's before its first batch


def stop_and_resume(cfg, *, stop: int, steps: int, batch: int, resume_cfg=None, edit=None, **kw) -> Resumed:
    """``stop + steps`` batches of one loader, its state saved after ``stop``; a second loader (``resume_cfg``, the
    state passed through ``edit``) loads that state and gives ``steps`` batches."""
    tok = ByteTokenizer()
    loader = build_stream_loader(cfg, tok, seq_len=T, batch_size=batch, **kw)
    it, out = iter(loader), []
    for step in range(stop + steps):
        out.append(next(it))
        if step + 1 == stop:
            state, counts = loader.state_dict(), loader.token_counts()
    resumed = build_stream_loader(resume_cfg or cfg, tok, seq_len=T, batch_size=batch, **kw)
    resumed.load_state_dict(edit(state) if edit else state)
    resumed_counts = resumed.token_counts()
    again = iter(resumed)
    after = [next(again) for _ in range(steps)]
    return Resumed(out, after, loader, resumed, state, counts, resumed_counts)
