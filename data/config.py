"""``data.*``: where text comes from, how it is tokenised, and how it is cut into sequences."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from model.errors import ConfigError, check_choice, check_min, check_range

SOURCES = ("embedded", "local")
MIN_TRAINED_VOCAB = 3 + 256 + 1  # <unk> <s> </s> + byte-fallback pieces + "\n"; real corpora need ~100 more


@dataclass
class DataConfig:
    source: str = "embedded"  # embedded | local
    path: str = ""  # local: a file, a folder (recursive) or a glob of .txt / .jsonl / .parquet
    seq_len: int = 256
    tokenizer: str = "train"  # train (SentencePiece BPE on the training split, cached) | path to .model | tokenizer.json
    vocab_size: int = 0  # vocabulary of a trained tokenizer; 0 = model.vocab_size
    text_field: str = "text"  # jsonl / parquet column
    val_fraction: float = 0.05  # share of documents held out, chosen by a stable hash of the document id
    cache_dir: str = ""  # "" = $FOCUSED_PRETRAIN_CACHE or ~/.cache/focused-pretrain

    def validate(self) -> None:
        check_choice("data.source", self.source, SOURCES)
        check_min("data.seq_len", self.seq_len, 1)
        check_range("data.val_fraction", self.val_fraction, 0.0, 1.0, open_low=True, open_high=True)
        check_min("data.vocab_size", self.vocab_size, 0, note=" (0 = model.vocab_size)")
        if self.tokenizer == "train" and 0 < self.vocab_size < MIN_TRAINED_VOCAB:
            raise ConfigError(f"data.vocab_size: {self.vocab_size} is too small for a trained tokenizer; must be 0 (= model.vocab_size) or >= {MIN_TRAINED_VOCAB}")
        if not self.text_field:
            raise ConfigError("data.text_field: must name the jsonl field / parquet column holding the text, got ''")
        if self.source == "local":
            from data.sources import resolve_paths

            if not self.path:
                raise ConfigError("data.path: required with data.source = 'local' (a file, folder or glob of .txt, .jsonl or .parquet)")
            resolve_paths(self.path)
        if self.tokenizer != "train":
            path = Path(self.tokenizer).expanduser()
            if not path.is_file():
                raise ConfigError(f"data.tokenizer: no such file {self.tokenizer!r} (expected 'train', a SentencePiece .model or a tokenizer.json)")
            if path.suffix not in (".model", ".json"):
                raise ConfigError(f"data.tokenizer: {self.tokenizer!r} is neither a SentencePiece .model nor a tokenizer.json")

    @property
    def cache_path(self) -> Path:
        if self.cache_dir:
            return Path(self.cache_dir).expanduser()
        env = os.environ.get("FOCUSED_PRETRAIN_CACHE")
        return Path(env).expanduser() if env else Path.home() / ".cache" / "focused-pretrain"
