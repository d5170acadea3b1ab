"""Writing files so that a crash never leaves a half-written one: write a temporary sibling, then
rename it over the target (atomic on POSIX), and fsync directories whose entries must persist."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
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


@contextlib.contextmanager
def atomic_directory(out: Path) -> Iterator[Path]:
    """A fresh temporary sibling of ``out`` (parents made) for the block to fill; when the block succeeds it replaces
    ``out``, which must be absent or an empty directory, and on any error it is removed."""
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        if out.exists():
            out.rmdir()  # empty (rename() cannot replace a directory that is not)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def plain_mode(*paths: str | Path) -> None:
    """Give files the mode any other file of the process gets (``0o666 & ~umask``): safetensors writes its files
    0600 (a private temporary file, renamed), so checkpoints and exports would otherwise be unreadable by the
    group that reads the rest of the run."""
    mode = 0o666 & ~_umask()
    for path in paths:
        os.chmod(path, mode)


def fsync_dir(path: str | Path) -> None:
    """Persist a directory's entries (a rename into it, say)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
