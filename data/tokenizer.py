"""Tokenizers: SentencePiece (train and load) and Hugging Face ``tokenizer.json`` (load).

``python -m data.tokenizer train --input PATH [PATH ...] --vocab-size N [--model-type bpe|unigram] --out FILE.model``
``python -m data.tokenizer encode --tokenizer FILE --text "..."``
"""

from __future__ import annotations

import argparse
import hashlib
import io
import os
import shutil
import sys
from pathlib import Path
from typing import Callable, Iterable, Sequence

from model.errors import ConfigError

EOS_CANDIDATES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>")


def file_fingerprint(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


class Tokenizer:
    """Common surface of every tokenizer the trainer uses."""

    vocab_size: int
    eos_id: int
    bos_id: int | None
    path: Path
    file_name: str

    @property
    def fingerprint(self) -> str:
        return file_fingerprint(self.path)

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        raise NotImplementedError

    def save(self, directory: Path) -> Path:
        """Copy the tokenizer file into ``directory`` (atomically) and return its path."""
        dst = Path(directory) / self.file_name
        if dst.resolve() != self.path.resolve():
            tmp = dst.with_name(dst.name + ".tmp")
            shutil.copyfile(self.path, tmp)
            os.replace(tmp, dst)
        return dst


class SentencePieceTokenizer(Tokenizer):
    file_name = "tokenizer.model"

    def __init__(self, path: Path):
        import sentencepiece as spm

        self.path = Path(path)
        self.sp = spm.SentencePieceProcessor(model_file=str(self.path))
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
        return self.sp.decode(list(ids))


class HFTokenizer(Tokenizer):
    file_name = "tokenizer.json"

    def __init__(self, path: Path):
        from tokenizers import Tokenizer as HFTok

        self.path = Path(path)
        self.tok = HFTok.from_file(str(self.path))
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        ids = [self.tok.token_to_id(t) for t in EOS_CANDIDATES]
        found = [i for i in ids if i is not None]
        if not found:
            raise ConfigError(f"data.tokenizer: {path} has none of the end-of-sequence tokens {', '.join(EOS_CANDIDATES)}")
        self.eos_id = found[0]
        self.bos_id = self.tok.token_to_id("<s>")

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=False)


def load_tokenizer(path: str | Path) -> Tokenizer:
    path = Path(path).expanduser()
    if not path.is_file():
        raise ConfigError(f"data.tokenizer: no such file {str(path)!r}")
    if path.suffix == ".model":
        return SentencePieceTokenizer(path)
    if path.suffix == ".json":
        return HFTokenizer(path)
    raise ConfigError(f"data.tokenizer: {str(path)!r} is neither a SentencePiece .model nor a tokenizer.json")


SP_SETTINGS = dict(
    byte_fallback=True,  # any UTF-8 text round-trips; unseen characters become byte tokens
    normalization_rule_name="identity",
    remove_extra_whitespaces=False,
    add_dummy_prefix=False,  # decode(encode(x)) == x, and documents concatenate cleanly
    split_digits=True,
    allow_whitespace_only_pieces=True,
    unk_id=0,
    bos_id=1,
    eos_id=2,
    pad_id=-1,
    user_defined_symbols=["\n"],  # one token per newline rather than a byte fallback
    max_sentence_length=1 << 16,
    input_sentence_size=2_000_000,
    shuffle_input_sentence=True,
    seed_sentencepiece_size=200_000,
)


def _training_lines(texts: Iterable[str]) -> Iterable[str]:
    # SentencePiece learns from "sentences"; paragraphs keep pieces spanning newlines out,
    # which the "\n" symbol then covers.
    for text in texts:
        for paragraph in text.split("\n"):
            if paragraph.strip():
                yield paragraph


def train_sentencepiece(texts: Iterable[str], *, vocab_size: int, out_path: Path, model_type: str = "bpe") -> Path:
    import sentencepiece as spm

    if model_type not in ("bpe", "unigram"):
        raise ConfigError(f"--model-type: {model_type!r} is not one of bpe, unigram")
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(_training_lines(texts)),
            model_writer=model,
            vocab_size=vocab_size,
            model_type=model_type,
            num_threads=os.cpu_count() or 1,
            minloglevel=2,
            **SP_SETTINGS,
        )
    except RuntimeError as exc:
        raise ConfigError(f"data.vocab_size: SentencePiece could not train {vocab_size} pieces on this corpus ({exc})") from None
    tmp = out_path.with_name(out_path.name + f".tmp{os.getpid()}")
    tmp.write_bytes(model.getvalue())
    os.replace(tmp, out_path)
    return out_path


def get_tokenizer(cfg, *, vocab_size: int, corpus_fingerprint: str, texts: Callable[[], Iterable[str]], log: Callable[[str], None] = print) -> Tokenizer:
    """``cfg.tokenizer`` = a path: load it. ``train``: a SentencePiece BPE on ``texts()``, cached by
    a hash of the corpus, the settings and the SentencePiece version."""
    if cfg.tokenizer != "train":
        tok = load_tokenizer(cfg.tokenizer)
    else:
        import sentencepiece as spm

        size = cfg.vocab_size or vocab_size
        key = hashlib.sha256(f"{corpus_fingerprint}|bpe|{size}|{sorted(SP_SETTINGS.items())}|{spm.__version__}".encode()).hexdigest()[:20]
        path = cfg.cache_path / "tokenizers" / f"{key}.model"
        if path.is_file():
            log(f"tokenizer: cached SentencePiece BPE ({size} pieces) {path}")
        else:
            log(f"tokenizer: training SentencePiece BPE with {size} pieces ...")
            train_sentencepiece(texts(), vocab_size=size, out_path=path)
            log(f"tokenizer: saved {path}")
        tok = SentencePieceTokenizer(path)
    if tok.vocab_size > vocab_size:
        raise ConfigError(f"model.vocab_size: {vocab_size} is smaller than the tokenizer's {tok.vocab_size} tokens (data.tokenizer={cfg.tokenizer})")
    return tok


def _read_inputs(paths: list[str]) -> Iterable[str]:
    from data.sources import iter_local

    for p in paths:
        for doc in iter_local(p):
            yield doc.text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m data.tokenizer", description="Train or apply a tokenizer.")
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="train a SentencePiece model (byte fallback) on text files")
    t.add_argument("--input", nargs="+", required=True, help="files, folders or globs of .txt / .jsonl / .parquet")
    t.add_argument("--vocab-size", type=int, required=True)
    t.add_argument("--model-type", default="bpe", choices=("bpe", "unigram"))
    t.add_argument("--out", required=True, help="output .model path")
    e = sub.add_parser("encode", help="print the token ids of a text")
    e.add_argument("--tokenizer", required=True, help="a SentencePiece .model or a tokenizer.json")
    e.add_argument("--text", required=True)
    args = p.parse_args(argv)
    try:
        if args.cmd == "train":
            out = train_sentencepiece(_read_inputs(args.input), vocab_size=args.vocab_size, out_path=Path(args.out), model_type=args.model_type)
            print(f"saved {out} ({SentencePieceTokenizer(out).vocab_size} pieces)")
        else:
            print(" ".join(map(str, load_tokenizer(args.tokenizer).encode(args.text))))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
