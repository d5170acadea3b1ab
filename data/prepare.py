"""Pre-tokenise a corpus into memmap shards (format: data/shards.py) for the fast data path.

``python -m data.prepare --source local|embedded --path DIR_OR_FILE_OR_GLOB --out DIR
[--tokenizer PATH|train] [--vocab-size N] [--text-field text] [--val-fraction 0.05]
[--shard-tokens N] [--workers N] [--overwrite]``

Documents, train / validation split, tokenizer and packing are the trainer's own
(data.sources, data.build.split_documents, data.tokenizer, EOS after every document), so the
shards hold exactly the token streams ``build_corpus`` would build from the same settings.
"""

from __future__ import annotations

import hashlib
import itertools
import multiprocessing
import signal
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import numpy as np
from tqdm import tqdm

from core.errors import ConfigError, OneLineParser, check_choice, check_min, check_range, cli_errors
from data.config import SOURCES, DataConfig
from data.prepare_output import Journal, check_writable, partial_dir, partial_output
from data.shards import (
    DEFAULT_SHARD_TOKENS,
    DTYPES,
    FORMAT,
    SPLITS,
    VERSION,
    SplitRecord,
    SplitWriter,
    check_output,
    make_index,
    shard_dtype,
    write_index,
)
from data.sources import Document, iter_documents
from data.tokenizer import (
    HFTokenizer,
    SentencePieceTokenizer,
    Tokenizer,
    get_tokenizer,
    load_tokenizer,
)

# data.build (and through it torch) is imported where used: spawned tokenising workers import
# this module and should start in a fraction of a second.

DEFAULT_VOCAB = 4096  # a trained tokenizer's size when --vocab-size is not given: the tiny preset's model.vocab_size
CHUNK_DOCS = 256  # documents per tokenisation task ...
CHUNK_CHARS = 4_000_000  # ... or fewer, so a task of whole books stays a few MB


@dataclass
class PrepareConfig:
    out: str
    source: str = "local"  # local | embedded
    path: str = ""  # local: a file, a folder (recursive) or a glob of .txt / .jsonl / .parquet
    tokenizer: str = "train"  # train (SentencePiece BPE on the training split, cached) | a .model / tokenizer.json
    vocab_size: int = 0  # trained tokenizer's pieces; 0 = DEFAULT_VOCAB
    text_field: str = "text"
    val_fraction: float = 0.05
    shard_tokens: int = DEFAULT_SHARD_TOKENS
    workers: int = 1  # tokenising processes; 1 = in this process
    overwrite: bool = False
    cache_dir: str = ""  # where a trained tokenizer is cached; "" = the trainer's default

    def validate(self) -> None:
        check_choice("--source", self.source, SOURCES)
        if self.source == "local" and not self.path:
            raise ConfigError(
                "--path: required with --source local (a file, folder or glob of .txt, .jsonl or .parquet)"
            )
        if self.source == "embedded" and self.path:
            raise ConfigError("--path: only used with --source local; drop it or pass --source local")
        if not self.out:
            raise ConfigError("--out: required (the folder to write the shards to)")
        check_range("--val-fraction", self.val_fraction, 0.0, 1.0, open_low=True, open_high=True)
        check_min("--shard-tokens", self.shard_tokens, 1)
        check_min("--workers", self.workers, 1)
        check_min("--vocab-size", self.vocab_size, 0)
        if not self.text_field:
            raise ConfigError("--text-field: must name the jsonl field / parquet column holding the text, got ''")
        if self.vocab_size and self.tokenizer != "train":
            raise ConfigError("--vocab-size: only used with --tokenizer train (a loaded tokenizer has its own size)")

    def data_config(self) -> DataConfig:
        """The trainer's view of the same settings (sources, tokenizer training and its cache)."""
        same = ("source", "path", "tokenizer", "text_field", "val_fraction", "cache_dir")
        return DataConfig(vocab_size=self.trained_vocab, **{name: getattr(self, name) for name in same})

    @property
    def trained_vocab(self) -> int:
        return self.vocab_size or DEFAULT_VOCAB


@dataclass
class PrepareResult:
    out: Path
    index: dict
    summary: str


# ---- tokenisation ---------------------------------------------------------------------------


def encode_chunk(tokenizer: Tokenizer, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(tokens with EOS after every text, document lengths): one array per chunk pickles cheaply."""
    encoded = tokenizer.encode_batch(texts)
    lengths = np.fromiter((len(ids) + 1 for ids in encoded), dtype=np.int64, count=len(encoded))
    ends = np.cumsum(lengths)
    tokens = np.empty(int(ends[-1]) if len(ends) else 0, dtype=np.int64)  # wide first: out-of-range ids must not wrap
    for ids, end, n in zip(encoded, ends.tolist(), lengths.tolist()):
        tokens[end - n : end - 1] = ids
    tokens[ends - 1] = tokenizer.eos_id
    if tokens.size and (tokens.min() < 0 or tokens.max() >= tokenizer.vocab_size):
        raise ConfigError(
            f"--tokenizer: produced id {int(tokens.max())} outside its vocabulary of {tokenizer.vocab_size}"
        )
    return tokens.astype(DTYPES[shard_dtype(tokenizer.vocab_size)]), lengths


_WORKER_TOKENIZER: Tokenizer | None = None


def _worker_init(tokenizer: Tokenizer | str) -> None:
    global _WORKER_TOKENIZER
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle: no traceback per worker
    _WORKER_TOKENIZER = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer


def _worker_encode(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    assert _WORKER_TOKENIZER is not None  # _worker_init ran in this worker
    return encode_chunk(_WORKER_TOKENIZER, texts)


def chunk_texts(texts: Iterable[str]) -> Iterator[list[str]]:
    chunk, chars = [], 0
    for text in texts:
        chunk.append(text)
        chars += len(text)
        if len(chunk) == CHUNK_DOCS or chars >= CHUNK_CHARS:
            yield chunk
            chunk, chars = [], 0
    if chunk:
        yield chunk


class Encoder:
    """Tokenises chunks of texts in order: in this process, or in a spawned pool of ``workers``."""

    def __init__(self, tokenizer: Tokenizer, workers: int):
        self.tokenizer = tokenizer
        self.pool = None
        if workers > 1:
            # File-backed tokenizers travel as their path (a loaded SentencePiece model does not pickle).
            ref = str(tokenizer.path) if isinstance(tokenizer, (SentencePieceTokenizer, HFTokenizer)) else tokenizer
            # spawn, not fork: a forked child inherits the parent's threads' locks (tqdm, torch, SentencePiece) mid-use
            self.pool = multiprocessing.get_context("spawn").Pool(workers, initializer=_worker_init, initargs=(ref,))

    def map(self, texts: Iterable[str], skip: int = 0) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Tokenised chunks of ``texts`` in order, after the first ``skip`` chunks (already written)."""
        chunks = itertools.islice(chunk_texts(texts), skip, None)
        if self.pool is None:
            return (encode_chunk(self.tokenizer, chunk) for chunk in chunks)
        return self.pool.imap(_worker_encode, chunks)  # imap keeps the input order

    def close(self) -> None:
        if self.pool is not None:
            self.pool.terminate()
            self.pool.join()


def _doc_starts(lengths: np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)[:-1]]) if len(lengths) else lengths


# ---- the steps ------------------------------------------------------------------------------


def read_documents(cfg: PrepareConfig) -> list[Document]:
    docs = list(iter_documents(cfg.data_config()))
    if not docs:
        raise ConfigError(f"--path: {cfg.path or cfg.source!r} holds no documents")
    return docs


def resolve_tokenizer(
    cfg: PrepareConfig, docs: list[Document], train_docs: list[Document], content: str, log: Callable[[str], None]
) -> Tokenizer:
    """A loaded file, or a SentencePiece BPE trained (and cached) exactly as data.build trains it."""
    if cfg.tokenizer != "train":
        return load_tokenizer(cfg.tokenizer)

    def texts() -> Iterable[str]:
        if len(docs) == 1:  # the held-out tail of a lone document stays out of the tokenizer too
            return iter([docs[0].text[: int(len(docs[0].text) * (1 - cfg.val_fraction))]])
        return (d.text for d in train_docs)

    key = hashlib.sha256(f"{content}|{cfg.val_fraction}".encode()).hexdigest()
    return get_tokenizer(cfg.data_config(), vocab_size=cfg.trained_vocab, corpus_fingerprint=key, texts=texts, log=log)


def write_splits(
    journal: Journal,
    cfg: PrepareConfig,
    tokenizer: Tokenizer,
    splits: dict[str, list[Document]],
    progress: bool,
) -> dict[str, SplitRecord]:
    """Every split's token stream into ``journal``'s folder, continuing where its progress left off."""
    writers = journal.writers(shard_dtype(tokenizer.vocab_size), cfg.shard_tokens)
    lone = sum(len(docs) for docs in splits.values()) == 1
    encoder = Encoder(tokenizer, cfg.workers)
    total = sum(len(docs) for docs in splits.values())
    done = sum(journal.state.documents.values())
    bar = tqdm(total=total, initial=done, unit="doc", desc="tokenising", disable=not progress, dynamic_ncols=True)
    try:
        for name in SPLITS:
            for tokens, lengths in encoder.map((d.text for d in splits[name]), skip=journal.state.chunks[name]):
                if lone:
                    _write_lone_document(writers, tokens, cfg.val_fraction)
                else:
                    writers[name].write(tokens, _doc_starts(lengths))
                journal.chunk_done(name, len(lengths), writers)
                bar.update(len(lengths))
                bar.set_postfix_str(f"{sum(w.record.tokens for w in writers.values()):,} tokens", refresh=False)
    finally:
        bar.close()
        encoder.close()
    return {name: w.close() for name, w in writers.items()}


def resume_key(content: str, cfg: PrepareConfig, tokenizer: Tokenizer) -> str:
    """What fixes the bytes written chunk by chunk: a partial folder resumes only under the same key."""
    parts = [FORMAT, str(VERSION), content, repr(float(cfg.val_fraction)), tokenizer.fingerprint]
    parts += [str(cfg.shard_tokens), shard_dtype(tokenizer.vocab_size), str(CHUNK_DOCS), str(CHUNK_CHARS)]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()


def _write_lone_document(writers: dict[str, SplitWriter], tokens: np.ndarray, val_fraction: float) -> None:
    # As data.build: a single document trains; its last val_fraction of tokens is the validation split.
    cut = int(len(tokens) * (1 - val_fraction))
    writers["train"].write(tokens[:cut], [0] if cut else [])
    writers["val"].write(tokens[cut:])


def prepare(
    cfg: PrepareConfig, *, tokenizer: Tokenizer | None = None, log: Callable[[str], None] = print, progress: bool = True
) -> PrepareResult:
    """Read, split, tokenise and write ``cfg``'s documents to ``cfg.out`` (atomically).

    ``tokenizer``, when given, is used instead of ``cfg.tokenizer`` (any object with the
    Tokenizer surface: vocab_size, eos_id, fingerprint, file_name, encode_batch, save).
    """
    cfg.validate()
    check_output(Path(cfg.out).expanduser(), cfg.overwrite)  # before the slow part
    check_writable(Path(cfg.out))
    from data.build import _content_hash, split_documents

    docs = read_documents(cfg)
    content = _content_hash(docs)
    train_docs, val_docs = split_documents(docs, cfg.val_fraction)
    tok = tokenizer or resolve_tokenizer(cfg, docs, train_docs, content, log)
    key = resume_key(content, cfg, tok)
    with partial_output(cfg.out, key=key, overwrite=cfg.overwrite, log=log) as journal:
        tmp = journal.directory
        tok_file = tok.save(tmp).name
        splits = {"train": train_docs, "val": val_docs}
        records = write_splits(journal, cfg, tok, splits, progress)
        for name, record in records.items():
            record.content_sha256 = _content_hash(splits[name])
        source = {"source": cfg.source, "path": cfg.path, "text_field": cfg.text_field}
        index = make_index(
            tokenizer=tok,
            tokenizer_file=tok_file,
            splits=records,
            content_sha256=content,
            val_fraction=cfg.val_fraction,
            shard_tokens=cfg.shard_tokens,
            source=source,
        )
        write_index(tmp, index)
    out = Path(cfg.out).expanduser()
    return PrepareResult(out, index, summary_line(out, index))


def summary_line(out: Path, index: dict) -> str:
    train, val = index["splits"]["train"], index["splits"]["val"]
    shards = len(train["shards"]) + len(val["shards"])
    return (
        f"prepared {out}: {train['documents'] + val['documents']:,} documents ({train['documents']:,} train / "
        f"{val['documents']:,} val), {train['tokens'] + val['tokens']:,} tokens ({train['tokens']:,} / "
        f"{val['tokens']:,}), "
        f"{shards} shards, {index['dtype']}, fingerprint {index['fingerprint']}"
    )


# ---- command line ---------------------------------------------------------------------------

# Errors raised by shared code name the trainer's config keys; the CLI names its own options.
_CLI_NAMES = {
    "data.path:": "--path:",
    "data.text_field:": "--text-field:",
    "data.tokenizer:": "--tokenizer:",
    "data.vocab_size:": "--vocab-size:",
    "data.val_fraction:": "--val-fraction:",
}


def _cli_message(message: str) -> str:
    for key, option in _CLI_NAMES.items():
        if message.startswith(key):
            return option + message[len(key) :]
    return message


def parse_args(argv: list[str] | None) -> PrepareConfig:
    p = OneLineParser(prog="python -m data.prepare", description="Pre-tokenise a corpus into memmap shards.")
    p.add_argument("--source", choices=SOURCES, default=None, help="default: local with --path, else embedded")
    p.add_argument("--path", default="", help="local: a file, folder (recursive) or glob of .txt / .jsonl / .parquet")
    p.add_argument("--out", required=True, help="folder to write (created atomically)")
    p.add_argument(
        "--tokenizer",
        default="train",
        help="'train' (SentencePiece BPE on the training split) or a .model / tokenizer.json",
    )
    p.add_argument("--vocab-size", type=int, default=0, help=f"pieces of a trained tokenizer (default {DEFAULT_VOCAB})")
    p.add_argument("--text-field", default="text", help="jsonl field / parquet column holding the text")
    p.add_argument("--val-fraction", type=float, default=0.05)
    p.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS, help="tokens per shard file")
    p.add_argument("--workers", type=int, default=1, help="tokenising processes (1 = in this process)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing prepared folder (atomically)")
    p.add_argument(
        "--cache-dir",
        default="",
        help="where a trained tokenizer is cached (default: $FOCUSED_PRETRAIN_CACHE or ~/.cache/focused-pretrain)",
    )
    args = p.parse_args(argv)
    return PrepareConfig(
        out=args.out,
        source=args.source or ("local" if args.path else "embedded"),
        path=args.path,
        tokenizer=args.tokenizer,
        vocab_size=args.vocab_size,
        text_field=args.text_field,
        val_fraction=args.val_fraction,
        shard_tokens=args.shard_tokens,
        workers=args.workers,
        overwrite=args.overwrite,
        cache_dir=args.cache_dir,
    )


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the main thread is, so cleanup runs as for Ctrl-C."""


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise Terminated(signum)


@cli_errors
def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        result = prepare(cfg, log=lambda line: print(line, file=sys.stderr, flush=True))
    except ConfigError as exc:
        print(f"error: {_cli_message(str(exc))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        signum = int(exc.args[0]) if isinstance(exc, Terminated) else int(signal.SIGINT)
        kept = partial_dir(Path(cfg.out).expanduser().absolute())
        where = f"; the shards written so far are kept in {kept}: the same command resumes" if kept.is_dir() else ""
        print(f"error: interrupted by {signal.Signals(signum).name}{where}", file=sys.stderr)
        return 128 + signum
    except OSError as exc:  # disk full, a folder made read-only meanwhile ...
        name = f" ({exc.filename})" if exc.filename else ""
        print(f"error: --out: {exc.strerror or exc}{name}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(result.summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
