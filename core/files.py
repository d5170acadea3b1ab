"""Writing files so that a crash never leaves a half-written one: write a temporary sibling, then
rename it over the target (atomic on POSIX), and fsync directories whose entries must persist."""

from __future__ import annotations

import os
from pathlib import Path


def atomic_write_text(path: str | Path, text: str) -> Path:
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")  # per process: concurrent writers never share one
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def fsync_dir(path: str | Path) -> None:
    """Persist a directory's entries (a rename into it, say)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
