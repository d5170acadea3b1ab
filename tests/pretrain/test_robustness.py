"""The trainer on a bad day: non-finite steps, signals at any point of the run, a second trainer on
the same directory, a refused resume, stale metrics. A 1-layer model on a small local corpus, in
process where possible (signals are sent to this process; the trainer catches them)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from core.config_help import describe
from core.errors import ConfigError
from pretrain.callbacks import Callback, Checkpointer, Validation, default_callbacks
from pretrain.loop import NONFINITE_EXIT_CODE, Trainer
from pretrain.signals import PREEMPTED_EXIT_CODE, PREEMPTED_MARKER, SignalHandler
from run.config import RunConfig, load_run_config
from tests.conftest import REPO

CORPUS = REPO / "tests" / "fixtures" / "resume_v1" / "corpus.txt"


def config(run_dir, cache_dir, **overrides) -> RunConfig:
    base = {
        "run.dir": str(run_dir),
        "model.preset": "tiny",
        "model.n_layers": 1,
        "model.d_model": 32,
        "model.n_heads": 2,
        "model.d_ff": 64,
        "model.vocab_size": 512,
        "model.max_seq_len": 64,
        "data.source": "local",
        "data.path": str(CORPUS),
        "data.seq_len": 32,
        "data.cache_dir": str(cache_dir),
        "train.max_steps": 6,
        "train.batch_size": 4,
        "train.lr": 3e-3,
        "train.warmup_steps": 2,
        "train.log_every": 1,
        "train.device": "cpu",
        "checkpoint.every": 2,
        "checkpoint.keep": 10,
        "eval.every": 0,
        "eval.batches": 2,
        "eval.sample_tokens": 0,
        "log.tensorboard": False,
        "log.wandb": "disabled",
    }
    base.update(overrides)
    return load_run_config(None, [f"{k}={json.dumps(v)}" for k, v in base.items()])  # JSON scalars are TOML


def train(cfg: RunConfig, extra: list[Callback] | None = None, *, before: type | None = None):
    """Like ``python -m pretrain.train``: signals caught for the whole run; ``extra`` callbacks go
    in front of the first default callback of type ``before`` (else at the end)."""
    callbacks = default_callbacks(cfg, report=False)
    at = next((i for i, c in enumerate(callbacks) if before and isinstance(c, before)), len(callbacks))
    callbacks[at:at] = extra or []
    with SignalHandler() as signals:
        trainer = Trainer(cfg, callbacks=callbacks, signals=signals)
        trainer.setup()
        return trainer, trainer.run()


def losses(run_dir) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


class SignalSelf(Callback):
    """Sends ``sig`` to this process at a hook, once."""

    def __init__(self, hook: str, sig=signal.SIGTERM, step: int = 0):
        self.hook, self.sig, self.step, self.sent = hook, sig, step, False

    def _fire(self, trainer):
        if not self.sent and trainer.step >= self.step:
            self.sent = True
            os.kill(os.getpid(), self.sig)

    def post_step(self, trainer, record):
        if self.hook == "post_step":
            self._fire(trainer)

    def post_train(self, trainer):
        if self.hook == "post_train":
            self._fire(trainer)


@pytest.mark.parametrize(
    "label,extra,before",
    [
        ("mid-run", SignalSelf("post_step", step=3), None),
        ("final-validation", SignalSelf("post_train"), Validation),
        ("final-save", SignalSelf("post_train"), Checkpointer),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_sigterm_anywhere_checkpoints_exits_75_and_the_rerun_matches(tmp_path, cache, reference, label, extra, before):
    run_dir = tmp_path / "run"
    cfg = config(run_dir, cache)
    trainer, result = train(cfg, [extra], before=before)
    assert result.exit_code == PREEMPTED_EXIT_CODE and (run_dir / PREEMPTED_MARKER).is_file()
    assert trainer.saved_step == trainer.step  # the progress is in a checkpoint
    _, again = train(config(run_dir, cache))  # the requeued job
    assert again.exit_code == 0 and not (run_dir / PREEMPTED_MARKER).exists()
    assert losses(run_dir) == reference


@pytest.mark.parametrize("damage", ["truncated-weights", "empty-trainer-state", "torn-metrics-line"])
def test_a_damaged_run_dir_still_resumes_to_the_reference(tmp_path, cache, reference, damage, capsys):
    run_dir = tmp_path / "run"
    train(config(run_dir, cache, **{"train.stop_at": 4}))  # checkpoints at steps 2 and 4
    latest = run_dir / "checkpoints" / "step_00000004"
    if damage == "truncated-weights":
        weights = latest / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif damage == "empty-trainer-state":
        (latest / "trainer.pt").write_bytes(b"")
    else:
        with open(run_dir / "metrics.jsonl", "a") as f:
            f.write('{"step": 5, "lo')  # a kill during a write
    _, result = train(config(run_dir, cache))
    assert result.exit_code == 0 and losses(run_dir) == reference
    out = capsys.readouterr()
    if damage == "torn-metrics-line":
        assert "dropped its last line" in out.out + out.err
    else:
        assert "warning: skipping a damaged checkpoint: resume: " in out.out
        assert "resumed from" in out.out and "step_00000002 at step 2" in out.out


def test_sigint_checkpoints_and_exits_130_without_a_requeue_marker(tmp_path, cache):
    run_dir = tmp_path / "run"
    trainer, result = train(config(run_dir, cache), [SignalSelf("post_step", signal.SIGINT, step=3)])
    assert result.exit_code == 130 and trainer.saved_step == 3 and not (run_dir / PREEMPTED_MARKER).exists()


@pytest.mark.parametrize("policy", ["stop", "skip"])
def test_a_diverging_run_stops_and_no_checkpoint_holds_a_non_finite_value(tmp_path, cache, policy):
    run_dir = tmp_path / "run"
    trainer, result = train(config(run_dir, cache, **{"train.lr": 1e6, "train.nonfinite": policy}))
    assert result.exit_code == NONFINITE_EXIT_CODE and result.error.startswith("train.nonfinite: non-finite")
    assert "\n" not in result.error
    assert trainer.step < 6
    for weights in run_dir.glob("checkpoints/step_*/model.safetensors"):
        assert all(torch.isfinite(t).all() for t in load_file(weights).values()), weights


def test_a_second_live_trainer_on_the_same_run_dir_is_refused(tmp_path, cache):
    first = Trainer(config(tmp_path / "run", cache))
    first.setup()
    with pytest.raises(ConfigError, match=r"^run.dir: another trainer \(pid \d+ on .*\) is running in"):
        Trainer(config(tmp_path / "run", cache)).setup()


def test_a_refused_resume_rewrites_nothing(tmp_path, cache):
    run_dir = tmp_path / "run"
    train(config(run_dir, cache, **{"train.stop_at": 2}))
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file() and p.name != ".lock"}
    with pytest.raises(
        ConfigError, match=r"^resume: the relaunch changes the model or the data .*model.d_model 32 -> 64"
    ):
        Trainer(config(run_dir, cache, **{"model.d_model": 64})).setup()
    after = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file() and p.name != ".lock"}
    assert after == before


def test_a_restart_before_the_first_checkpoint_drops_the_stale_metrics(tmp_path, cache, reference):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 9.0}\n{"step": 2, "loss": 9.0}\n')  # a crashed run's
    train(config(run_dir, cache))
    assert losses(run_dir) == reference


def test_failing_setup_leaves_no_run_dir(tmp_path, cache):
    with pytest.raises(ConfigError):
        Trainer(config(tmp_path / "run", cache, **{"data.path": str(tmp_path / "missing.txt")})).setup()
    assert not (tmp_path / "run").exists()


def test_run_dir_must_be_named(tmp_path, cache):
    with pytest.raises(ConfigError, match=r"^run.dir: must name a directory"):
        config("", cache)


def test_every_config_key_has_a_type_a_default_and_a_meaning():
    rows = describe(RunConfig())
    assert len(rows) > 100
    assert [key for key, _, _, meaning in rows if not meaning] == []


def test_pretrain_train_needs_a_config_and_lists_every_key():
    bare = subprocess.run([sys.executable, "-m", "pretrain.train"], cwd=REPO, capture_output=True, text=True)
    assert bare.returncode == 2 and "--config" in bare.stderr
    listing = subprocess.run(
        [sys.executable, "-m", "pretrain.train", "--help-config"], cwd=REPO, capture_output=True, text=True
    )
    assert listing.returncode == 0 and "train.nonfinite (str, default 'stop'): " in listing.stdout


@pytest.mark.slow
def test_sigterm_one_second_after_launch_exits_75_and_the_rerun_finishes(tmp_path, cache, reference):
    run_dir = tmp_path / "run"
    cfg = config(run_dir, cache)
    (tmp_path / "run.toml").write_text(cfg.to_toml())
    cmd = [sys.executable, "-m", "pretrain.train", "--config", str(tmp_path / "run.toml")]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == PREEMPTED_EXIT_CODE, err[-2000:]
    assert "Traceback" not in err
    assert (run_dir / PREEMPTED_MARKER).is_file()
    rerun = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert losses(run_dir) == reference
    shutil.rmtree(run_dir)
