"""The README's two set-up commands, guarded as a newcomer runs them.

The demo command must work with exactly what ``pip install -e .`` installs. CI installs ``.[dev]``, so
it cannot notice a base-install code path that imports an optional extra; here the demo runs in a
subprocess where every package that only an extra brings (read off ``setup.cfg``) raises
``ModuleNotFoundError`` on import, with an empty HOME.
"""

from __future__ import annotations

import configparser
import importlib.metadata
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

README = REPO / "README.md"


def _fenced_command(after: str) -> str:
    """The one-line command in the first ```bash block following the paragraph starting with ``after``."""
    text = README.read_text()
    start = text.index(after)
    block = re.search(r"```bash\n(.*?)\n```", text[start:], re.S)
    assert block, f"README: no bash block after {after!r}"
    lines = [line for line in block.group(1).splitlines() if line.strip()]
    assert len(lines) == 1, f"README: the set-up command after {after!r} must be one line, got {lines}"
    return lines[0]


def readme_demo_command() -> str:
    return _fenced_command("Demo:")


def readme_test_command() -> str:
    return _fenced_command("Tests (what `.ci/run` runs)")


def _requirement_name(line: str) -> str:
    return re.split(r"[\s<>=!~\[;]", line.strip(), maxsplit=1)[0].lower().replace("_", "-")


def _requirements(value: str) -> set[str]:
    return {_requirement_name(x) for x in value.splitlines() if x.strip() and not x.strip().startswith("#")}


def optional_modules() -> set[str]:
    """Import names of the distributions that only an extra installs (not ``install_requires``)."""
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    base = _requirements(cfg["options"]["install_requires"])
    extras = set().union(*(_requirements(v) for v in cfg["options.extras_require"].values()))
    extras -= base | {"pytest", "pytest-timeout"}  # the test runner itself is not on the product path
    by_dist: dict[str, set[str]] = {}
    for module, dists in importlib.metadata.packages_distributions().items():
        for dist in dists:
            by_dist.setdefault(dist.lower().replace("_", "-"), set()).add(module)
    modules: set[str] = set()
    for dist in extras:
        # a distribution absent here still gets its conventional import name (flash-attn -> flash_attn)
        names = {m for m in by_dist.get(dist, set()) if m.isidentifier() and not m.startswith("_")}
        modules |= names or {dist.replace("-", "_")}
    # deps pulled in only by extras (lm-eval's, deepspeed's) are not blocked: the base path may not
    # import them either, but they are not named in setup.cfg. The named ones are what users opt into.
    return modules


# Every import finder answers "not found" for a blocked name, so the packages look exactly as absent as on
# a machine without the extra: `import x` raises ModuleNotFoundError and importlib.util.find_spec returns None.
BLOCKER = """
import sys

BLOCKED = {blocked!r}


class _Absent:
    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            return None
        return self.finder.find_spec(name, path, target)

    def __getattr__(self, attr):
        return getattr(self.finder, attr)


sys.meta_path[:] = [_Absent(f) if hasattr(f, "find_spec") else f for f in sys.meta_path]
"""


@pytest.fixture
def fresh_env(tmp_path) -> dict[str, str]:
    """A subprocess environment with the optional extras unimportable and an empty HOME."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCKER.format(blocked=sorted(optional_modules())))
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "HF_", "XDG_", "MPL"))}
    env.update(PYTHONPATH=f"{site}{os.pathsep}{REPO}", HOME=str(home), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    return env


def test_optional_modules_come_from_the_extras():
    mods = optional_modules()
    for name in ("lm_eval", "deepspeed", "transformers", "flash_attn"):
        assert name in mods, name
    assert not mods & {"torch", "numpy", "safetensors", "sentencepiece"}


def test_blocker_refuses_the_extras_and_only_them(fresh_env):
    """The guard itself: an extra cannot be imported under it, a base package can."""
    assert "lm_eval" in optional_modules()
    blocked = "lm_eval"
    bad = subprocess.run([sys.executable, "-c", f"import {blocked}"], env=fresh_env, capture_output=True, text=True)
    assert bad.returncode != 0 and f"No module named '{blocked}'" in bad.stderr
    spec = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({blocked!r}) is not None)"
    assert subprocess.run([sys.executable, "-c", spec], env=fresh_env).returncode == 0
    ok = subprocess.run([sys.executable, "-c", "import torch, numpy"], env=fresh_env, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr


def test_ci_runs_exactly_the_readme_test_command():
    command = readme_test_command()
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    assert command in [line.strip() for line in ci], f".ci/run does not run the README's test command {command!r}"


def _demo_steps(run_dir: Path) -> list[list[str]]:
    """The demo command's steps (pip install dropped), shrunk to a few training steps in ``run_dir``."""
    steps = [shlex.split(part) for part in readme_demo_command().split("&&")]
    assert steps[0][:2] == ["pip", "install"] and steps[0][-1] == ".", f"demo must install the base package: {steps[0]}"
    train, evaluate = steps[1:]
    assert train[:3] == ["python", "-m", "pretrain.train"] and evaluate[:3] == ["python", "-m", "eval.run"]
    default_dir = evaluate[evaluate.index("--run") + 1]
    train = train + ["--set", f"run.dir={run_dir}", "--set", "train.max_steps=4", "--set", "checkpoint.every=4"]
    train += ["--set", "eval.every=4", "--set", "eval.batches=2", "--set", "train.log_every=2"]
    evaluate = [str(run_dir) if arg == default_dir else arg for arg in evaluate]
    return [[sys.executable, *train[1:]], [sys.executable, *evaluate[1:]]]


@pytest.mark.slow
def test_readme_demo_runs_with_the_base_install_only(fresh_env, tmp_path):
    run_dir = tmp_path / "runs" / "tiny"
    outputs = []
    for argv in _demo_steps(run_dir):
        proc = subprocess.run(argv, cwd=REPO, env=fresh_env, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, f"{' '.join(argv[1:4])} exited {proc.returncode}:\n{proc.stderr[-3000:]}"
        outputs.append(proc.stdout)
    assert "sample:" in outputs[0]
    assert re.search(r"perplexity \d", outputs[1]), outputs[1]
    results = json.loads(next((run_dir / "eval").glob("*.json")).read_text())
    assert results["ppl"]["perplexity"] > 1 and results["sample"]["text"]
    assert (run_dir / "eval").glob("*.png"), "the loss-curve plot is part of the demo path"
