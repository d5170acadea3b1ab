"""The embedded default corpus: 42 public-domain Shakespeare plays (see SOURCES.md).

Shipped as one xz-compressed tar inside the package, so the demo works on a fresh
install with no network and nothing beside the installed package.
"""

from __future__ import annotations

import functools
import tarfile
from collections.abc import Iterator
from importlib import resources

from data.documents import Document, normalise_text

ARCHIVE = "shakespeare_plays.tar.xz"
PLAY_SUFFIX = "_gut.txt"  # metadata.txt (the catalogue) sits beside the plays and is not a document


def iter_embedded() -> Iterator[Document]:
    """The plays sorted by file name; a play's id is its file stem, e.g. ``hamlet_gut``."""
    yield from _plays()


@functools.cache
def _plays() -> tuple[Document, ...]:
    """The archive read once per process (0.16 s of xz each time; a process that builds several runs, a sweep or a
    test launch, reads it once). About 5 MB of text."""
    plays: dict[str, bytes] = {}
    # Read in archive order ("r|xz" streams): seeking back in an xz stream re-decompresses it from the start.
    with resources.as_file(resources.files(__package__) / ARCHIVE) as path, tarfile.open(path, "r|xz") as tar:
        for member in tar:
            if member.isfile() and member.name.endswith(PLAY_SUFFIX):
                data = tar.extractfile(member)
                assert data is not None  # a regular file has its bytes
                plays[member.name.rsplit("/", 1)[-1].removesuffix(".txt")] = data.read()
    return tuple(Document(name, normalise_text(plays[name], where=f"{ARCHIVE}:{name}")) for name in sorted(plays))
