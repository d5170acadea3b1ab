"""Writing files so that a crash never leaves a half-written one: write a temporary sibling, then
rename it over the target (atomic on POSIX), and fsync directories whose entries must persist; reading a file
only once it is known to be a regular one (a FIFO put in its place would block ``open`` until killed)."""

from __future__ import annotations

import contextlib
import errno
import io
import os
import shutil
import stat
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


class NotRegularFile(OSError):
    """A path to read that is a FIFO, a device, a socket or a directory rather than a regular file."""


def file_kind(path: str | os.PathLike[str]) -> str | None:
    """What ``path`` is when it is there but not a regular file ("a FIFO", "a directory" ...; links followed);
    None for a regular file or nothing at all."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return None
    return None if stat.S_ISREG(mode) else _kind(mode)


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a directory"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):  # fmt: skip
        if test(mode):
            return name
    return "not a regular file"


def open_regular(path: str | os.PathLike[str]) -> io.BufferedReader:
    """``open(path, "rb")``, once the opened file is known to be a regular one (symbolic links followed): opened
    with ``O_NONBLOCK``, so a FIFO does not wait for a writer, and checked with ``fstat`` on what was opened (no
    window for a swap); anything else raises ``NotRegularFile`` (an ``OSError``: "is a FIFO, not a regular file")."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = _kind(mode)
            raise NotRegularFile(errno.EINVAL, f"is {kind}, not a regular file" if kind[0] == "a" else kind, str(path))
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_regular_bytes(path: str | os.PathLike[str]) -> bytes:
    """The bytes of ``path``, a regular file (``open_regular``)."""
    with open_regular(path) as f:
        return f.read()


def read_regular_text(path: str | os.PathLike[str], encoding: str = "utf-8") -> str:
    """The text of ``path``, a regular file (``open_regular``)."""
    return read_regular_bytes(path).decode(encoding)
