"""Documents from local files (txt, jsonl, parquet; files, folders or globs) or the embedded corpus.

Text is decoded as UTF-8 with an optional BOM, and CRLF / CR line endings become LF, so
Windows-saved files and Gutenberg texts tokenise like any other.
"""

from __future__ import annotations

import glob
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from model.errors import ConfigError

EXTENSIONS = (".txt", ".jsonl", ".parquet")


@dataclass(frozen=True)
class Document:
    id: str
    text: str


def normalise_text(raw: bytes | str) -> str:
    text = raw.decode("utf-8-sig") if isinstance(raw, bytes) else raw.removeprefix("\ufeff")
    return text.replace("\r\n", "\n").replace("\r", "\n")


def resolve_paths(path: str) -> list[Path]:
    """A file, a folder (searched recursively) or a glob -> the data files it names, sorted."""
    p = Path(path).expanduser()
    if p.is_file():
        if p.suffix not in EXTENSIONS:
            raise ConfigError(f"data.path: {path!r} is not a .txt, .jsonl or .parquet file")
        return [p]
    if p.is_dir():
        files = [f for f in p.rglob("*") if f.is_file() and f.suffix in EXTENSIONS]
    else:
        files = [Path(f) for f in glob.glob(str(p), recursive=True) if Path(f).is_file() and Path(f).suffix in EXTENSIONS]
    if not files:
        what = "does not exist" if not any(ch in path for ch in "*?[") and not p.exists() else "matches no data files"
        raise ConfigError(f"data.path: {path!r} {what}; expected a file, folder or glob of .txt, .jsonl or .parquet")
    return sorted(files)


def _read_txt(path: Path, root: Path) -> Iterator[Document]:
    yield Document(str(path.relative_to(root)) if path.is_relative_to(root) else str(path), normalise_text(path.read_bytes()))


def _read_jsonl(path: Path, root: Path, field: str) -> Iterator[Document]:
    name = str(path.relative_to(root)) if path.is_relative_to(root) else str(path)
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


def _read_parquet(path: Path, root: Path, field: str) -> Iterator[Document]:
    import pyarrow.parquet as pq

    name = str(path.relative_to(root)) if path.is_relative_to(root) else str(path)
    pf = pq.ParquetFile(path)
    if field not in pf.schema_arrow.names:
        raise ConfigError(f"data.text_field: {path} has no column {field!r} (columns: {', '.join(pf.schema_arrow.names)})")
    row = 0
    for batch in pf.iter_batches(columns=[field]):
        for text in batch.column(0).to_pylist():
            if text is not None:
                yield Document(f"{name}:{row}", normalise_text(text))
            row += 1


def iter_local(path: str, text_field: str = "text") -> Iterator[Document]:
    files = resolve_paths(path)
    p = Path(path).expanduser()
    root = p if p.is_dir() else p.parent
    for f in files:
        if f.suffix == ".txt":
            yield from _read_txt(f, root)
        elif f.suffix == ".jsonl":
            yield from _read_jsonl(f, root, text_field)
        else:
            yield from _read_parquet(f, root, text_field)


def iter_documents(cfg) -> Iterator[Document]:
    """Documents of ``cfg.source`` (a DataConfig) in a deterministic order."""
    if cfg.source == "embedded":
        from data.embedded import iter_embedded

        return iter_embedded()
    if cfg.source == "local":
        return iter_local(cfg.path, cfg.text_field)
    raise ConfigError(f"data.source: {cfg.source!r} is not one of embedded, local")
