"""The mutation check (issue 31, item 2): each one-line mutation of a defining formula (``table.py``), applied to a
temporary copy of the packages, must make the variant's fast tests fail.

Copy ``core/``, ``model/`` and ``tests/`` (and the pytest configuration) into a temporary directory once; one
subprocess (``tests/mutations/runner.py``, that directory first on ``PYTHONPATH``, the worktree after it for the
packages not copied) applies each selected mutation in turn (its fragment must occur exactly once), runs the test the
table names as its catcher (``-x -q -m "not slow"``; the mutation's test files after it only if it passes) and puts
the file back. Exit code 1 (a test failed) is required:
0 means the mutation survived, 2 or more a collection or usage error, which proves nothing. One torch thread: these
tests run tiny operations, where intra-op threads only contend with each other.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.mutations.runner import UNMUTATED
from tests.mutations.table import MUTATIONS, Mutation

REPO = Path(__file__).resolve().parents[2]
COPIED = ("core", "model", "tests")
TIMEOUT = 240  # seconds per mutation (the subprocess gets this times the number run)


def copy_packages(dest: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in COPIED:
        shutil.copytree(REPO / name, dest / name, ignore=ignore)
    shutil.copy2(REPO / "pyproject.toml", dest / "pyproject.toml")


def run_mutations(root: Path, names: list[str]) -> dict[str, dict]:
    """``tests.mutations.runner`` over ``names`` in one subprocess, the copy first on ``PYTHONPATH``."""
    out = root / "mutations.json"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(root), str(REPO)]),
        "OMP_NUM_THREADS": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    cmd = [sys.executable, "-m", "tests.mutations.runner", str(root), str(out), *names]
    result = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=TIMEOUT * len(names))
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def outcomes(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Every selected mutation (and the unmutated copy) in one runner process: one torch import, not forty."""
    selected = {
        item.callspec.params["mutation"].name
        for item in request.session.items
        if hasattr(item, "callspec") and isinstance(item.callspec.params.get("mutation"), Mutation)
    }
    root = tmp_path_factory.mktemp("mutations")
    copy_packages(root)
    return run_mutations(root, [UNMUTATED, *[m.name for m in MUTATIONS if m.name in selected]])


@pytest.mark.slow
@pytest.mark.parametrize("mutation", MUTATIONS, ids=[m.name for m in MUTATIONS])
def test_mutation_is_caught(mutation: Mutation, outcomes: dict[str, dict]) -> None:
    got = outcomes[mutation.name]
    assert got["code"] != 0, f"{mutation.name} survived ({mutation.breaks}):\n{got['tail']}"
    assert got["code"] == 1, f"{mutation.name}: pytest exit {got['code']}, not a test failure:\n{got['tail']}"
    print(f"{mutation.name}: caught by {got['first']}")
    # caught, but not by the test the table names: name the one that did (the check stays a test or two per mutation)
    assert got["first"] == mutation.caught_by, f"{mutation.name}: caught_by = {got['first']!r} in table.py"


@pytest.mark.slow
def test_unmutated_copy_passes(outcomes: dict[str, dict]) -> None:
    """The harness itself: the same copy, unmutated, passes every pin (else every mutation would look caught)."""
    got = outcomes[UNMUTATED]
    assert got["code"] == 0, got["tail"]


def test_table_fragments_occur_once() -> None:
    """Fast tier: every fragment of the table still occurs exactly once in the product code, so a refactor that moves
    one fails here (re-point the table) rather than in the slow check."""
    for mutation in MUTATIONS:
        src = (REPO / mutation.path).read_text()
        for original, _ in mutation.edits:
            assert src.count(original) == 1, f"{mutation.name}: {original!r} in {mutation.path}"
        assert all((REPO / f).is_file() for f in mutation.tests), mutation.name
        assert mutation.caught_by.split("::")[0] in mutation.tests, f"{mutation.name}: caught_by outside its tests"
    assert len(MUTATIONS) >= 15
