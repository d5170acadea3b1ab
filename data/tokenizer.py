"""Tokenizers: SentencePiece (train and load), Hugging Face ``tokenizer.json`` and tokenizer folders (load).

A Hugging Face tokenizer folder (what ``AutoTokenizer.from_pretrained`` reads) loads as its
``tokenizer.json`` (else ``tokenizer.model``, else a ``.tiktoken`` file; a folder holding only the slow
files, ``vocab.json`` + ``merges.txt`` say, is converted in memory by ``transformers``). A ``tokenizer.json``
beside a ``tokenizer_config.json`` / ``special_tokens_map.json`` takes its end- and beginning-of-sequence
tokens from there, and ``save`` copies those files along, so a checkpoint keeps the folder's settings.

``python -m data.tokenizer train --input PATH [PATH ...] --vocab-size N [--model-type bpe|unigram] --out FILE.model``
``python -m data.tokenizer encode --tokenizer FILE --text "..."``
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from core.errors import ConfigError, OneLineParser, cli_errors, require
from data.config import (
    COMPANIONS,
    HF_COMPANIONS,
    MIN_TRAINED_VOCAB,
    DataConfig,
    check_companions,
    custom_code,
    custom_code_line,
)

EOS_CANDIDATES = ("</s>", "<|endoftext|>", "<eos>", "<|end_of_text|>")
BOS_CANDIDATES = ("<s>", "<|begin_of_text|>", "<bos>")
MODEL_TYPES = ("bpe", "unigram")
TRAIN_THREADS = 2  # fixed, so a trained model does not depend on the machine


def file_fingerprint(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


class Tokenizer:
    """Common surface of every tokenizer the trainer uses."""

    vocab_size: int
    eos_id: int
    bos_id: int | None
    fingerprint: str  # sha256 of the tokenizer file's bytes, taken when it was loaded
    path: Path
    file_name: str  # the name save() gives the file
    companions: tuple[Path, ...] = ()  # files of its Hugging Face folder that save() copies along
    _data: bytes | None = None  # the file's bytes when it exists only in memory (a converted folder)

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        raise NotImplementedError

    def save(self, directory: Path) -> Path:
        """Copy the tokenizer file into ``directory`` (atomically) and return its path."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        dst = directory / self.file_name
        if self._data is not None:
            _atomic_copy(self._data, dst)
        else:
            _atomic_copy(self.path, dst)
        for companion in self.companions:
            _atomic_copy(companion, directory / companion.name)
        return dst


def _atomic_copy(src: Path | bytes, dst: Path) -> None:
    if isinstance(src, bytes):
        tmp = dst.with_name(f"{dst.name}.tmp{os.getpid()}")
        tmp.write_bytes(src)
        os.replace(tmp, dst)
    elif not (dst.exists() and dst.resolve() == Path(src).resolve()):
        tmp = dst.with_name(f"{dst.name}.tmp{os.getpid()}")
        shutil.copyfile(src, tmp)
        os.replace(tmp, dst)


class SentencePieceTokenizer(Tokenizer):
    file_name = "tokenizer.model"

    def __init__(self, path: Path):
        import sentencepiece as spm

        self.path = Path(path)
        data = self.path.read_bytes()
        self.sp = spm.SentencePieceProcessor()
        try:
            self.sp.LoadFromSerializedProto(data)
        except (RuntimeError, OSError) as exc:
            raise ConfigError(f"data.tokenizer: {path} is not a valid SentencePiece model ({exc})") from None
        self.fingerprint = hashlib.sha256(data).hexdigest()
        self.vocab_size = self.sp.get_piece_size()
        self.eos_id = self.sp.eos_id()
        self.bos_id = self.sp.bos_id() if self.sp.bos_id() >= 0 else None
        if self.eos_id < 0:
            raise ConfigError(f"data.tokenizer: {path} defines no end-of-sequence token")

    def encode(self, text: str) -> list[int]:
        return self.sp.encode(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self.sp.encode(texts, num_threads=os.cpu_count() or 1)

    def decode(self, ids: Sequence[int]) -> str:
        return self.sp.decode([int(i) for i in ids])


class HFTokenizer(Tokenizer):
    """``tokenizer.json``; ``special`` (``{"eos_token": ..., "bos_token": ...}`` from its folder's
    tokenizer_config.json) names the end/beginning-of-sequence tokens, else the usual names are looked up."""

    file_name = "tokenizer.json"

    def __init__(self, path: Path, *, data: bytes | None = None, special: dict[str, str] | None = None):
        from tokenizers import Tokenizer as HFTok

        self.path = Path(path)
        self._data = data
        data = self.path.read_bytes() if data is None else data
        try:
            self.tok = HFTok.from_str(data.decode("utf-8"))
        except Exception as exc:  # the Rust side raises plain Exception for any parse error
            raise ConfigError(
                f"data.tokenizer: {path} is not a valid tokenizer.json ({str(exc).splitlines()[0][:120]})"
            ) from None
        self.fingerprint = hashlib.sha256(data).hexdigest()
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        special = special or {}
        eos_names = (special["eos_token"], *EOS_CANDIDATES) if special.get("eos_token") else EOS_CANDIDATES
        eos = [i for i in map(self.tok.token_to_id, eos_names) if i is not None]
        if not eos:
            raise ConfigError(f"data.tokenizer: {path} has none of the end-of-sequence tokens {', '.join(eos_names)}")
        self.eos_id = eos[0]
        bos_names = (special["bos_token"], *BOS_CANDIDATES) if special.get("bos_token") else BOS_CANDIDATES
        bos = [i for i in map(self.tok.token_to_id, bos_names) if i is not None]
        self.bos_id = bos[0] if bos else None

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)


class TiktokenTokenizer(Tokenizer):
    """A tiktoken ranks file (``cl100k_base.tiktoken``, ...) from a local path. The file holds only
    the merges; the split pattern and special tokens come from tiktoken's definition of the
    encoding the file is named after, fed the local ranks instead of a download."""

    ENCODINGS = ("gpt2", "r50k_base", "p50k_base", "cl100k_base", "o200k_base")

    def __init__(self, path: Path):
        import tiktoken
        import tiktoken_ext.openai_public as public
        from tiktoken.load import load_tiktoken_bpe

        self.path = Path(path)
        self.file_name = self.path.name
        name = self.path.stem
        if name not in self.ENCODINGS or not hasattr(public, name):
            raise ConfigError(
                f"data.tokenizer: {path} must be named after its encoding: one of "
                f"{', '.join(e + '.tiktoken' for e in self.ENCODINGS)}"
            )
        data = self.path.read_bytes()
        self.fingerprint = hashlib.sha256(data).hexdigest()
        try:
            ranks = load_tiktoken_bpe(str(self.path))
        except Exception as exc:  # a malformed line raises ValueError / binascii.Error
            raise ConfigError(
                f"data.tokenizer: {path} is not a tiktoken ranks file ({exc.__class__.__name__})"
            ) from None
        original = public.load_tiktoken_bpe
        public.load_tiktoken_bpe = lambda *_a, **_k: ranks  # the definition's download, answered locally
        try:
            spec = getattr(public, name)()
        finally:
            public.load_tiktoken_bpe = original
        self.enc = tiktoken.Encoding(**spec)
        self.vocab_size = self.enc.n_vocab
        self.eos_id = self.enc.eot_token
        self.bos_id = None

    def encode(self, text: str) -> list[int]:
        return self.enc.encode(text, disallowed_special=())  # special-token text in data is plain text

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self.enc.encode_ordinary_batch(texts)

    def decode(self, ids: Sequence[int]) -> str:
        return self.enc.decode([int(i) for i in ids])


TOKENIZER_FILES = "a SentencePiece .model, a tokenizer.json or a tiktoken ranks file (.tiktoken)"


def _token_name(value: object) -> str | None:
    # tokenizer_config.json writes a special token as a string or as an AddedToken dict
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def hf_special_tokens(folder: Path) -> dict[str, str]:
    """``eos_token`` / ``bos_token`` a Hugging Face folder declares (tokenizer_config.json over
    special_tokens_map.json); {} when it declares none."""

    found: dict[str, str] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        file = folder / name
        if not file.is_file():
            continue
        try:
            data = json.loads(file.read_text(encoding="utf-8-sig"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"data.tokenizer: {file} is not valid JSON ({exc})") from None
        for key in ("eos_token", "bos_token"):
            token = _token_name(data.get(key)) if isinstance(data, dict) else None
            if token:
                found[key] = token
    return found


def _companions(folder: Path) -> tuple[Path, ...]:
    """The Hugging Face files beside a tokenizer that travel with it (into checkpoints and exports): refused when
    they name custom code (``data.config.custom_code``), so that no ``auto_map`` ever travels, and when one is not a
    file of the folder itself (a link out of it would copy outside content into every checkpoint and export)."""
    check_companions(folder, COMPANIONS)
    where = custom_code(folder)
    if where:
        raise ConfigError(custom_code_line(folder, where))
    return tuple(folder / name for name in HF_COMPANIONS if (folder / name).is_file())


def load_tokenizer_folder(path: Path) -> Tokenizer:
    """A Hugging Face tokenizer folder: tokenizer.json, else tokenizer.model, else one .tiktoken file,
    else the slow-tokenizer files converted by ``transformers`` (in memory; ``save`` writes tokenizer.json)."""
    companions = _companions(path)  # refuses custom code before anything is read or transformers is asked
    if (path / "tokenizer.json").is_file():
        return load_tokenizer(path / "tokenizer.json")
    if (path / "tokenizer.model").is_file():
        tok: Tokenizer = SentencePieceTokenizer(path / "tokenizer.model")
        tok.companions = companions
        return tok
    ranks = sorted(path.glob("*.tiktoken"))
    if len(ranks) == 1:
        return TiktokenTokenizer(ranks[0])
    require(
        "transformers",
        f"data.tokenizer: {path} holds no tokenizer.json, tokenizer.model or .tiktoken file; converting its other "
        "Hugging Face tokenizer files",
    )
    from transformers import AutoTokenizer

    try:
        # trust_remote_code=False also when a folder slips past the check above: transformers then refuses
        # instead of asking "run the custom code? [y/N]" at a terminal
        fast = AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
        data = fast.backend_tokenizer.to_str().encode("utf-8")
    except Exception as exc:  # transformers raises many types for a folder it cannot read
        reason = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
        raise ConfigError(
            f"data.tokenizer: {path} holds no tokenizer.json, tokenizer.model or .tiktoken file and transformers "
            f"cannot read it ({reason})"
        ) from None
    tok = HFTokenizer(path, data=data, special=hf_special_tokens(path))
    tok.companions = companions
    return tok


def load_tokenizer(path: str | Path) -> Tokenizer:
    """``.model`` -> SentencePiece, ``.json`` -> Hugging Face ``tokenizers``, ``.tiktoken`` -> tiktoken,
    a folder -> what it holds (``load_tokenizer_folder``)."""
    path = Path(path).expanduser()
    if path.is_dir():
        return load_tokenizer_folder(path)
    if not path.is_file():
        raise ConfigError(
            f"data.tokenizer: no such file {str(path)!r} (expected 'train', {TOKENIZER_FILES}, or a Hugging Face "
            "tokenizer folder)"
        )
    if path.suffix == ".model":
        return SentencePieceTokenizer(path)
    if path.suffix == ".json":
        tok = HFTokenizer(path, special=hf_special_tokens(path.parent) if path.name == "tokenizer.json" else None)
        if path.name == "tokenizer.json":
            tok.companions = _companions(path.parent)
        return tok
    if path.suffix == ".tiktoken":
        return TiktokenTokenizer(path)
    raise ConfigError(f"data.tokenizer: {str(path)!r} is not {TOKENIZER_FILES}")


SP_SETTINGS: dict[str, Any] = dict(
    byte_fallback=True,  # any UTF-8 text round-trips; unseen characters become byte tokens
    normalization_rule_name="identity",
    remove_extra_whitespaces=False,
    add_dummy_prefix=False,  # decode(encode(x)) == x, and documents concatenate cleanly
    split_digits=True,
    allow_whitespace_only_pieces=True,  # runs of spaces (indentation) become pieces
    unk_id=0,
    bos_id=1,
    eos_id=2,
    pad_id=-1,
    # SentencePiece treats its input as lines and would never see "\n"; as a user-defined
    # symbol a newline is one piece and is kept by encode / decode.
    user_defined_symbols=["\n"],
    max_sentence_length=1 << 16,
    # A cap on training lines keeps big corpora fast; the sample is reservoir-drawn with a fixed seed.
    input_sentence_size=1_000_000,
    shuffle_input_sentence=True,
)


def _training_lines(texts: Iterable[str]) -> Iterable[str]:
    # One training "sentence" per non-blank line: no piece spans a newline, which the "\n" symbol covers.
    for text in texts:
        for line in text.split("\n"):
            if line.strip():
                yield line


def train_sentencepiece(texts: Iterable[str], *, vocab_size: int, out_path: Path, model_type: str = "bpe") -> Path:
    """Train a SentencePiece model on ``texts`` and write it (atomically) to ``out_path``."""
    import sentencepiece as spm

    if model_type not in MODEL_TYPES:
        raise ConfigError(f"--model-type: {model_type!r} is not one of {', '.join(MODEL_TYPES)}")
    if vocab_size < MIN_TRAINED_VOCAB:
        raise ConfigError(
            f"data.vocab_size: {vocab_size} is too small for a trained tokenizer; must be >= {MIN_TRAINED_VOCAB} (256 "
            "byte pieces + specials)"
        )
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    model = io.BytesIO()
    spm.set_random_generator_seed(0)  # the input sample is the same on every run
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(_training_lines(texts)),
            model_writer=model,
            vocab_size=vocab_size,
            model_type=model_type,
            num_threads=TRAIN_THREADS,
            minloglevel=2,
            **SP_SETTINGS,
        )
    except RuntimeError as exc:
        reason = str(exc).splitlines()[0] if str(exc) else exc.__class__.__name__
        raise ConfigError(
            f"data.vocab_size: SentencePiece could not train {vocab_size} pieces on this text ({reason})"
        ) from None
    tmp = out_path.with_name(f"{out_path.name}.tmp{os.getpid()}")
    tmp.write_bytes(model.getvalue())
    os.replace(tmp, out_path)
    return out_path


def trained_tokenizer_key(corpus_fingerprint: str, vocab_size: int, model_type: str = "bpe") -> str:
    """Cache key of a trained tokenizer: the corpus, every training setting and the library version."""
    import sentencepiece as spm

    settings = sorted({**SP_SETTINGS, "model_type": model_type, "vocab_size": vocab_size}.items())
    return hashlib.sha256(f"{corpus_fingerprint}|{settings}|{spm.__version__}".encode()).hexdigest()[:24]


def get_tokenizer(
    cfg: DataConfig,
    *,
    vocab_size: int,
    corpus_fingerprint: str,
    texts: Callable[[], Iterable[str]],
    log: Callable[[str], None] = print,
) -> Tokenizer:
    """``cfg.tokenizer`` a path: load it. ``"train"``: a SentencePiece BPE with ``cfg.vocab_size or
    vocab_size`` pieces on ``texts()``, cached under ``cache_dir/tokenizers``."""
    if cfg.tokenizer != "train":
        tok = load_tokenizer(cfg.tokenizer)
        if tok.vocab_size > vocab_size:
            raise ConfigError(
                f"model.vocab_size: {vocab_size} is smaller than the {tok.vocab_size} tokens of data.tokenizer "
                f"({cfg.tokenizer})"
            )
        return tok
    size = cfg.vocab_size or vocab_size
    if size > vocab_size:
        raise ConfigError(
            f"model.vocab_size: {vocab_size} is smaller than the tokenizer's {size} tokens (data.vocab_size)"
        )
    path = cfg.cache_path / "tokenizers" / f"{trained_tokenizer_key(corpus_fingerprint, size)}.model"
    if path.is_file():
        log(f"tokenizer: cached SentencePiece BPE, {size} pieces ({path})")
    else:
        log(f"tokenizer: training SentencePiece BPE with {size} pieces ...")
        train_sentencepiece(texts(), vocab_size=size, out_path=path)
        log(f"tokenizer: saved {path}")
    return SentencePieceTokenizer(path)


# ---- command line -------------------------------------------------------------------------


def _read_inputs(paths: list[str]) -> Iterable[str]:
    from data.sources import iter_local

    for p in paths:
        for doc in iter_local(p):
            yield doc.text


@cli_errors
def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="python -m data.tokenizer", description="Train or apply a tokenizer.")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=OneLineParser)
    t = sub.add_parser("train", help="train a SentencePiece model (byte fallback) on text files")
    t.add_argument("--input", nargs="+", required=True, help="files, folders or globs of .txt / .jsonl / .parquet")
    t.add_argument("--vocab-size", type=int, required=True)
    t.add_argument("--model-type", default="bpe", choices=MODEL_TYPES)
    t.add_argument("--out", required=True, help="output .model path")
    e = sub.add_parser("encode", help="print the token ids of a text, space-separated")
    e.add_argument("--tokenizer", required=True, help=TOKENIZER_FILES)
    e.add_argument("--text", required=True)
    args = p.parse_args(argv)
    if args.cmd == "train":
        if not args.out.endswith(".model"):
            raise ConfigError(f"--out: {args.out!r} must end in .model")
        out = train_sentencepiece(
            _read_inputs(args.input),
            vocab_size=args.vocab_size,
            out_path=Path(args.out),
            model_type=args.model_type,
        )
        print(f"saved {out} ({SentencePieceTokenizer(out).vocab_size} pieces)")
    else:
        print(" ".join(map(str, load_tokenizer(args.tokenizer).encode(args.text))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
