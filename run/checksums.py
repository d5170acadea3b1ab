"""Content checksums of checkpoint files: recorded in ``meta.json`` when a checkpoint is written (the
manifest is written last, so its presence is what makes a checkpoint complete) and verified before a
byte of it is used. xxh3-128 streamed in 8 MiB reads runs at memory speed (docs/architecture.md,
"Checkpoints", gives the cost per GB), so checking a large checkpoint does not dominate a restart; with several ranks
each hashes its own share of the files (``share``)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import xxhash

from core.files import open_regular

ALGORITHM = "xxh3_128"
_READ = 8 << 20


def file_digest(path: Path) -> str:
    """``xxh3_128:<hex>`` of a file's bytes, read in 8 MiB pieces into one reused buffer."""
    h = xxhash.xxh3_128()
    buf = bytearray(_READ)
    view = memoryview(buf)
    with open_regular(path) as f:  # a FIFO is refused, not waited on
        while n := f.readinto(buf):
            h.update(view[:n])
    return f"{ALGORITHM}:{h.hexdigest()}"


def share(names: Iterable[str], rank: int, world_size: int) -> list[str]:
    """This rank's part of ``names`` (sorted, every ``world_size``-th), so ranks hash disjoint files."""
    return sorted(names)[rank::world_size]


def digests(root: Path, names: Iterable[str]) -> dict[str, str]:
    return {name: file_digest(root / name) for name in names}


def first_mismatch(root: Path, recorded: dict[str, str], names: Iterable[str]) -> str | None:
    """The first of ``names`` whose content differs from its recorded digest (or is gone), as one
    phrase naming the file; None when all agree. Names with no recorded digest are not checked."""
    for name in names:
        want = recorded.get(name)
        if want is None:
            continue
        file = root / name
        if not file.is_file():
            return f"{file} is missing"
        if not want.startswith(ALGORITHM + ":"):
            return f"{file} has a checksum of an unknown kind ({want.split(':')[0]!r})"
        if file_digest(file) != want:
            return f"{file} does not match the checksum recorded when it was written"
    return None
