"""The import-layering contracts in pyproject.toml ([tool.importlinter]) hold, and they would catch a break.

Layers, top to bottom: launch | bench -> pretrain -> eval -> run -> data -> model -> core; no cycles between
the modules of one package. The second and third tests plant an upward import and a cycle in a copy of
the tree and require the contracts to fail there.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

pytest.importorskip("importlinter")

PACKAGES = ("core", "model", "data", "run", "eval", "pretrain", "launch", "bench")
LINT = "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports())"


def lint(root: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([sys.executable, "-c", LINT], cwd=root, env=env, capture_output=True, text=True)


@pytest.fixture
def tree_copy(tmp_path) -> Path:
    for pkg in PACKAGES:
        shutil.copytree(REPO / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__", "*.tar.xz"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def test_layer_contracts_hold():
    proc = lint(REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "0 broken" in proc.stdout


@pytest.mark.parametrize(
    "planted,contract,report",
    [
        ("from pretrain import loop", "layers import only downward", "model.config -> pretrain.loop"),
        ("from model import transformer", "no import cycles inside a package", ".config -> .transformer"),
    ],
    ids=["upward-import", "cycle-in-package"],
)
def test_a_planted_break_fails_its_contract(tree_copy, planted, contract, report):
    target = tree_copy / "model" / "config.py"
    target.write_text(target.read_text() + f"\n{planted}  # planted\n")
    proc = lint(tree_copy)
    assert proc.returncode != 0
    assert f"{contract} BROKEN" in proc.stdout
    assert report in proc.stdout
