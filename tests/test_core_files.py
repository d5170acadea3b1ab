"""core.files.atomic_directory: the directory appears whole or not at all."""

from __future__ import annotations

import os

import pytest

from core.files import atomic_directory


@pytest.mark.parametrize("empty_out", [False, True])
def test_atomic_directory_replaces_an_absent_or_empty_target(tmp_path, empty_out):
    out = tmp_path / "nested" / "out"
    if empty_out:
        out.mkdir(parents=True)
    with atomic_directory(out) as tmp:
        assert tmp.is_dir() and tmp.parent == out.parent and not any(tmp.iterdir())
        (tmp / "a.txt").write_text("a")
        assert not (out / "a.txt").exists()  # nothing shows before the block ends
    assert (out / "a.txt").read_text() == "a"
    assert sorted(p.name for p in out.parent.iterdir()) == ["out"]  # no temporary left


def test_atomic_directory_leaves_nothing_on_error(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="boom"):
        with atomic_directory(out) as tmp:
            (tmp / "a.txt").write_text("a")
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_atomic_directory_starts_from_an_empty_temporary(tmp_path):
    out = tmp_path / "out"
    stale = tmp_path / f".out.tmp{os.getpid()}"  # left by a killed run of this process id
    stale.mkdir()
    (stale / "stale.txt").write_text("x")
    with atomic_directory(out) as tmp:
        assert not any(tmp.iterdir())
    assert list(tmp_path.iterdir()) == [out]
