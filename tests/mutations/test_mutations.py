"""The mutation check (issue 31, item 2): each one-line mutation of a defining formula (``table.py``), applied to a
temporary copy of the packages, must make the variant's fast tests fail.

Per mutation: copy ``core/``, ``model/`` and ``tests/`` (and the pytest configuration) into a temporary directory,
apply the edit (its fragment must occur exactly once), and run the mutation's test files there in a subprocess,
``-x -q -m "not slow"``, with that directory first on ``PYTHONPATH`` (the worktree after it, for the packages not
copied). Exit code 1 (a test failed) is required: 0 means the mutation survived, 2 or more a collection or usage
error, which proves nothing. One torch thread per subprocess: these tests run tiny operations, where intra-op
threads only contend with each other.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.mutations.table import MUTATIONS, Mutation

REPO = Path(__file__).resolve().parents[2]
COPIED = ("core", "model", "tests")
TIMEOUT = 240  # seconds per mutation; the whole check takes a few minutes


def copy_packages(dest: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in COPIED:
        shutil.copytree(REPO / name, dest / name, ignore=ignore)
    shutil.copy2(REPO / "pyproject.toml", dest / "pyproject.toml")


def apply(mutation: Mutation, root: Path) -> None:
    path = root / mutation.path
    src = path.read_text()
    for original, replacement in mutation.edits:
        count = src.count(original)
        assert count == 1, (
            f"{mutation.name}: {original!r} occurs {count} times in {mutation.path} (re-point the table's fragment)"
        )
        src = src.replace(original, replacement)
    path.write_text(src)


def run_tests(root: Path, files: tuple[str, ...]) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(root), str(REPO)]),
        "OMP_NUM_THREADS": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-m", "not slow", "-p", "no:cacheprovider", *files]
    return subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=TIMEOUT)


def first_failure(output: str) -> str:
    found = re.search(r"^(?:FAILED|ERROR) (\S+)", output, re.MULTILINE)
    return found.group(1) if found else "?"


@pytest.mark.slow
@pytest.mark.parametrize("mutation", MUTATIONS, ids=[m.name for m in MUTATIONS])
def test_mutation_is_caught(mutation: Mutation, tmp_path: Path) -> None:
    copy_packages(tmp_path)
    apply(mutation, tmp_path)
    result = run_tests(tmp_path, mutation.tests)
    tail = (result.stdout + result.stderr)[-3000:]
    assert result.returncode != 0, f"{mutation.name} survived ({mutation.breaks}):\n{tail}"
    assert result.returncode == 1, f"{mutation.name}: pytest exit {result.returncode}, not a test failure:\n{tail}"
    print(f"{mutation.name}: caught by {first_failure(result.stdout)}")


@pytest.mark.slow
def test_unmutated_copy_passes(tmp_path: Path) -> None:
    """The harness itself: the same copy, unmutated, passes every pin (else every mutation would look caught)."""
    copy_packages(tmp_path)
    pins = sorted({m.tests[0] for m in MUTATIONS})
    result = run_tests(tmp_path, tuple(pins))
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]


def test_table_fragments_occur_once() -> None:
    """Fast tier: every fragment of the table still occurs exactly once in the product code, so a refactor that moves
    one fails here (re-point the table) rather than in the slow check."""
    for mutation in MUTATIONS:
        src = (REPO / mutation.path).read_text()
        for original, _ in mutation.edits:
            assert src.count(original) == 1, f"{mutation.name}: {original!r} in {mutation.path}"
        assert all((REPO / f).is_file() for f in mutation.tests), mutation.name
    assert len(MUTATIONS) >= 15
