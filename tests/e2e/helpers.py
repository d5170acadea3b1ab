"""What the multi-process end-to-end tests share: the torchrun launcher, a failed launch's diagnosis, the losses of a
run directory, and ``run_sequence`` (several training runs in one process per rank, ``tests/e2e/run_sequence.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from tests.conftest import REPO
from tests.e2e.test_train_cli import TINY

try:
    import deepspeed  # noqa: F401

    HAVE_DEEPSPEED = True
except ImportError:
    HAVE_DEEPSPEED = False


def _env() -> dict[str, str]:
    # the launch script runs `python`: make it this interpreter
    # faulthandler: a rank that dies on a signal prints every thread's Python stack
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONFAULTHANDLER": "1",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }


def torchrun(nproc: int, args: list[str], *, timeout: int = 300) -> subprocess.CompletedProcess:
    """``launch/torchrun.sh NPROC --config tiny.toml ARGS`` (pretrain.train on every rank)."""
    cmd = ["bash", str(REPO / "launch" / "torchrun.sh"), str(nproc), "--config", str(TINY), *args]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=_env())


def run_sequence(
    nproc: int, runs: dict[str, list[str]], status: Path, *, timeout: int = 900, env: dict[str, str] | None = None
) -> dict[str, str]:
    """Training runs (name -> ``--set`` arguments on tiny.toml, or ``["--config", FILE, "--set", ...]``), one after
    another in one process per rank: under torchrun (``--standalone``, the launch script's form) with ``nproc`` > 0,
    in a fresh interpreter with 0. Returns {name: "ok" | the error}, and "launch: ..." with the launch's diagnosis
    for each run that never reported. ``env``: extra environment variables of every rank."""
    spec = status.with_suffix(".spec.json")
    spec.write_text(json.dumps({"runs": runs, "status": str(status)}))
    module = ["-m", "tests.e2e.run_sequence", str(spec)]
    if nproc:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *module]
    else:
        cmd = [sys.executable, *module]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env={**_env(), **(env or {})})
    console(status).write_text(proc.stdout + proc.stderr)  # what the launch printed, every rank
    done = json.loads(status.read_text()) if status.is_file() else {}
    return {name: done.get(name) or f"launch: exit {proc.returncode}\n{why(proc)}" for name in runs}


def console(status: Path) -> Path:
    """Where ``run_sequence`` keeps the stdout and stderr of the launch that wrote ``status``."""
    return status.with_suffix(".console.txt")


def shared_launch(
    memo: dict, key: object, nproc: int, runs: Callable[[], dict[str, list[str]]], status: Path, *, timeout: int = 3600
) -> dict[str, str]:
    """``run_sequence(nproc, runs(), status)`` once per ``key`` (memoised in ``memo``): the modules whose cases share
    a launch (one per process count: each run builds its own engine and mesh; a launch costs about 10 s of process
    start-up on 2 cores) name their runs ``"<label>: <run>"`` and read theirs back with ``runs_of``."""
    if key not in memo:
        memo[key] = run_sequence(nproc, runs(), status, timeout=timeout)
    return memo[key]


def runs_of(label: str, status: dict[str, str]) -> dict[str, str]:
    """{run: status} of the runs named ``"<label>: <run>"`` in a shared launch's ``status``."""
    prefix = f"{label}: "
    return {name.removeprefix(prefix): s for name, s in status.items() if name.startswith(prefix)}


def write_summary(tmp_path_factory, name: str, text: str) -> Path:
    """``text`` as the file ``name`` under $MATRIX_SUMMARY_DIR, else pytest's base temporary directory."""
    out = Path(os.environ.get("MATRIX_SUMMARY_DIR") or tmp_path_factory.getbasetemp()) / name
    out.write_text(text)
    return out


def why(proc: subprocess.CompletedProcess) -> str:
    """Each rank's traceback ([rankN] lines), any fatal-signal stacks (faulthandler) and native
    aborts, then the tail: the first failing rank, not only rank 0, must be visible in CI."""
    lines = proc.stderr.splitlines()
    ranked = [line for line in lines if line.startswith("[rank")][-60:]
    fatal = [
        i
        for i, line in enumerate(lines)
        if line.startswith(("Fatal Python error", "terminate called")) or "what():" in line
    ]
    native = [line for i in fatal for line in lines[i : i + 25]]
    return "\n".join(ranked + native) + "\n...\n" + proc.stderr[-1500:]


def all_losses(run_dir: Path) -> dict[tuple[int, str], float]:
    """(step, 'loss' | 'val_loss') -> value, for every training and validation line."""
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        for key in ("loss", "val_loss"):
            if key in row:
                out[(row["step"], key)] = row[key]
    return out


def train_rows(run_dir: Path) -> dict[int, dict]:
    """step -> the training line of that step."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "loss" in r}


def worst_relative(run: dict, ref: dict) -> float:
    """The largest |run - ref| / |ref| over ref's keys (inf when run lacks one)."""
    if not ref or any(k not in run for k in ref):
        return float("inf")
    return max(abs(run[k] - ref[k]) / max(abs(ref[k]), 1e-12) for k in ref)
