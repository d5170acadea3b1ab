"""The embedded default corpus: 42 public-domain Shakespeare plays (see SOURCES.md).

Shipped as one xz-compressed tar inside the package, so the demo works on a fresh
install with no network and nothing beside the repository.
"""

from __future__ import annotations

import tarfile
from importlib import resources
from typing import Iterator

from data.sources import Document, normalise_text

ARCHIVE = "shakespeare_plays.tar.xz"


def iter_embedded() -> Iterator[Document]:
    with resources.as_file(resources.files(__package__) / ARCHIVE) as path, tarfile.open(path, "r:xz") as tar:
        members = sorted((m for m in tar.getmembers() if m.isfile() and m.name.endswith("_gut.txt")), key=lambda m: m.name)
        for member in members:
            yield Document(member.name.rsplit("/", 1)[-1].removesuffix(".txt"), normalise_text(tar.extractfile(member).read()))
