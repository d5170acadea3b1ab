"""Documents -> train/validation split by document -> tokenizer -> packed token arrays (cached)."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import Callable

import numpy as np

from data.config import DataConfig
from data.packing import PackedDataset, pack_documents
from data.sources import Document, iter_documents
from data.tokenizer import Tokenizer, get_tokenizer
from model.errors import ConfigError


@dataclass
class Corpus:
    tokenizer: Tokenizer
    train: PackedDataset
    val: PackedDataset
    fingerprint: str  # documents + tokenizer + split + seq_len: stored in checkpoints, checked at resume
    unigram_entropy: float  # nats per token of the training split's unigram distribution
    num_documents: tuple[int, int]  # (train, val)


def _doc_hash(doc_id: str) -> float:
    """A stable position in [0, 1) for a document id (Python's hash() is salted per process)."""
    return int(hashlib.sha1(doc_id.encode()).hexdigest()[:12], 16) / 16**12


def split_documents(docs: list[Document], val_fraction: float) -> tuple[list[Document], list[Document]]:
    """Deterministic split by document: a document is held out when its id hashes below val_fraction."""
    ranked = sorted(docs, key=lambda d: _doc_hash(d.id))
    val_ids = {d.id for d in ranked if _doc_hash(d.id) < val_fraction}
    if len(docs) >= 2:  # both splits non-empty: the lowest hash always validates, the highest always trains
        val_ids.add(ranked[0].id)
        val_ids.discard(ranked[-1].id)
    return [d for d in docs if d.id not in val_ids], [d for d in docs if d.id in val_ids]


def unigram_entropy(tokens: np.ndarray, vocab_size: int) -> float:
    counts = np.bincount(tokens, minlength=vocab_size).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def _content_hash(docs: list[Document]) -> str:
    h = hashlib.sha256()
    for d in docs:
        h.update(d.id.encode())
        h.update(b"\0")
        h.update(d.text.encode())
        h.update(b"\1")
    return h.hexdigest()


def build_corpus(cfg: DataConfig, *, vocab_size: int, log: Callable[[str], None] = print) -> Corpus:
    docs = list(iter_documents(cfg))
    if not docs:
        raise ConfigError(f"data.path: {cfg.path or cfg.source!r} holds no documents")
    content = _content_hash(docs)
    train_docs, val_docs = split_documents(docs, cfg.val_fraction)
    tokenizer = get_tokenizer(cfg, vocab_size=vocab_size, corpus_fingerprint=hashlib.sha256(f"{content}|{cfg.val_fraction}".encode()).hexdigest(), texts=lambda: (d.text for d in train_docs), log=log)

    key = hashlib.sha256(f"{content}|{cfg.val_fraction}|{tokenizer.fingerprint}".encode()).hexdigest()[:20]
    cache = cfg.cache_path / "tokens" / f"{key}.npz"
    if cache.is_file():
        with np.load(cache) as arrays:
            train_tokens, val_tokens = arrays["train"], arrays["val"]
        how = "cached"
    else:
        train_tokens = pack_documents((d.text for d in train_docs), tokenizer)
        if val_docs:
            val_tokens = pack_documents((d.text for d in val_docs), tokenizer)
        else:  # one document: hold out its last 5 %
            cut = int(len(train_tokens) * (1 - max(cfg.val_fraction, 0.05)))
            train_tokens, val_tokens = train_tokens[:cut], train_tokens[cut:]
            log("data: a single document; its last 5 % of tokens is the validation split")
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_name(f"{cache.stem}.tmp{os.getpid()}.npz")
        np.savez(tmp, train=train_tokens, val=val_tokens)
        os.replace(tmp, cache)
        how = "tokenised"
    log(f"data: {cfg.source} corpus, {len(train_docs)} train / {len(val_docs)} validation documents, "
        f"{len(train_tokens):,} / {len(val_tokens):,} tokens ({how})")
    train, val = PackedDataset(train_tokens, cfg.seq_len), PackedDataset(val_tokens, cfg.seq_len)
    if len(val) < 1:
        raise ConfigError(
            f"data.val_fraction: the validation split has {len(val_tokens)} tokens, fewer than one sequence of "
            f"data.seq_len + 1 = {cfg.seq_len + 1}; raise data.val_fraction or lower data.seq_len"
        )
    fingerprint = hashlib.sha256(f"{key}|{cfg.seq_len}".encode()).hexdigest()[:20]
    return Corpus(tokenizer, train, val, fingerprint, unigram_entropy(train_tokens, tokenizer.vocab_size), (len(train_docs), len(val_docs)))
