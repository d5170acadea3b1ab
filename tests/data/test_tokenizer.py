from __future__ import annotations

import hashlib
import subprocess
import sys

import pytest

from core.errors import ConfigError
from data.config import DataConfig
from data.tokenizer import get_tokenizer, load_tokenizer, train_sentencepiece
from tests.conftest import REPO

TEXTS = [
    "Now is the winter of our discontent\nMade glorious summer by this sun of York;\n",
    "To be, or not to be, that is the question:\n\nWhether 'tis nobler in the mind to suffer\n",
    "  indented  line with double  spaces\tand a tab, numbers 12345 and 2026.\n",
] * 30


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    return train_sentencepiece(TEXTS, vocab_size=320, out_path=tmp_path_factory.mktemp("tok") / "t.model")


@pytest.mark.parametrize(
    "text",
    [
        "ROMEO.\n  Hello  world\n\n\nthere",
        "café — naïve 東京 🙂",  # unseen characters: byte fallback
        " leading space",
        "trailing spaces   \n",
        "\n\nstarts with newlines",
        "",
        "tabs\tand\r\nreturns",
        "digits 3.14159 and 1,000,000",
    ],
)
def test_sentencepiece_round_trip_is_exact(sp_model, text):
    tok = load_tokenizer(sp_model)
    assert tok.decode(tok.encode(text)) == text
    assert tok.eos_id == 2 and tok.bos_id == 1 and tok.vocab_size == 320


def test_newline_is_one_piece_and_batches_match(sp_model):
    tok = load_tokenizer(sp_model)
    (newline,) = tok.encode("\n")
    assert tok.encode("a\n\nb").count(newline) == 2
    assert tok.encode_batch(TEXTS[:3]) == [tok.encode(t) for t in TEXTS[:3]]
    assert len(tok.encode("1234")) == 4  # split_digits: one piece per digit


def test_training_is_deterministic(sp_model, tmp_path):
    again = train_sentencepiece(TEXTS, vocab_size=320, out_path=tmp_path / "again.model")
    assert again.read_bytes() == sp_model.read_bytes()
    assert not list(tmp_path.glob("*.tmp*"))


def test_training_is_cached_by_corpus_and_settings(tmp_path):
    calls = []

    def texts():
        calls.append(1)
        return iter(TEXTS)

    cfg = DataConfig(cache_dir=str(tmp_path), vocab_size=400)
    quiet = dict(texts=texts, log=lambda _: None)
    a = get_tokenizer(cfg, vocab_size=512, corpus_fingerprint="abc", **quiet)
    mtime = a.path.stat().st_mtime_ns
    b = get_tokenizer(cfg, vocab_size=512, corpus_fingerprint="abc", **quiet)
    assert calls == [1] and a.path == b.path and b.path.stat().st_mtime_ns == mtime and a.vocab_size == 400
    assert a.path.parent == tmp_path / "tokenizers" and a.path.suffix == ".model"
    c = get_tokenizer(cfg, vocab_size=512, corpus_fingerprint="other", **quiet)
    assert calls == [1, 1] and c.path != a.path
    get_tokenizer(DataConfig(cache_dir=str(tmp_path), vocab_size=0), vocab_size=410, corpus_fingerprint="abc", **quiet)
    assert len(calls) == 3  # vocab_size 0 = the model's vocabulary, another cache entry
    with pytest.raises(ConfigError, match="model.vocab_size: 256 is smaller than the tokenizer's 400"):
        get_tokenizer(cfg, vocab_size=256, corpus_fingerprint="abc", **quiet)


def test_save_copies_the_file_and_fingerprint_is_its_sha256(sp_model, tmp_path):
    tok = load_tokenizer(sp_model)
    assert tok.fingerprint == hashlib.sha256(sp_model.read_bytes()).hexdigest()
    saved = tok.save(tmp_path / "run")
    assert saved == tmp_path / "run" / "tokenizer.model" and saved.read_bytes() == sp_model.read_bytes()
    assert load_tokenizer(saved).save(tmp_path / "run") == saved  # saving onto itself is a no-op
    assert load_tokenizer(saved).fingerprint == tok.fingerprint


@pytest.mark.parametrize(
    "name,content,message",
    [
        ("junk.model", b"not a model", r"^data\.tokenizer: .*junk\.model is not a valid SentencePiece model"),
        ("junk.json", b"{not json", r"^data\.tokenizer: .*junk\.json is not a valid tokenizer\.json"),
        ("vocab.txt", b"x", r"is not a SentencePiece \.model, a tokenizer\.json or a tiktoken ranks file"),
        ("mine.tiktoken", b"aGk= 0\n", r"must be named after its encoding"),
        ("cl100k_base.tiktoken", b"not base64 at all\n", r"is not a tiktoken ranks file"),
    ],
)
def test_bad_tokenizer_files(tmp_path, name, content, message):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(ConfigError, match=message):
        load_tokenizer(tmp_path / name)


def test_reference_tokenizers_from_local_files(shared_data, tmp_path):
    gpt2 = load_tokenizer(shared_data / "gpt2_bpe" / "gpt2_tokenizer.json")
    assert gpt2.encode("Hello world") == [15496, 995] and gpt2.eos_id == 50256 and gpt2.vocab_size == 50257
    cl100k = load_tokenizer(shared_data / "tiktoken_cl100k" / "cl100k_base.tiktoken")
    assert cl100k.encode("Hello world") == [9906, 1917] and cl100k.eos_id == 100257 and cl100k.vocab_size == 100277
    text = "naïve <|endoftext|> text\n\tindented"
    assert cl100k.decode(cl100k.encode(text)) == text and cl100k.encode_batch([text]) == [cl100k.encode(text)]
    llama = load_tokenizer(shared_data / "llama2c_tokenizer" / "tokenizer.model")
    assert llama.vocab_size == 32000 and llama.decode(llama.encode("Hello world")) == "Hello world"
    saved = cl100k.save(tmp_path)
    assert saved.name == "cl100k_base.tiktoken" and load_tokenizer(saved).fingerprint == cl100k.fingerprint


def test_hf_tokenizer_json_needs_an_eos(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    def write(vocab, name):
        hf = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        hf.pre_tokenizer = pre_tokenizers.Whitespace()
        hf.save(str(tmp_path / name))
        return tmp_path / name

    with pytest.raises(
        ConfigError,
        match=r"^data\.tokenizer: .*none\.json has none of the end-of-sequence tokens </s>, <\|endoftext\|>, <eos>",
    ):
        load_tokenizer(write({"<unk>": 0, "a": 1}, "none.json"))
    tok = load_tokenizer(write({"<unk>": 0, "<s>": 1, "a": 2, "</s>": 3}, "ok.json"))
    assert (tok.eos_id, tok.bos_id, tok.vocab_size) == (3, 1, 4)
    assert tok.encode("a a") == [2, 2] and tok.save(tmp_path / "run").name == "tokenizer.json"


def test_gpt2_tokenizer_json(shared_data):
    tok = load_tokenizer(shared_data / "gpt2_bpe" / "gpt2_tokenizer.json")
    assert tok.encode("Hello world") == [15496, 995]
    assert tok.eos_id == 50256 and tok.vocab_size == 50257 and tok.bos_id is None
    text = "Hello  world\n\nsecond line é"
    assert tok.decode(tok.encode(text)) == text
    assert tok.encode_batch(["Hello world", text]) == [[15496, 995], tok.encode(text)]


def test_llama2_sentencepiece_model(shared_data):
    tok = load_tokenizer(shared_data / "llama2c_tokenizer" / "tokenizer.model")
    assert tok.vocab_size == 32000 and tok.eos_id == 2 and tok.bos_id == 1
    assert tok.decode(tok.encode("Hello world")) == "Hello world"


def run_cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "data.tokenizer", *args],
        check=False,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_cli_train_and_encode(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("".join(TEXTS))
    out = tmp_path / "cli.model"
    proc = run_cli("train", "--input", str(corpus), "--vocab-size", "400", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    ids = run_cli("encode", "--tokenizer", str(out), "--text", "to be")
    assert ids.returncode == 0 and load_tokenizer(out).encode("to be") == [int(x) for x in ids.stdout.split()]


@pytest.mark.parametrize(
    "args, start",
    [
        (["encode", "--tokenizer", "missing.model", "--text", "x"], "error: data.tokenizer: no such file"),
        (
            ["train", "--input", "nowhere/*.txt", "--vocab-size", "400", "--out", "x.model"],
            "error: data.path: 'nowhere/*.txt' matches no data files",
        ),
        (
            ["train", "--input", "x.txt", "--vocab-size", "many", "--out", "x.model"],
            "error: python -m data.tokenizer train: argument --vocab-size",
        ),
        (
            ["train", "--input", "x.txt", "--vocab-size", "400", "--out", "x.bin"],
            "error: --out: 'x.bin' must end in .model",
        ),
        (["decode"], "error: python -m data.tokenizer: argument cmd: invalid choice"),
    ],
)
def test_cli_errors_are_one_line(args, start):
    proc = run_cli(*args)
    assert proc.returncode == 2 and proc.stderr.startswith(start) and proc.stderr.count("\n") == 1, proc.stderr
