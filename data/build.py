"""What a run trains on, whatever the source: ``build_corpus`` returns a Corpus.

- embedded / local: documents -> train/validation split by document -> tokenizer -> packed token
  arrays (cached); indexable, so the global batch of a step does not depend on the world size.
- prepared: the memmap shards of ``python -m data.prepare`` (indexable the same way).
- hub sources, mixtures, local with ``data.streaming``: a stream (``data.streaming``) read by the
  loader workers; validation from ``data.val_path`` when given.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from core.errors import ConfigError
from data.config import DataConfig
from data.packing import PackedDataset, pack_documents
from data.sources import Document, iter_documents
from data.tokenizer import Tokenizer, get_tokenizer, load_tokenizer

if TYPE_CHECKING:
    from data.shards import PreparedDataset
    from data.stream_config import StreamConfig

CACHE_FORMAT = "tokens-v1"  # bump when packing changes, so old caches are not reused


@dataclass
class Corpus:
    tokenizer: Tokenizer
    train: PackedDataset | PreparedDataset | None  # None for a stream
    val: PackedDataset | PreparedDataset | None  # None: a stream without data.val_path
    fingerprint: (
        str  # documents (or stream settings) + tokenizer + split + seq_len: stored in checkpoints, checked at resume
    )
    unigram_entropy: float | None  # nats per token of the training split's unigram distribution (None: a stream)
    num_documents: tuple[int, int]  # (train, val); 0 where unknown (a stream)
    stream: StreamConfig | None = None  # data.streaming.StreamConfig of a streamed run (its seed set by the trainer)


ENTROPY_SAMPLE = 10_000_000  # tokens of a prepared split the unigram entropy is measured on


def _doc_hash(doc_id: str) -> float:
    """A stable position in [0, 1) for a document id (Python's hash() is salted per process)."""
    return int(hashlib.sha1(doc_id.encode()).hexdigest()[:12], 16) / 16**12


def split_documents(docs: list[Document], val_fraction: float) -> tuple[list[Document], list[Document]]:
    """Deterministic split by document: a document is held out when its id hashes below val_fraction.

    With two or more documents both splits are non-empty (the lowest hash always validates,
    the highest always trains); a single document always trains (build_corpus cuts its tail).
    """
    if len(docs) < 2:
        return list(docs), []
    ranked = sorted(docs, key=lambda d: _doc_hash(d.id))
    val_ids = {d.id for d in ranked if _doc_hash(d.id) < val_fraction}
    val_ids.add(ranked[0].id)
    val_ids.discard(ranked[-1].id)
    return [d for d in docs if d.id not in val_ids], [d for d in docs if d.id in val_ids]


def unigram_entropy(tokens: np.ndarray, vocab_size: int) -> float:
    """-sum p ln p over the token frequencies of ``tokens``, in nats."""
    counts = np.bincount(tokens, minlength=vocab_size).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def _content_hash(docs: list[Document]) -> str:
    h = hashlib.sha256()
    for d in docs:
        for part in (d.id, d.text):
            data = part.encode()
            h.update(len(data).to_bytes(8, "little"))  # length-prefixed: no two corpora hash alike
            h.update(data)
    return h.hexdigest()


def _save_npy(path: Path, array: np.ndarray) -> None:
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        np.save(f, array)
    os.replace(tmp, path)


def _load_cached(train_path: Path, val_path: Path) -> tuple[np.ndarray, np.ndarray] | None:
    if not (train_path.is_file() and val_path.is_file()):
        return None
    try:
        return np.load(train_path), np.load(val_path)
    except (OSError, ValueError):  # a damaged cache is rebuilt, not trusted
        return None


def build_corpus(cfg: DataConfig, *, vocab_size: int, log: Callable[[str], None] = print) -> Corpus:
    """The Corpus of ``cfg``: read and packed, opened from prepared shards, or described as a stream."""
    cfg.validate()
    if cfg.source == "prepared":
        return _prepared_corpus(cfg, vocab_size=vocab_size, log=log)
    if cfg.is_streaming:
        return _stream_corpus(cfg, vocab_size=vocab_size, log=log)
    return _packed_corpus(cfg, vocab_size=vocab_size, log=log)


def _prepared_corpus(cfg: DataConfig, *, vocab_size: int, log: Callable[[str], None]) -> Corpus:
    from data.shards import load_prepared_tokenizer, open_prepared

    train, val, index = open_prepared(cfg.path, cfg.seq_len)
    tokenizer = load_prepared_tokenizer(cfg.path, index)
    if cfg.tokenizer != "train" and load_tokenizer(cfg.tokenizer).fingerprint != tokenizer.fingerprint:
        raise ConfigError(
            f"data.tokenizer: {cfg.tokenizer} is not the tokenizer the shards in {cfg.path} were written with; leave "
            "data.tokenizer = 'train' (the shards carry theirs)"
        )
    if tokenizer.vocab_size > vocab_size:
        raise ConfigError(
            f"model.vocab_size: {vocab_size} is smaller than the {tokenizer.vocab_size} tokens of the prepared shards' "
            "tokenizer"
        )
    for name, split in (("training", train), ("validation", val)):
        if len(split) < 1:
            raise ConfigError(
                f"data.seq_len: the prepared {name} split has fewer than data.seq_len + 1 = {cfg.seq_len + 1} tokens"
            )
    sample = np.asarray(train.tokens[: min(len(train.tokens), ENTROPY_SAMPLE)])
    splits = index["splits"]
    log(
        f"data: prepared shards {cfg.path}, {splits['train']['documents']:,} train / {splits['val']['documents']:,} "
        "validation documents, "
        f"{splits['train']['tokens']:,} / {splits['val']['tokens']:,} tokens ({index['dtype']})"
    )
    return Corpus(
        tokenizer=tokenizer,
        train=train,
        val=val,
        fingerprint=hashlib.sha256(f"prepared|{index['fingerprint']}|{cfg.seq_len}".encode()).hexdigest()[:24],
        unigram_entropy=unigram_entropy(sample, tokenizer.vocab_size),
        num_documents=(splits["train"]["documents"], splits["val"]["documents"]),
    )


def _stream_corpus(cfg: DataConfig, *, vocab_size: int, log: Callable[[str], None]) -> Corpus:
    """A streamed run: the tokenizer (loaded, or trained on the first documents of the stream) and,
    from ``data.val_path``, a packed validation split. The training stream itself is opened by the
    trainer's loader (per rank, per worker)."""
    from data.streaming import StreamDataset

    stream = cfg.stream_config(seed=0)
    described = repr(sorted((spec.name, round(w, 12)) for spec, w in stream.sources()))

    def sample_texts() -> Iterator[str]:
        docs = StreamDataset(stream).documents(0, 1)
        for _, doc in zip(range(cfg.tokenizer_sample_docs), docs):
            yield doc.text

    tokenizer = get_tokenizer(
        cfg,
        vocab_size=vocab_size,
        log=log,
        texts=sample_texts,
        corpus_fingerprint=hashlib.sha256(
            f"stream|{described}|{cfg.split}|{cfg.tokenizer_sample_docs}".encode()
        ).hexdigest(),
    )
    val = None
    if cfg.val_path:
        from data.sources import iter_local

        val_tokens = pack_documents((d.text for d in iter_local(cfg.val_path, cfg.text_field)), tokenizer)
        val = PackedDataset(val_tokens, cfg.seq_len)
        if len(val) < 1:
            raise ConfigError(
                f"data.val_path: {cfg.val_path} holds {len(val_tokens)} tokens, fewer than data.seq_len + 1 = "
                f"{cfg.seq_len + 1}"
            )
    log(
        f"data: streaming {described} (split {cfg.split}, shuffle window {cfg.shuffle_window}, {cfg.num_workers} "
        "loader workers per rank); "
        + (
            f"validation {cfg.val_path}, {len(val):,} sequences"
            if val is not None
            else "no validation split (set data.val_path)"
        )
    )
    parts = (described, cfg.split, cfg.shuffle_window, cfg.text_field, tokenizer.fingerprint, cfg.seq_len, cfg.val_path)
    settings = "|".join(map(str, parts))
    return Corpus(
        tokenizer=tokenizer,
        train=None,
        val=val,
        fingerprint=hashlib.sha256(f"stream|{settings}".encode()).hexdigest()[:24],
        unigram_entropy=None,
        num_documents=(0, 0),
        stream=stream,
    )


def _packed_corpus(cfg: DataConfig, *, vocab_size: int, log: Callable[[str], None]) -> Corpus:
    """Read, split, tokenise and pack ``cfg``'s documents; token arrays are cached under ``cache_dir/tokens``."""
    docs = list(iter_documents(cfg))
    if not docs:
        raise ConfigError(f"data.path: {cfg.path or cfg.source!r} holds no documents")
    content = _content_hash(docs)
    train_docs, val_docs = split_documents(docs, cfg.val_fraction)
    single = len(docs) == 1

    def tokenizer_texts() -> Iterator[str]:
        if single:  # the held-out tail of a lone document stays out of the tokenizer too
            text = docs[0].text
            return iter([text[: int(len(text) * (1 - cfg.val_fraction))]])
        return (d.text for d in train_docs)

    tokenizer = get_tokenizer(
        cfg,
        vocab_size=vocab_size,
        log=log,
        corpus_fingerprint=hashlib.sha256(f"{content}|{cfg.val_fraction}".encode()).hexdigest(),
        texts=tokenizer_texts,
    )

    key = hashlib.sha256(f"{CACHE_FORMAT}|{content}|{cfg.val_fraction}|{tokenizer.fingerprint}".encode()).hexdigest()[
        :24
    ]
    cache = cfg.cache_path / "tokens"
    train_path, val_path = cache / f"{key}.train.npy", cache / f"{key}.val.npy"
    cached = _load_cached(train_path, val_path)
    if cached is not None:
        train_tokens, val_tokens = cached
        how = "cached"
    else:
        train_tokens = pack_documents((d.text for d in train_docs), tokenizer)
        if single:
            cut = int(len(train_tokens) * (1 - cfg.val_fraction))
            train_tokens, val_tokens = train_tokens[:cut], train_tokens[cut:]
        else:
            val_tokens = pack_documents((d.text for d in val_docs), tokenizer)
        cache.mkdir(parents=True, exist_ok=True)
        _save_npy(val_path, val_tokens)  # val first: a build reads the cache only when both files exist
        _save_npy(train_path, train_tokens)
        how = f"tokenised; saved to {cache}"
    if single:
        log(f"data: a single document; its last {cfg.val_fraction:.0%} of tokens is the validation split")
    log(
        f"data: {cfg.source} corpus, {len(train_docs)} train / {len(val_docs)} validation documents, "
        f"{len(train_tokens):,} / {len(val_tokens):,} tokens ({how})"
    )
    train, val = PackedDataset(train_tokens, cfg.seq_len), PackedDataset(val_tokens, cfg.seq_len)
    if len(train) < 1:
        raise ConfigError(
            f"data.seq_len: the training split has {len(train_tokens)} tokens, fewer than one sequence of "
            f"data.seq_len + 1 = {cfg.seq_len + 1}; lower data.seq_len or add data"
        )
    if len(val) < 1:
        raise ConfigError(
            f"data.val_fraction: the validation split has {len(val_tokens)} tokens, fewer than one sequence of "
            f"data.seq_len + 1 = {cfg.seq_len + 1}; raise data.val_fraction or lower data.seq_len"
        )
    fingerprint = hashlib.sha256(f"{key}|{cfg.seq_len}".encode()).hexdigest()[:24]
    return Corpus(
        tokenizer=tokenizer,
        train=train,
        val=val,
        fingerprint=fingerprint,
        unigram_entropy=unigram_entropy(train_tokens, tokenizer.vocab_size),
        num_documents=(len(train_docs), len(val_docs)),
    )
