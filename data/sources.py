"""Documents from local files (txt, jsonl, parquet; a file, a folder or a glob) or the embedded corpus.

Text is decoded as UTF-8 with an optional BOM, and CRLF / CR line endings become LF, so
Windows-saved files and Gutenberg texts tokenise like any other. Document ids are paths
relative to the folder (or the glob's fixed prefix) the user named, so the train /
validation split, which hashes ids, does not change when the corpus moves.
"""

from __future__ import annotations

import glob
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

from core.errors import ConfigError
from data.documents import Document, normalise_text
from data.embedded import iter_embedded


class DocumentSource(Protocol):
    """What ``iter_documents`` reads of a ``DataConfig`` (a protocol: data.config imports this module, indirectly)."""

    source: str
    path: str
    text_field: str


EXTENSIONS = (".txt", ".jsonl", ".parquet")
_GLOB_CHARS = "*?["


def _is_glob(path: str) -> bool:
    return any(ch in path for ch in _GLOB_CHARS)


def _root(path: str) -> Path:
    """The folder document ids are relative to: the folder itself, a file's parent, a glob's fixed prefix."""
    p = Path(path).expanduser()
    if p.is_dir():
        return p
    if _is_glob(path):
        fixed = []
        for part in p.parts:
            if _is_glob(part):
                break
            fixed.append(part)
        return Path(*fixed) if fixed else Path(".")
    return p.parent


def resolve_paths(path: str) -> list[Path]:
    """A file, a folder (searched recursively) or a glob -> the data files it names, sorted."""
    p = Path(path).expanduser()
    allowed = "a file, folder or glob of .txt, .jsonl or .parquet"
    if p.is_file():
        if p.suffix not in EXTENSIONS:
            raise ConfigError(f"data.path: {path!r} is not a .txt, .jsonl or .parquet file")
        return [p]
    if p.is_dir():
        files = [f for f in p.rglob("*") if f.is_file() and f.suffix in EXTENSIONS]
    elif _is_glob(path):
        files = [
            Path(f) for f in glob.glob(str(p), recursive=True) if Path(f).is_file() and Path(f).suffix in EXTENSIONS
        ]
    else:
        raise ConfigError(f"data.path: {path!r} does not exist; expected {allowed}")
    if not files:
        raise ConfigError(f"data.path: {path!r} matches no data files; expected {allowed}")
    return sorted(files)


def _doc_name(path: Path, root: Path) -> str:
    return path.relative_to(root).as_posix() if path.is_relative_to(root) else path.as_posix()


def _read_txt(path: Path, name: str) -> Iterator[Document]:
    yield Document(name, normalise_text(path.read_bytes(), where=str(path)))


def _read_jsonl(path: Path, name: str, field: str) -> Iterator[Document]:
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line.decode("utf-8-sig"))
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise ConfigError(f"data.path: {path}:{lineno} is not valid JSON ({exc.__class__.__name__})") from None
            if not isinstance(record, dict) or not isinstance(record.get(field), str):
                raise ConfigError(f"data.text_field: {path}:{lineno} has no string field {field!r}")
            yield Document(f"{name}:{lineno}", normalise_text(record[field]))


def _read_parquet(path: Path, name: str, field: str) -> Iterator[Document]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as exc:
        raise ConfigError(f"data.path: {path} is not a readable parquet file ({exc.__class__.__name__})") from None
    schema = pf.schema_arrow
    if field not in schema.names:
        raise ConfigError(f"data.text_field: {path} has no column {field!r} (columns: {', '.join(schema.names)})")
    kind = schema.field(field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise ConfigError(f"data.text_field: column {field!r} of {path} holds {kind}, not strings")
    row = 0
    for batch in pf.iter_batches(columns=[field]):
        for text in batch.column(0).to_pylist():
            if text is not None:  # null rows are skipped; ids keep the row number
                yield Document(f"{name}:{row}", normalise_text(text))
            row += 1


def iter_local(path: str, text_field: str = "text") -> Iterator[Document]:
    """Documents of every data file ``path`` names, files in sorted order."""
    files = resolve_paths(path)
    root = _root(path)
    for f in files:
        name = _doc_name(f, root)
        if f.suffix == ".txt":
            yield from _read_txt(f, name)
        elif f.suffix == ".jsonl":
            yield from _read_jsonl(f, name, text_field)
        else:
            yield from _read_parquet(f, name, text_field)


def iter_documents(cfg: DocumentSource) -> Iterator[Document]:
    """Documents of ``cfg.source`` (a DataConfig) in a deterministic order."""
    if cfg.source == "embedded":
        return iter_embedded()
    if cfg.source == "local":
        return iter_local(cfg.path, cfg.text_field)
    raise ConfigError(f"data.source: {cfg.source!r} is not one of embedded, local")
