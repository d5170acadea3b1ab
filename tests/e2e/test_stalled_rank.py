"""A rank stopped (SIGSTOP) rather than killed under torchrun (issue 30 item 6): the other rank's collective
gives up after train.collective_timeout, names the stalled rank in one line, leaves the requeue marker, and
the job ends within the timeout plus GRACE instead of the 30-minute process-group default. Issue 41: the
same when the rank stops inside a checkpoint save (saves are bounded by train.collective_timeout too, not 30
minutes)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pretrain.signals import PREEMPTED_MARKER
from tests.conftest import REPO
from tests.e2e.helpers import _env
from tests.e2e.test_train_cli import TINY

TIMEOUT = 15
SAVE_TIMEOUT = TIMEOUT  # the save test's train.collective_timeout
# from the stop to the job's end past the timeout: the gloo wait's own slack, the stalled rank named, the stopped rank
# SIGKILLed by the one that named it (torchrun's SIGTERM cannot reach a stopped process), the exits and torchrun's
# teardown; measured about 2 s (17.0-17.2 s in all with the timeout at 15 s, 2-core machine)
GRACE = 30


def _rank_pid(torchrun_pid: int, rank: int) -> int | None:
    """The worker process of ``rank`` under this torchrun (a descendant whose environment says RANK=<rank>)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and _descends_from(int(entry.name), torchrun_pid):
            return int(entry.name)
    return None


def _descends_from(pid: int, ancestor: int) -> bool:
    for _ in range(8):
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            return False
        if pid == ancestor:
            return True
    return False


@pytest.mark.slow
def test_a_stopped_rank_ends_the_job_within_the_timeout_and_names_it(tmp_path, cache_dir):
    run_dir = tmp_path / "run"
    args = {
        "run.dir": str(run_dir),
        "train.engine": "fsdp2",
        "train.device": "cpu",
        "train.max_steps": 1000,
        "train.collective_timeout": TIMEOUT,
        "model.n_layers": 1,
        "checkpoint.every": 1000,  # saves run under the long timeout: keep them out of the way
        "eval.every": 0,
        "eval.sample_tokens": 0,
        "log.tensorboard": False,
        "log.wandb": "disabled",
        "data.cache_dir": str(cache_dir),
    }
    sets = [x for k, v in args.items() for x in ("--set", f"{k}={json.dumps(v)}")]
    cmd = ["bash", str(REPO / "launch" / "torchrun.sh"), "2", "--config", str(TINY), *sets]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    stopped = None
    try:
        deadline = time.monotonic() + 300
        metrics = run_dir / "metrics.jsonl"
        while time.monotonic() < deadline and proc.poll() is None:  # wait for step 3: compiled, timeout lowered
            if metrics.is_file() and sum(1 for line in metrics.read_text().splitlines() if '"loss"' in line) >= 3:
                stopped = _rank_pid(proc.pid, 1)
                if stopped is not None:
                    break
            time.sleep(0.5)
        assert stopped is not None, "rank 1 never reached step 3"
        os.kill(stopped, signal.SIGSTOP)
        t0 = time.monotonic()
        out, err = proc.communicate(timeout=TIMEOUT + 120)
        elapsed = time.monotonic() - t0
    finally:
        if stopped is not None:
            try:
                os.kill(stopped, signal.SIGCONT)
                os.kill(stopped, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if proc.poll() is None:
            proc.kill()
    print(f"from the SIGSTOP to the job's end: {elapsed:.1f} s (train.collective_timeout={TIMEOUT})")
    assert elapsed < TIMEOUT + GRACE, (elapsed, err[-2000:])
    lines = [line for line in err.splitlines() if line.startswith("error: train.collective_timeout: rank 1")]
    assert len(lines) == 1, err[-3000:]
    assert (run_dir / PREEMPTED_MARKER).is_file()  # the sbatch script requeues on it


@pytest.mark.slow
def test_a_rank_stopped_during_a_save_ends_the_job_within_the_timeout_plus_grace(tmp_path, cache_dir):
    """Rank 1 stops itself inside the step-3 checkpoint save (tests/e2e/stall_in_save.py), before writing its DCP
    share: rank 0's save waits train.collective_timeout (not the 30 minutes a save used to get), names rank 1 in
    one line and leaves the requeue marker; the job has ended GRACE seconds after that timeout, and no step 3
    checkpoint exists (the save never completed)."""
    run_dir, stop_file = tmp_path / "run", tmp_path / "stopped"
    args = {
        "run.dir": str(run_dir),
        "train.engine": "fsdp2",
        "train.device": "cpu",
        "train.max_steps": 1000,
        "train.collective_timeout": SAVE_TIMEOUT,
        "model.n_layers": 1,
        "checkpoint.every": 3,
        "eval.every": 0,
        "eval.sample_tokens": 0,
        "log.tensorboard": False,
        "log.wandb": "disabled",
        "data.cache_dir": str(cache_dir),
    }
    sets = [x for k, v in args.items() for x in ("--set", f"{k}={json.dumps(v)}")]
    module = ["-m", "tests.e2e.stall_in_save", str(stop_file), "3", "--config", str(TINY), *sets]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *module]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    pid = None
    try:
        out, err = proc.communicate(timeout=300 + SAVE_TIMEOUT + GRACE)
        ended = time.time()
    finally:
        if stop_file.is_file():
            pid = int(stop_file.read_text().split()[1])
        if proc.poll() is None:
            proc.kill()
        if pid is not None:  # never leave a stopped process behind
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert stop_file.is_file(), err[-3000:]
    elapsed = ended - float(stop_file.read_text().split()[0])
    print(f"from the SIGSTOP in the save to the job's end: {elapsed:.1f} s (train.collective_timeout={SAVE_TIMEOUT})")
    assert elapsed < SAVE_TIMEOUT + GRACE, (elapsed, err[-2000:])
    lines = [line for line in err.splitlines() if line.startswith("error: train.collective_timeout: rank 1")]
    assert len(lines) == 1 and f"train.collective_timeout={SAVE_TIMEOUT} s" in lines[0], err[-3000:]
    assert (run_dir / PREEMPTED_MARKER).is_file()  # the sbatch script requeues on it
    assert not (run_dir / "checkpoints" / "step_00000003").exists()


class _StalledEngine:
    """What ``Trainer._stalled`` asks of a two-rank engine whose rank 1 stopped answering."""

    world_size = 2
    collective_timeout: float | None = None

    def set_collective_timeout(self, seconds: float) -> None:
        self.collective_timeout = seconds

    def stalled(self) -> str:
        return "rank 1 (last at step 3, 21 s ago)"

    def end_stalled(self) -> None:
        pass


def test_the_stall_line_names_the_bound_that_fired(tmp_path, cache_dir):
    """A collective timing out inside a checkpoint save or resume was bounded by checkpoint.collective_timeout:
    the one line names that key and its value, not train.collective_timeout's (issue 50); one timing out in a step
    names train.collective_timeout. In process, with the engine's answers staged (no process group)."""
    from pretrain.loop import Trainer
    from tests.pretrain.test_robustness import config

    cfg = config(tmp_path / "run", cache_dir, **{"train.collective_timeout": 60, "checkpoint.collective_timeout": 20})
    cfg.run_dir.mkdir(parents=True)
    failure = RuntimeError("[../gloo/transport/tcp/pair.cc:534] Timed out waiting 20000ms for recv operation")
    in_save, in_step = Trainer(cfg), Trainer(cfg)
    for trainer in (in_save, in_step):
        trainer.engine = _StalledEngine()
        trainer.step_timeout = 60.0
    with pytest.raises(RuntimeError), in_save._checkpoint_timeout():
        raise failure
    assert in_save.engine.collective_timeout == 60.0, "the step's bound is back in place"
    assert in_save._stalled(failure)
    assert in_save.error.startswith("checkpoint.collective_timeout: rank 1 (last at step 3, 21 s ago) stopped"), (
        in_save.error
    )
    assert "no answer within checkpoint.collective_timeout=20 s" in in_save.error
    in_step._bound_collectives(60.0, "train.collective_timeout")
    assert in_step._stalled(failure)
    assert "train.collective_timeout: rank 1" in in_step.error and "train.collective_timeout=60 s" in in_step.error
