"""core.files: atomic_directory (the directory appears whole or not at all), open_regular (never waits on a FIFO)."""

from __future__ import annotations

import os
import stat

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


def test_plain_mode_gives_the_mode_other_files_get(tmp_path):
    import torch
    from safetensors.torch import save_file

    from core.files import plain_mode

    weights, other = tmp_path / "model.safetensors", tmp_path / "meta.json"
    save_file({"w": torch.zeros(2)}, str(weights))
    other.write_text("{}")
    plain_mode(weights)
    assert stat.S_IMODE(weights.stat().st_mode) == stat.S_IMODE(other.stat().st_mode)


def test_the_readmes_export_folder_is_ignored_and_the_hf_package_is_not():
    """The README exports to hf/ at the repository root; model/hf/ is source (a bare ``hf/`` pattern would hide it)."""
    import shutil
    import subprocess

    from tests.conftest import REPO

    assert "/hf/" in (REPO / ".gitignore").read_text().splitlines()
    if shutil.which("git") and (REPO / ".git").exists():
        ignored = subprocess.run(["git", "check-ignore", "-q", "hf/tiny/config.json"], cwd=REPO)
        source = subprocess.run(["git", "check-ignore", "-q", "model/hf/configs.py"], cwd=REPO)
        assert (ignored.returncode, source.returncode) == (0, 1)


@pytest.mark.timeout(60)  # the hang it guards against fails the test rather than holding the suite
def test_open_regular_refuses_a_fifo_without_waiting_and_reads_a_file_or_a_link_to_one(tmp_path):
    """core.files.open_regular: a FIFO (whose open would wait for a writer), a directory, a device are one OSError
    naming what the path is, at once; a regular file, or a symbolic link to one, reads as with open (issue 50)."""
    from core.files import NotRegularFile, file_kind, open_regular, read_regular_text

    fifo, folder, regular, link = tmp_path / "fifo", tmp_path / "dir", tmp_path / "f.txt", tmp_path / "link"
    os.mkfifo(fifo)
    folder.mkdir()
    regular.write_text("text")
    link.symlink_to(regular)
    for path, kind in ((fifo, "a FIFO"), (folder, "a directory"), ("/dev/null", "a character device")):
        with pytest.raises(NotRegularFile) as info:
            open_regular(path)
        assert info.value.strerror == f"is {kind}, not a regular file" and str(path) in str(info.value)
        assert file_kind(path) == kind
    assert read_regular_text(regular) == read_regular_text(link) == "text"
    assert file_kind(regular) is None and file_kind(tmp_path / "absent") is None
    with open_regular(link) as f:
        assert f.read() == b"text" and os.get_blocking(f.fileno())  # blocking again once known to be a file
