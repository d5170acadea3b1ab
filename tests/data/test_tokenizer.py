from __future__ import annotations

import subprocess
import sys

import pytest

from data.config import DataConfig
from data.tokenizer import get_tokenizer, load_tokenizer, train_sentencepiece
from model.errors import ConfigError
from tests.conftest import REPO

TEXTS = [
    "Now is the winter of our discontent\nMade glorious summer by this sun of York;\n",
    "To be, or not to be, that is the question:\n\nWhether 'tis nobler in the mind to suffer\n",
    "  indented  line with double  spaces\tand a tab, numbers 12345 and 2026.\n",
] * 30


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    return train_sentencepiece(TEXTS, vocab_size=320, out_path=tmp_path_factory.mktemp("tok") / "t.model")


@pytest.mark.parametrize("text", ["ROMEO.\n  Hello  world\n\n\nthere", "café — naïve 東京 🙂", " leading space", "", "tabs\tand\r\nreturns"])
def test_sentencepiece_round_trip_is_exact(sp_model, text):
    tok = load_tokenizer(sp_model)
    assert tok.decode(tok.encode(text)) == text
    assert tok.eos_id == 2 and tok.vocab_size == 320


def test_training_is_cached_by_corpus_and_settings(tmp_path):
    calls = []

    def texts():
        calls.append(1)
        return iter(TEXTS)

    cfg = DataConfig(cache_dir=str(tmp_path), vocab_size=400)
    a = get_tokenizer(cfg, vocab_size=512, corpus_fingerprint="abc", texts=texts, log=lambda _: None)
    b = get_tokenizer(cfg, vocab_size=512, corpus_fingerprint="abc", texts=texts, log=lambda _: None)
    assert calls == [1] and a.path == b.path and a.vocab_size == 400
    c = get_tokenizer(cfg, vocab_size=512, corpus_fingerprint="other", texts=texts, log=lambda _: None)
    assert calls == [1, 1] and c.path != a.path
    with pytest.raises(ConfigError, match="model.vocab_size: 256 is smaller than the tokenizer's 400"):
        get_tokenizer(cfg, vocab_size=256, corpus_fingerprint="abc", texts=texts, log=lambda _: None)


def test_gpt2_tokenizer_json(shared_data):
    tok = load_tokenizer(shared_data / "gpt2_bpe" / "gpt2_tokenizer.json")
    assert tok.encode("Hello world") == [15496, 995]
    assert tok.eos_id == 50256 and tok.vocab_size == 50257
    assert tok.decode([15496, 995]) == "Hello world"


def test_llama2_sentencepiece_model(shared_data):
    tok = load_tokenizer(shared_data / "llama2c_tokenizer" / "tokenizer.model")
    assert tok.vocab_size == 32000 and tok.eos_id == 2 and tok.bos_id == 1
    assert tok.decode(tok.encode("Hello world")) == "Hello world"


def test_cli_train_and_encode(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("".join(TEXTS))
    out = tmp_path / "cli.model"
    run = lambda *a: subprocess.run([sys.executable, "-m", "data.tokenizer", *a], cwd=REPO, capture_output=True, text=True, timeout=120)
    proc = run("train", "--input", str(corpus), "--vocab-size", "400", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    ids = run("encode", "--tokenizer", str(out), "--text", "to be")
    assert ids.returncode == 0 and load_tokenizer(out).encode("to be") == [int(x) for x in ids.stdout.split()]
    bad = run("encode", "--tokenizer", str(tmp_path / "missing.model"), "--text", "x")
    assert bad.returncode == 2 and bad.stderr.strip().startswith("error: data.tokenizer: no such file")
