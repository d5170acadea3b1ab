"""Data tests never touch ~/.cache: a stray default cache_dir lands in a temporary folder. A small local corpus and a
SentencePiece tokenizer trained on it, shared by the data.prepare tests."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from data.sources import iter_local
from data.tokenizer import train_sentencepiece


@pytest.fixture(autouse=True)
def _no_home_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("FOCUSED_PRETRAIN_CACHE", str(tmp_path_factory.getbasetemp() / "default-cache"))


WORDS = ["thou", "art", "the", "king", "of", "night", "and", "day", "sweet", "love", "hath", "not", "a", "word", "more"]


def write_corpus(folder: Path, n_docs: int = 8, words: int = 240) -> Path:
    rng = random.Random(0)
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n_docs):
        lines = [" ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(words // 12)]
        (folder / f"doc{i:02d}.txt").write_text("\n".join(lines) + "\n")
    # a Windows-saved file: BOM and CRLF line endings
    (folder / "windows.txt").write_bytes(b"\xef\xbb\xbf" + b"Thou art the king\r\nof night and day\r\n" * 20)
    return folder


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus") / "txt")


@pytest.fixture(scope="module")
def sp_path(corpus, tmp_path_factory) -> Path:
    texts = (d.text for d in iter_local(str(corpus)))
    return train_sentencepiece(texts, vocab_size=300, out_path=tmp_path_factory.mktemp("tok") / "t.model")
