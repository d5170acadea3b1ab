from __future__ import annotations

import random

import numpy as np
import pytest

from core.errors import ConfigError
from data.build import build_corpus, split_documents, unigram_entropy
from data.config import DataConfig
from data.embedded import iter_embedded
from data.sources import Document
from data.tokenizer import train_sentencepiece


def write_corpus(folder, n_docs=6, words=600):
    rng = random.Random(0)
    vocab = [
        "thou",
        "art",
        "the",
        "king",
        "of",
        "night",
        "and",
        "day",
        "sweet",
        "love",
        "hath",
        "not",
        "a",
        "word",
        "more",
    ]
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n_docs):
        lines = [" ".join(rng.choice(vocab) for _ in range(12)) for _ in range(words // 12)]
        (folder / f"doc{i:02d}.txt").write_text("\n".join(lines) + "\n")
    return folder


def test_split_is_by_document_and_deterministic():
    docs = [Document(f"d{i}", "x") for i in range(200)]
    train, val = split_documents(docs, 0.1)
    assert {d.id for d in train}.isdisjoint({d.id for d in val}) and len(train) + len(val) == 200
    assert 8 <= len(val) <= 35
    assert {d.id for d in split_documents(list(reversed(docs)), 0.1)[1]} == {d.id for d in val}  # order-free
    two_train, two_val = split_documents(docs[:2], 0.01)
    assert len(two_train) == len(two_val) == 1
    assert split_documents(docs[:1], 0.99) == (docs[:1], [])


def test_unigram_entropy_by_hand():
    tokens = np.array([0, 0, 1, 2], dtype=np.uint16)  # p = 1/2, 1/4, 1/4
    assert unigram_entropy(tokens, 5) == pytest.approx(0.5 * np.log(2) + 2 * 0.25 * np.log(4))


@pytest.fixture(scope="module")
def own_cache(tmp_path_factory):
    """Not the session cache: this test checks the first build trains, whatever ran before it."""
    return tmp_path_factory.mktemp("build_cache")


@pytest.fixture(scope="module")
def embedded_builds(own_cache):
    cache_dir = own_cache
    cfg = DataConfig(seq_len=128, vocab_size=512, cache_dir=str(cache_dir))
    logs: list[str] = []
    first = build_corpus(cfg, vocab_size=512, log=logs.append)
    second = build_corpus(cfg, vocab_size=512, log=logs.append)
    return first, second, logs


def test_embedded_build_is_deterministic_and_cached(embedded_builds, own_cache):
    cache_dir = own_cache
    a, b, logs = embedded_builds
    assert a.fingerprint == b.fingerprint and a.tokenizer.fingerprint == b.tokenizer.fingerprint
    assert np.array_equal(a.train.tokens, b.train.tokens) and np.array_equal(a.val.tokens, b.val.tokens)
    assert "training SentencePiece" in logs[0] and "tokenised" in logs[2]
    assert "cached" in logs[3] and logs[-1].endswith("(cached)")
    assert not list(cache_dir.rglob("*.tmp*"))  # atomic writes leave no temporaries
    assert a.train.tokens.dtype == np.uint16 and a.tokenizer.vocab_size == 512


def test_embedded_split_is_disjoint_by_document(embedded_builds):
    corpus = embedded_builds[0]
    docs = list(iter_embedded())
    n_train, n_val = corpus.num_documents
    assert n_train + n_val == len(docs) == 42 and n_val >= 1
    tok = corpus.tokenizer
    assert int((corpus.train.tokens == tok.eos_id).sum()) == n_train
    assert int((corpus.val.tokens == tok.eos_id).sum()) == n_val and corpus.val.tokens[-1] == tok.eos_id
    # Cut the validation stream at EOS and decode: each piece is a whole play, none of them a training play.
    cuts = np.flatnonzero(corpus.val.tokens == tok.eos_id)
    pieces = np.split(corpus.val.tokens, cuts + 1)[:-1]
    val_texts = {tok.decode(p[:-1].tolist()) for p in pieces}
    expected_train, expected_val = split_documents(docs, 0.05)
    assert val_texts == {d.text for d in expected_val}
    assert val_texts.isdisjoint({d.text for d in expected_train})


def test_embedded_unigram_entropy_matches_a_hand_count(embedded_builds):
    corpus = embedded_builds[0]
    _, counts = np.unique(corpus.train.tokens, return_counts=True)
    p = counts / counts.sum()
    assert corpus.unigram_entropy > 0
    assert corpus.unigram_entropy == pytest.approx(float(-(p * np.log(p)).sum()), rel=1e-12)
    assert corpus.unigram_entropy < np.log(512)


@pytest.mark.slow
def test_fingerprint_follows_seq_len_and_val_fraction(embedded_builds, cache_dir):
    a = embedded_builds[0]
    other_len = build_corpus(
        DataConfig(seq_len=64, vocab_size=512, cache_dir=str(cache_dir)), vocab_size=512, log=lambda _: None
    )
    assert other_len.fingerprint != a.fingerprint and np.array_equal(other_len.train.tokens, a.train.tokens)
    other_split = build_corpus(
        DataConfig(seq_len=128, vocab_size=512, val_fraction=0.2, cache_dir=str(cache_dir)),
        vocab_size=512,
        log=lambda _: None,
    )
    assert other_split.fingerprint != a.fingerprint and other_split.num_documents[1] > a.num_documents[1]


def test_small_local_corpus_and_tokenizer_limits(tmp_path):
    folder = write_corpus(tmp_path / "corpus")
    cfg = DataConfig(source="local", path=str(folder), seq_len=16, vocab_size=300, cache_dir=str(tmp_path / "cache"))
    corpus = build_corpus(cfg, vocab_size=320, log=lambda _: None)
    assert sum(corpus.num_documents) == 6 and corpus.num_documents[1] >= 1
    with pytest.raises(
        ConfigError, match=r"^model\.vocab_size: 256 is smaller than the tokenizer's 300 tokens \(data\.vocab_size\)$"
    ):
        build_corpus(cfg, vocab_size=256, log=lambda _: None)
    # A loaded tokenizer larger than the model's vocabulary names both fields.
    model = train_sentencepiece([(folder / "doc00.txt").read_text()], vocab_size=300, out_path=tmp_path / "t.model")
    loaded = DataConfig(
        source="local", path=str(folder), seq_len=16, tokenizer=str(model), cache_dir=str(tmp_path / "cache")
    )
    with pytest.raises(ConfigError, match=r"^model\.vocab_size: 290 is smaller than the 300 tokens of data\.tokenizer"):
        build_corpus(loaded, vocab_size=290, log=lambda _: None)
    assert (
        build_corpus(loaded, vocab_size=300, log=lambda _: None).tokenizer.fingerprint != corpus.tokenizer.fingerprint
    )


def test_a_single_document_holds_out_its_tail(tmp_path):
    folder = write_corpus(tmp_path / "one", n_docs=1, words=3000)
    logs: list[str] = []
    cfg = DataConfig(
        source="local",
        path=str(folder / "doc00.txt"),
        seq_len=16,
        vocab_size=300,
        val_fraction=0.1,
        cache_dir=str(tmp_path / "c"),
    )
    corpus = build_corpus(cfg, vocab_size=300, log=logs.append)
    assert corpus.num_documents == (1, 0)
    assert any("a single document" in line and "10%" in line for line in logs)
    n_train, n_val = len(corpus.train.tokens), len(corpus.val.tokens)
    assert n_val == pytest.approx(0.1 * (n_train + n_val), abs=1) and corpus.val.tokens[-1] == corpus.tokenizer.eos_id


def test_too_small_splits_name_the_fields(tmp_path):
    folder = write_corpus(tmp_path / "corpus")  # 5 training documents (~7.9k tokens), 1 validation (~1.7k)
    cfg = DataConfig(source="local", path=str(folder), seq_len=3000, vocab_size=300, cache_dir=str(tmp_path / "c"))
    with pytest.raises(
        ConfigError,
        match=r"^data\.val_fraction: the validation split has \d+ tokens, "
        r"fewer than one sequence of data\.seq_len \+ 1 = 3001; ",
    ):
        build_corpus(cfg, vocab_size=300, log=lambda _: None)
    cfg.seq_len = 20_000
    with pytest.raises(
        ConfigError, match=r"^data\.seq_len: the training split has \d+ tokens, fewer than one sequence"
    ):
        build_corpus(cfg, vocab_size=300, log=lambda _: None)
