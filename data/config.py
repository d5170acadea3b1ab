"""``data.*``: where text comes from, how it is tokenised, and how it is cut into sequences."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from model.errors import ConfigError

SOURCES = ("embedded", "local")


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
        if self.source not in SOURCES:
            raise ConfigError(f"data.source: {self.source!r} is not one of {', '.join(SOURCES)}")
        if self.seq_len < 1:
            raise ConfigError(f"data.seq_len: must be >= 1, got {self.seq_len}")
        if not 0.0 < self.val_fraction < 1.0:
            raise ConfigError(f"data.val_fraction: must be in (0, 1), got {self.val_fraction}")
        if self.vocab_size < 0:
            raise ConfigError(f"data.vocab_size: must be >= 0 (0 = model.vocab_size), got {self.vocab_size}")
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
