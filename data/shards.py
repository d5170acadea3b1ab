"""Pre-tokenised memmap shards: the on-disk format, its atomic writer and its random-access reader.

A prepared directory (written by ``python -m data.prepare``) holds:

- ``train_00000.bin``, ``train_00001.bin``, ..., ``val_00000.bin``, ...: raw little-endian
  token ids (uint16 when the vocabulary fits in 65536 ids, else uint32), EOS after every
  document. Each split is ONE token stream cut into shards of exactly ``shard_tokens`` tokens
  (the last one shorter): documents span shard boundaries, so no space is wasted and the
  stream is byte-for-byte what ``data.packing.pack_documents`` gives for the same documents.
- the tokenizer file (``tokenizer.model`` or ``tokenizer.json``), copied in.
- ``index.json`` (see ``make_index``), written last; a directory is complete when it has one.

The whole directory is written under ``<out>.partial`` and renamed into place, so a crash
never leaves a half-written ``<out>``; an interrupted run resumes from what its progress journal
recorded there (data/prepare_output.py). ``PreparedDataset`` presents a split exactly like
``PackedDataset``: sequence i is ``stream[i*T : i*T + T + 1]``.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, SupportsIndex

import numpy as np
from numpy.typing import ArrayLike, DTypeLike

from core.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from data.tokenizer import Tokenizer

# torch is imported where a tensor is made: tokenising workers import this module (via data.prepare)
# and should start in a fraction of a second, not the seconds torch takes.

FORMAT = "focused-pretrain-shards"
VERSION = 1  # bump when the layout or the meaning of a field changes
INDEX_FILE = "index.json"
SPLITS = ("train", "val")
DEFAULT_SHARD_TOKENS = 2**28  # 512 MiB of uint16 per shard
# explicit byte order: shards are portable
DTYPES: dict[str, np.dtype] = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}


def shard_dtype(vocab_size: int) -> str:
    """The narrowest stored type that holds every id (same rule as data.packing.token_dtype)."""
    return "uint16" if vocab_size <= 2**16 else "uint32"


def shard_name(split: str, number: int) -> str:
    return f"{split}_{number:05d}.bin"


# ---- writing ------------------------------------------------------------------------------


@dataclass
class ShardRecord:
    file: str
    tokens: int = 0
    documents: int = 0  # documents that begin in this shard (a document may end in the next one)


@dataclass
class SplitRecord:
    tokens: int = 0
    documents: int = 0
    content_sha256: str = ""  # the split's source documents (ids + text), as data.build hashes them
    shards: list[ShardRecord] = field(default_factory=list)


class StaleProgress(Exception):
    """Files that do not hold what a progress journal says they hold: start the output afresh."""


class SplitWriter:
    """Appends one split's token stream to shards of exactly ``shard_tokens`` tokens (the last shorter)."""

    def __init__(self, directory: Path, split: str, dtype: str, shard_tokens: int, record: SplitRecord | None = None):
        """``record``: resume a split an interrupted run wrote (its shards as a progress journal recorded
        them): bytes past the record are cut off and shard files it does not list are removed."""
        if shard_tokens < 1:
            raise ConfigError(f"--shard-tokens: must be >= 1, got {shard_tokens}")
        self.directory, self.split = Path(directory), split
        self.dtype, self.cap = DTYPES[dtype], shard_tokens
        self.record = record if record is not None else SplitRecord()
        self._file: BinaryIO | None = None
        if record is not None:
            self._reopen()

    def _reopen(self) -> None:
        listed = {shard.file for shard in self.record.shards}
        for path in self.directory.glob(f"{self.split}_*.bin"):
            if path.name not in listed:
                path.unlink()
        for shard in self.record.shards:
            path, size = self.directory / shard.file, shard.tokens * self.dtype.itemsize
            if not path.is_file() or path.stat().st_size < size:
                raise StaleProgress(f"{path.name} is shorter than its progress record")
            os.truncate(path, size)
        if self.record.shards and self.record.shards[-1].tokens < self.cap:
            self._file = open(self.directory / self.record.shards[-1].file, "ab")  # as _current_shard

    def sync(self) -> None:
        """The open shard's bytes on disk (before a progress journal records them)."""
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())

    def write(self, tokens: np.ndarray, doc_starts: Sequence[int] | np.ndarray = ()) -> None:
        """Append ``tokens``; ``doc_starts`` are the offsets in ``tokens`` where a document begins."""
        tokens = np.ascontiguousarray(tokens, dtype=self.dtype)
        base = self.record.tokens
        pos = 0
        while pos < len(tokens):
            shard = self._current_shard()
            take = min(self.cap - shard.tokens, len(tokens) - pos)
            assert self._file is not None  # _current_shard opened it
            self._file.write(tokens[pos : pos + take].data.cast("B"))
            shard.tokens += take
            pos += take
        self.record.tokens += len(tokens)
        starts = np.asarray(doc_starts, dtype=np.int64)
        if starts.size:
            # every shard but the last is exactly ``cap`` long, so a stream offset names its shard
            per_shard = np.bincount((base + starts) // self.cap)
            for number in np.flatnonzero(per_shard):
                self.record.shards[number].documents += int(per_shard[number])
            self.record.documents += int(starts.size)

    def _current_shard(self) -> ShardRecord:
        shards = self.record.shards
        if self._file is None or shards[-1].tokens == self.cap:
            self._close_file()
            shards.append(ShardRecord(shard_name(self.split, len(shards))))
            self._file = open(self.directory / shards[-1].file, "wb")  # held open across write() calls
        return shards[-1]

    def _close_file(self) -> None:
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())  # on disk before the directory is renamed into place
            self._file.close()
            self._file = None

    def close(self) -> SplitRecord:
        self._close_file()
        return self.record


def data_fingerprint(
    content_sha256: str, val_fraction: float, splits: dict[str, SplitRecord], tokenizer_fingerprint: str
) -> str:
    """Documents + split + tokenizer: what fixes the token streams (shard size does not)."""
    parts = [FORMAT, str(VERSION), content_sha256, repr(float(val_fraction)), tokenizer_fingerprint]
    parts += [f"{name}:{splits[name].content_sha256}" for name in SPLITS]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()


def make_index(
    *,
    tokenizer: Tokenizer,
    tokenizer_file: str,
    splits: dict[str, SplitRecord],
    content_sha256: str,
    val_fraction: float,
    shard_tokens: int,
    source: dict,
) -> dict:
    """The ``index.json`` document. ``fingerprint`` goes into checkpoints and is checked at resume."""
    dtype = shard_dtype(tokenizer.vocab_size)
    return {
        "format": FORMAT,
        "version": VERSION,
        "dtype": dtype,
        "byte_order": "little",
        "vocab_size": int(tokenizer.vocab_size),
        "eos_id": int(tokenizer.eos_id),
        "tokenizer": {"file": tokenizer_file, "fingerprint": tokenizer.fingerprint},
        "source": source,
        "val_fraction": val_fraction,
        "shard_tokens": shard_tokens,
        "documents_span_shards": True,
        "content_sha256": content_sha256,
        "fingerprint": data_fingerprint(content_sha256, val_fraction, splits, tokenizer.fingerprint),
        "splits": {name: asdict(splits[name]) for name in SPLITS},
    }


def write_index(directory: Path, index: dict) -> None:
    path = Path(directory) / INDEX_FILE
    with open(path, "w", encoding="utf-8") as f:
        json.dump(index, f, indent=2)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def check_output(out: Path, overwrite: bool) -> None:
    """Refuse to clobber: a complete output needs ``overwrite``; anything else that is not empty is never replaced."""
    out = Path(out)
    if out.is_file() or (out.exists() and not out.is_dir()):
        raise ConfigError(
            f"--out: {str(out)!r} is a file; expected a new or empty folder, or a prepared one with --overwrite"
        )
    if not out.is_dir() or not any(out.iterdir()):
        return
    if not (out / INDEX_FILE).is_file():
        raise ConfigError(
            f"--out: {str(out)!r} is a non-empty folder without {INDEX_FILE}; choose a new or empty folder"
        )
    if not overwrite:
        raise ConfigError(f"--out: {str(out)!r} already holds prepared shards; pass --overwrite to replace them")


# ---- reading ------------------------------------------------------------------------------


class TokenStream:
    """A split's shards as one read-only token stream; each shard is memory-mapped on first use.

    Supports ``len``, integer and slice indexing (step 1) and ``np.asarray`` (which copies
    unless there is a single shard), enough for code written against a packed numpy array.
    """

    def __init__(self, paths: Sequence[Path], sizes: Sequence[int], dtype: str):
        self.paths = [Path(p) for p in paths]
        self.sizes = np.asarray(sizes, dtype=np.int64)
        self.dtype = DTYPES[dtype]
        self.ends = np.cumsum(self.sizes)
        self.begins = self.ends - self.sizes
        self._maps: list[np.ndarray | None] = [None] * len(self.paths)

    def __getstate__(self) -> dict:  # pickles (e.g. to loader workers) without the open maps
        return {**self.__dict__, "_maps": [None] * len(self.paths)}

    def __len__(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0

    @property
    def shape(self) -> tuple[int]:
        return (len(self),)

    def shard(self, number: int) -> np.ndarray:
        view = self._maps[number]
        if view is None:
            mm = np.memmap(self.paths[number], dtype=self.dtype, mode="r", shape=(int(self.sizes[number]),))
            view = self._maps[number] = mm.view(np.ndarray)  # plain ndarray slices: no memmap overhead per read
        return view

    def read_into(self, start: int, out: np.ndarray) -> None:
        """Copy ``stream[start : start + len(out)]`` into ``out`` (any integer dtype), across shards."""
        pos, filled, n = start, 0, len(out)
        number = int(np.searchsorted(self.ends, pos, side="right"))
        while filled < n:
            lo = pos - int(self.begins[number])
            take = min(n - filled, int(self.sizes[number]) - lo)
            out[filled : filled + take] = self.shard(number)[lo : lo + take]
            filled, pos, number = filled + take, pos + take, number + 1

    def gather(self, starts: np.ndarray, length: int) -> np.ndarray:
        """int64 [len(starts), length]: row r is ``stream[starts[r] : starts[r] + length]``."""
        starts = np.asarray(starts, dtype=np.int64)
        out = np.empty((len(starts), length), dtype=np.int64)
        numbers = np.searchsorted(self.ends, starts, side="right")
        local = starts - self.begins[numbers]
        inside = local + length <= self.sizes[numbers]
        for row, (number, lo, whole) in enumerate(zip(numbers.tolist(), local.tolist(), inside.tolist())):
            if whole:  # the common case: one slice of one shard, widened to int64 by the copy
                out[row] = self.shard(number)[lo : lo + length]
            else:
                self.read_into(starts[row], out[row])
        return out

    def __getitem__(self, key: SupportsIndex | slice) -> Any:  # tokens for a slice, one token for an index
        n = len(self)
        if isinstance(key, slice):
            start, stop, step = key.indices(n)
            if step != 1:
                raise IndexError("TokenStream slices take step 1 only")
            out = np.empty(max(0, stop - start), dtype=self.dtype)
            if len(out):
                self.read_into(start, out)
            return out
        i = int(key)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"token {key} out of range [0, {n})")
        number = int(np.searchsorted(self.ends, i, side="right"))
        return self.shard(number)[i - int(self.begins[number])]

    def locate(self, position: int, token: int, vocab_size: int) -> str:
        """One line naming the shard and the offset in it of a token id beyond the vocabulary."""
        number = int(np.searchsorted(self.ends, position, side="right"))
        offset = position - int(self.begins[number])
        return (
            f"data.path: shard {self.paths[number]} holds token id {token} at token offset {offset}, beyond the "
            f"vocabulary of {vocab_size} ids in {INDEX_FILE}; the shard is damaged or from another tokenizer, "
            "re-run python -m data.prepare"
        )

    def __array__(self, dtype: DTypeLike | None = None, copy: bool | None = None) -> np.ndarray:
        whole = self.shard(0) if len(self.paths) == 1 else self[:]
        return whole if dtype is None else whole.astype(dtype)


class PreparedDataset:
    """Sequence i is ``stream[i*T : i*T + T + 1]`` over a split's shards, exactly as ``PackedDataset``.

    Consecutive windows share one token, so every token is a target exactly once.
    """

    def __init__(self, stream: TokenStream, seq_len: int, vocab_size: int | None = None):
        if seq_len < 1:
            raise ConfigError(f"data.seq_len: must be >= 1, got {seq_len}")
        self.stream = stream
        self.seq_len = seq_len
        self.vocab_size = vocab_size  # token ids must be below it: checked per read (a max over the batch)

    @property
    def tokens(self) -> TokenStream:
        return self.stream

    def __len__(self) -> int:
        return max(0, (len(self.stream) - 1) // self.seq_len)

    def _starts(self, indices: ArrayLike) -> np.ndarray:
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        n = len(self)
        if idx.size and (idx.min() < 0 or idx.max() >= n):
            bad = idx[(idx < 0) | (idx >= n)][0]
            raise IndexError(f"sequence {bad} out of range [0, {n})")
        return idx * self.seq_len

    def __getitem__(self, i: int) -> torch.Tensor:

        return self.batch([int(i)])[0]

    def batch(self, indices: Sequence[int] | np.ndarray) -> torch.Tensor:
        """LongTensor [len(indices), seq_len + 1]."""
        import torch

        starts = self._starts(indices)
        out = self.stream.gather(starts, self.seq_len + 1)
        if self.vocab_size is not None and out.size and int(out.max()) >= self.vocab_size:
            row, col = (int(x[0]) for x in np.nonzero(out >= self.vocab_size))
            raise ConfigError(self.stream.locate(int(starts[row]) + col, int(out[row, col]), self.vocab_size))
        return torch.from_numpy(out)


# ---- opening ------------------------------------------------------------------------------


def _field(index: dict, path: str, kind: type | tuple[type, ...], where: Path) -> Any:
    value = index
    for key in path.split("."):
        if not isinstance(value, dict) or key not in value:
            raise ConfigError(
                f"data.path: {where} is not a valid shard index (no field {path!r}); re-run python -m data.prepare"
            )
        value = value[key]
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ConfigError(
            f"data.path: {where} is not a valid shard index (field {path!r} has the wrong type); re-run python -m "
            "data.prepare"
        )
    return value


def read_index(directory: str | Path) -> dict:
    """``index.json`` of a prepared directory, with its format checked (one-line ConfigErrors)."""
    directory = Path(directory).expanduser()
    path = directory / INDEX_FILE
    if not path.is_file():
        raise ConfigError(
            f"data.path: {str(directory)!r} has no {INDEX_FILE}; expected a folder written by python -m data.prepare"
        )
    try:
        index = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(
            f"data.path: {path} is not valid JSON ({exc.__class__.__name__}); re-run python -m data.prepare"
        ) from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise ConfigError(f"data.path: {path} is not a {FORMAT} index; re-run python -m data.prepare")
    if index.get("version") != VERSION:
        raise ConfigError(
            f"data.path: {path} has format version {index.get('version')!r}, this code reads {VERSION}; re-run python "
            "-m data.prepare"
        )
    if _field(index, "dtype", str, path) not in DTYPES:
        raise ConfigError(f"data.path: {path} has dtype {index['dtype']!r}; expected one of {', '.join(DTYPES)}")
    for name in ("vocab_size", "eos_id"):
        _field(index, name, int, path)
    for name in ("tokenizer.file", "tokenizer.fingerprint", "fingerprint"):
        _field(index, name, str, path)
    for split in SPLITS:
        for shard in _field(index, f"splits.{split}.shards", list, path):
            if (
                not isinstance(shard, dict)
                or not isinstance(shard.get("file"), str)
                or not isinstance(shard.get("tokens"), int)
            ):
                raise ConfigError(
                    f"data.path: {path} is not a valid shard index (a {split} shard lacks file / tokens); re-run "
                    "python -m data.prepare"
                )
    return index


def open_split(directory: str | Path, index: dict, split: str, seq_len: int) -> PreparedDataset:
    """Checks every shard's presence and size against the index, then opens the split (lazily)."""
    directory = Path(directory).expanduser()
    itemsize = DTYPES[index["dtype"]].itemsize
    paths, sizes = [], []
    for shard in index["splits"][split]["shards"]:
        path = directory / shard["file"]
        if not path.is_file():
            raise ConfigError(
                f"data.path: shard {path} listed in {INDEX_FILE} is missing; re-run python -m data.prepare"
            )
        expected = shard["tokens"] * itemsize
        actual = path.stat().st_size
        if actual != expected:
            raise ConfigError(
                f"data.path: shard {path} holds {actual} bytes but {INDEX_FILE} says {shard['tokens']} "
                f"{index['dtype']} tokens "
                f"({expected} bytes); the folder is damaged, re-run python -m data.prepare"
            )
        if shard["tokens"]:  # an empty file cannot be memory-mapped; it adds nothing to the stream
            paths.append(path)
            sizes.append(shard["tokens"])
    return PreparedDataset(TokenStream(paths, sizes, index["dtype"]), seq_len, vocab_size=index.get("vocab_size"))


def open_prepared(directory: str | Path, seq_len: int) -> tuple[PreparedDataset, PreparedDataset, dict]:
    """(train, val, index) of a folder written by ``python -m data.prepare``."""
    index = read_index(directory)
    tok = Path(directory).expanduser() / index["tokenizer"]["file"]
    if not tok.is_file():
        raise ConfigError(
            f"data.path: the tokenizer {tok} listed in {INDEX_FILE} is missing; re-run python -m data.prepare"
        )
    train = open_split(directory, index, "train", seq_len)
    val = open_split(directory, index, "val", seq_len)
    return train, val, index


def load_prepared_tokenizer(directory: str | Path, index: dict) -> Tokenizer:
    """The tokenizer copied into the folder, checked against the fingerprint in the index."""
    from data.tokenizer import load_tokenizer

    tok = load_tokenizer(Path(directory).expanduser() / index["tokenizer"]["file"])
    if tok.fingerprint != index["tokenizer"]["fingerprint"]:
        raise ConfigError(
            f"data.path: {tok.path} does not match the tokenizer fingerprint in {INDEX_FILE}; re-run python -m "
            "data.prepare"
        )
    return tok
