"""End to end through the real CLI: train -> checkpoint -> stop/kill/preempt -> resume -> evaluate.

Every run uses the embedded corpus with a shrunken tiny model, so the whole file
takes about a minute on 2 cores. Runs are deterministic on CPU in fp32, which is
what makes "identical losses after a restart" a test that can fail.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, run_cli

TINY = REPO / "launch" / "configs" / "tiny.toml"


def toy_args(run_dir: Path, cache_dir: Path, **values) -> list[str]:
    """``--set`` arguments: a run in ``run_dir`` of a model shrunk to seconds (64 wide, 2 layers, 64-token sequences,
    batches of 4) with its token cache in ``cache_dir``, then ``values`` (strings and paths quoted, booleans in
    lower case)."""
    values = {
        "run.dir": str(run_dir),
        "model.d_model": 64,
        "model.n_layers": 2,
        "model.n_heads": 4,
        "model.d_ff": 128,
        "model.vocab_size": 512,
        "model.max_seq_len": 64,
        "data.seq_len": 64,
        "data.cache_dir": str(cache_dir),
        "train.batch_size": 4,
        **values,
    }
    args = []
    for key, value in values.items():
        text = (
            str(value).lower()
            if isinstance(value, bool)
            else (f'"{value}"' if isinstance(value, str | Path) else str(value))
        )
        args += ["--set", f"{key}={text}"]
    return args


def overrides(run_dir: Path, cache_dir: Path, **extra) -> list[str]:
    """``toy_args`` for 40 steps of micro-batches of 2, checkpoints every 10 steps, evaluation every 20."""
    steps = {"train.micro_batch_size": 2, "train.max_steps": 40, "train.warmup_steps": 5, "train.log_every": 1}
    saves = {"checkpoint.every": 10, "checkpoint.keep": 3, "eval.every": 20, "eval.batches": 2, "eval.sample_tokens": 8}
    logs = {"log.wandb": "disabled", "log.tensorboard": False}
    return toy_args(run_dir, cache_dir, **{**steps, **saves, **logs, **extra})


def train(
    args: list[str], *, entry: list[str] | None = None, env: dict | None = None, timeout: int = 300
) -> subprocess.CompletedProcess:
    cmd = [sys.executable, *(entry or ["-m", "pretrain.train"]), "--config", str(TINY), *args]
    return subprocess.run(
        cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}
    )


def losses(run_dir: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "loss" in r}


def steps_on_disk(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir())


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, cache_dir) -> Path:
    """An uninterrupted 40-step run (the trajectory every interrupted run must reproduce)."""
    run_dir = tmp_path_factory.mktemp("ref") / "run"
    proc = train(overrides(run_dir, cache_dir))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


def test_reference_run_outputs(reference_run):
    rows = [json.loads(line) for line in (reference_run / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train_rows] == list(range(1, 41))
    assert {"step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s"} <= train_rows[0].keys()
    assert train_rows[-1]["tokens"] == 40 * 4 * 64
    assert [r["step"] for r in rows if "val_loss" in r] == [20, 40]
    assert train_rows[-1]["loss"] < train_rows[0]["loss"] - 0.5, "the model learns"
    assert steps_on_disk(reference_run) == ["step_00000020", "step_00000030", "step_00000040"]  # keep = 3
    ckpt = reference_run / "checkpoints" / "step_00000040"
    assert {"model.safetensors", "optimizer.pt", "trainer.pt", "meta.json", "tokenizer.model"} <= {
        p.name for p in ckpt.iterdir()
    }
    assert (reference_run / "config.toml").read_text().count("[train]") == 1


def test_stop_at_then_restart_is_exact(reference_run, tmp_path, cache_dir):
    run_dir = tmp_path / "run"
    first = train(overrides(run_dir, cache_dir, **{"train.stop_at": 20}))
    assert first.returncode == 0, first.stderr[-3000:]
    assert max(losses(run_dir)) == 20
    second = train(overrides(run_dir, cache_dir))
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stdout
    ref, got = losses(reference_run), losses(run_dir)
    assert sorted(got) == list(range(1, 41))
    for step in range(21, 41):
        assert got[step]["loss"] == ref[step]["loss"], f"step {step}: {got[step]['loss']} != {ref[step]['loss']}"
        assert got[step]["grad_norm"] == ref[step]["grad_norm"] and got[step]["lr"] == ref[step]["lr"]


KILL_DURING_SAVE = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    import pretrain.checkpoint as ck

    fsync = ck._fsync_tree

    def stall(path):  # every file of step 20 is written, the rename has not happened
        if "step_00000020" in path.name:
            Path(os.environ["MARKER"]).write_text(str(path))
            time.sleep(600)
        fsync(path)

    ck._fsync_tree = stall
    from pretrain.train import main
    sys.exit(main(sys.argv[1:]))
    """
)


def test_sigkill_while_writing_a_checkpoint_leaves_the_run_resumable(reference_run, tmp_path, cache_dir):
    run_dir = tmp_path / "run"
    script = tmp_path / "kill_during_save.py"
    script.write_text(KILL_DURING_SAVE)
    marker = tmp_path / "marker"
    cmd = [sys.executable, str(script), "--config", str(TINY), *overrides(run_dir, cache_dir)]
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env={**os.environ, "MARKER": str(marker), "PYTHONPATH": str(REPO)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.time() + 240
    while not marker.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    assert marker.exists(), (
        proc.stderr.read().decode()[-3000:] if proc.poll() is not None else "checkpoint 20 never started"
    )
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert any(name.startswith(".tmp-step_00000020") for name in steps_on_disk(run_dir)), (
        "the half-written checkpoint is on disk"
    )
    resumed = train(overrides(run_dir, cache_dir))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "step_00000010" in resumed.stdout.split("resumed from", 1)[1].splitlines()[0]
    ref, got = losses(reference_run), losses(run_dir)
    assert [got[s]["loss"] for s in range(11, 41)] == [ref[s]["loss"] for s in range(11, 41)]
    assert not any(name.startswith(".tmp-") for name in steps_on_disk(run_dir)), (
        "the dead writer's leftovers are cleaned"
    )


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_preemption_signal_saves_and_exits_for_requeue(tmp_path, cache_dir, sig):
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "pretrain.train",
        "--config",
        str(TINY),
        *overrides(run_dir, cache_dir, **{"train.max_steps": 5000, "checkpoint.every": 0, "eval.every": 0}),
    ]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 240
    while (
        (not metrics.exists() or len(metrics.read_text().splitlines()) < 3)
        and proc.poll() is None
        and time.time() < deadline
    ):
        time.sleep(0.2)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, err[-3000:]
    last = max(losses(run_dir))
    assert steps_on_disk(run_dir) == [f"step_{last:08d}"], "a checkpoint at the step where the signal landed"
    assert "preemption signal" in out
    assert (run_dir / "preempted").read_text().strip() == str(last), "the marker a launcher behind torchrun requeues on"


@pytest.mark.parametrize(
    "extra,needle",
    [
        ({"model.n_heads": 7}, "model.n_heads"),
        ({"train.max_stepz": 3}, "did you mean 'max_steps'"),
        ({"data.source": "local", "data.path": "/nonexistent/corpus"}, "data.path"),
        ({"train.batch_size": 6, "train.micro_batch_size": 4}, "train.batch_size"),
    ],
)
def test_bad_input_stops_before_training_with_one_line(tmp_path, cache_dir, extra, needle):
    run_dir = tmp_path / "run"
    proc = train(overrides(run_dir, cache_dir, **extra))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], proc.stderr
    assert not (run_dir / "metrics.jsonl").exists()


def test_eval_run_on_the_trained_checkpoint(reference_run, tmp_path):
    out = tmp_path / "results.json"
    proc = run_cli(
        "eval.run",
        "--run",
        str(reference_run),
        "--tasks",
        "ppl,sample,attention_stats",
        "--limit",
        "4",
        "--max-new-tokens",
        "12",
        "--out",
        str(out),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results["step"] == 40
    val = [
        json.loads(line) for line in (reference_run / "metrics.jsonl").read_text().splitlines() if "val_loss" in line
    ][-1]
    assert results["ppl"]["sequences"] == 4 and results["ppl"]["tokens"] == 4 * 64
    # the same 4 validation sequences (eval.batches 2 x micro-batch 2) the trainer scored at step 40, reloaded weights
    assert results["ppl"]["loss"] == pytest.approx(val["val_loss"], abs=1e-5)
    assert results["sample"]["tokens"] == 12 and isinstance(results["sample"]["text"], str)
    stats = results["attention_stats"]
    # softmax rows sum to one: sink ratio + density = 1 for full attention, measured on the dense path
    assert stats["attn/full/sink_ratio"] + stats["attn/full/density"] == pytest.approx(1.0, abs=1e-5)
    assert 0 < stats["attn/full/sink_ratio"] < 1
    layers = stats["layers"]
    assert len(layers) == 2 and stats["attn/full/sink_ratio"] == pytest.approx(
        sum(d["attn/full/sink_ratio"] for d in layers) / 2
    )


def test_rerunning_a_finished_run_changes_nothing(reference_run, cache_dir):
    before = (reference_run / "metrics.jsonl").read_text()
    ckpts = steps_on_disk(reference_run)
    proc = train(overrides(reference_run, cache_dir))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "nothing to do: the run is at step 40" in proc.stdout
    assert (reference_run / "metrics.jsonl").read_text() == before and steps_on_disk(reference_run) == ckpts


@pytest.mark.parametrize(
    "kind,extra,stats",
    [
        ("focal", {"model.attention.focal.mode": "learned"}, {"attn/focal/tau"}),
        ("lazy", {"model.rope.theta": 500000.0}, {"attn/lazy/sink_ratio", "attn/lazy/density", "attn/lazy/tau"}),
        (
            "focus",
            {"model.attention.focus.window": 16},
            {
                f"attn/focus/{n}"
                for n in (
                    "max_group_share",
                    "confidence",
                    "entropy",
                    "imbalance",
                    "lambda",
                    "gate_distant",
                    "stability",
                )
            },
        ),
        ("dga", {"model.attention.dga.chunk_size": 16, "model.attention.dga.group_size": 4}, {"attn/dga/key_ratio"}),
    ],
)
def test_variants_train_through_the_cli_and_log_their_statistics(tmp_path, cache_dir, kind, extra, stats):
    run_dir = tmp_path / "run"
    proc = train(
        overrides(
            run_dir,
            cache_dir,
            **{"model.attention.kind": kind, "train.max_steps": 4, "checkpoint.every": 0, "eval.every": 0, **extra},
        )
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = losses(run_dir)
    assert sorted(rows) == [1, 2, 3, 4]
    assert stats <= rows[4].keys()
    assert "[model.attention." + kind + "]" in (run_dir / "config.toml").read_text()


def test_context_extension_continues_a_checkpoint_and_reports_perplexity_by_length(reference_run, tmp_path, cache_dir):
    run_dir = tmp_path / "extend"
    extra = {
        "train.init_from": str(reference_run),
        "data.tokenizer": str(reference_run / "tokenizer.model"),
        "model.max_seq_len": 128,
        "data.seq_len": 128,
        "model.rope.theta": 500000.0,
        "train.max_steps": 3,
        "train.batch_size": 2,
        "train.micro_batch_size": 2,
        "checkpoint.every": 0,
        "eval.every": 0,
    }
    proc = train(overrides(run_dir, cache_dir, **extra))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "initialised weights from" in proc.stdout and "step_00000040" in proc.stdout
    assert losses(run_dir)[1]["loss"] < losses(reference_run)[1]["loss"] - 0.3, (
        "starts from the trained weights, not from scratch"
    )
    out = tmp_path / "len.json"
    ev = run_cli(
        "eval.run",
        "--run",
        str(run_dir),
        "--tasks",
        "ppl_length",
        "--lengths",
        "0.5,1,2",
        "--max-tokens",
        "1024",
        "--out",
        str(out),
    )
    assert ev.returncode == 0, ev.stderr[-3000:]
    result = json.loads(out.read_text())["ppl_length"]
    assert {"64", "128", "256"} <= result.keys()
    assert all(result[k]["tokens"] == (1024 // int(k)) * int(k) for k in ("64", "128", "256"))
    assert Path(result["plot"]).is_file() and Path(result["plot"]).stat().st_size > 1000


def test_init_from_with_another_tokenizer_is_refused(reference_run, tmp_path, cache_dir):
    proc = train(
        overrides(tmp_path / "x", cache_dir, **{"train.init_from": str(reference_run), "data.vocab_size": 500})
    )
    assert proc.returncode == 2 and proc.stderr.strip().startswith(
        "error: data.tokenizer: does not match the tokenizer of"
    )


def _tensors(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def test_focus_centroid_only_retrofit_then_evaluate_hard(reference_run, tmp_path, cache_dir):
    """Full-attention weights -> Focus through the CLI, training only W_g, C (lambda on a schedule): every other
    parameter stays bitwise unchanged; then evaluated in hard mode with the group statistics of the paper's table."""
    base = {
        "train.init_from": str(reference_run),
        "data.tokenizer": str(reference_run / "tokenizer.model"),
        "model.attention.kind": "focus",
        "model.attention.focus.window": 16,
        "model.attention.focus.lambda_schedule": "linear",
        "model.attention.focus.lambda_learnable": False,
        "train.trainable": "*.core.*",
        "train.max_steps": 3,
        "checkpoint.every": 0,
        "eval.every": 0,
    }
    pretrained = _tensors(reference_run / "checkpoints" / "step_00000040")
    run_dir = tmp_path / "centroids"
    proc = train(overrides(run_dir, cache_dir, **base))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step 0: training " in proc.stdout
    after = _tensors(run_dir / "checkpoints" / "step_00000003")
    core = {k for k in after if ".core." in k}
    assert core and all(k.endswith(("w_g.weight", "centroids", "lam")) for k in core)
    for name, tensor in pretrained.items():
        assert torch.equal(after[name], tensor), f"{name} was frozen but changed"
    assert [round(losses(run_dir)[s]["attn/focus/lambda"], 4) for s in (1, 2, 3)] == [2.0, 8.6667, 12.0], (
        "2 -> 12 over half the steps"
    )

    out = tmp_path / "hard.json"
    ev = run_cli(
        "eval.run",
        "--run",
        str(run_dir),
        "--tasks",
        "ppl,attention_stats,sample",
        "--max-new-tokens",
        "8",
        "--out",
        str(out),
        "--set",
        "model.attention.focus.mode=hard",
        "--set",
        "model.attention.focus.top_k=2",
    )
    assert ev.returncode == 0, ev.stderr[-3000:]
    result = json.loads(out.read_text())
    assert 0 < result["attention_stats"]["attn/focus/pairs_kept"] < 1 and result["ppl"]["loss"] > 0
    groups = result["attention_stats"]["focus_groups"]  # the paper's table 23: per layer, each group's share and tokens
    assert [g["layer"] for g in groups] == [0, 1]
    for layer in groups:
        assert sum(g["share"] for g in layer["groups"]) == pytest.approx(1.0)
        assert all(len(g["top_tokens"]) <= 10 and all(n > 0 for _, n in g["top_tokens"]) for g in layer["groups"])
    # two-phase training (train.unfreeze_at) under every engine, and a pattern that matches nothing: test_recipes.py
    # and tests/interop/test_hf_retrofit.py (issue 39: a repeat of the same code dropped here)


def test_training_lines_follow_log_every(tmp_path, cache_dir):
    run_dir = tmp_path / "run"
    proc = train(
        overrides(
            run_dir, cache_dir, **{"train.max_steps": 12, "train.log_every": 5, "checkpoint.every": 0, "eval.every": 0}
        )
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(losses(run_dir)) == [1, 5, 10, 12], "the first step, every log_every-th, and the last"


def test_prescored_hyper_swaps_in_at_evaluation(reference_run, tmp_path):
    """A full-attention checkpoint evaluated with pre-scored HyperAttention (no parameters of its
    own): exact settings reproduce full attention's loss, approximate ones move it by at most 0.01 nat."""

    def ppl(*sets: str) -> float:
        out = tmp_path / f"ev{len(list(tmp_path.iterdir()))}.json"
        args = [sys.executable, "-m", "eval.run", "--run", str(reference_run), "--tasks", "ppl", "--limit", "16"]
        args += ["--out", str(out)]
        for s in sets:
            args += ["--set", s]
        ev = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=300)
        assert ev.returncode == 0, ev.stderr[-3000:]
        return json.loads(out.read_text())["ppl"]["loss"]

    small = ["model.attention.prescored_hyper.min_seq_len=16", "model.attention.prescored_hyper.block_size=8"]
    full = ppl()
    exact = ppl(
        "model.attention.kind=prescored_hyper",
        *small,
        "model.attention.prescored_hyper.top_k=64",
        "model.attention.prescored_hyper.sample_size=64",
    )
    approx = ppl(
        "model.attention.kind=prescored_hyper",
        *small,
        "model.attention.prescored_hyper.top_k=24",
        "model.attention.prescored_hyper.sample_size=4",
        "model.attention.prescored_hyper.min_keys=8",
    )
    assert abs(exact - full) < 1e-4, (exact, full)
    # Measured on this 40-step run: approx - full = -0.0015 nat (seed 0), |gap| <= 0.0015 over seeds 0-5; 0.01 leaves
    # room for another machine's float rounding along the trajectory. (A residual weighted 1 instead of n/s moves it
    # by only ~0.001 here: catching that is a paper pin's job, not this end-to-end check's.)
    assert approx != exact and abs(approx - full) < 0.01, (approx, full)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigterm_to_the_torchrun_script_exits_75_with_the_trainers_line_and_no_traceback(tmp_path, cache_dir):
    """SIGTERM to ``launch/torchrun.sh`` (a preemption, ``kill`` of the job): the worker saves and exits 75, and so
    does the script, with the trainer's one line and no traceback from torchrun (issue 50; it used to print a 25-line
    ``SignalException`` traceback and exit 1). One process, a run long enough to be stopped in its first steps."""
    from pretrain.signals import PREEMPTED_EXIT_CODE, PREEMPTED_MARKER
    from tests.e2e.helpers import _env

    run_dir = tmp_path / "run"
    args = toy_args(
        run_dir,
        cache_dir,
        **{"train.max_steps": 100_000, "train.log_every": 1, "checkpoint.every": 0, "eval.every": 0},
        **{"log.wandb": "disabled", "log.tensorboard": False},
    )
    cmd = ["bash", str(REPO / "launch" / "torchrun.sh"), "1", "--config", str(TINY), *args]
    proc = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        metrics = run_dir / "metrics.jsonl"
        deadline = time.monotonic() + 240
        while proc.poll() is None and time.monotonic() < deadline:
            if metrics.is_file() and metrics.read_text().count("\n") >= 1:  # training: signals are deferred now
                break
            time.sleep(0.2)
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == PREEMPTED_EXIT_CODE, (proc.returncode, err[-3000:])
    assert "Traceback" not in err and "SignalException" not in err, err[-3000:]
    said = [line for line in out.splitlines() if line.startswith("preemption signal (SIGTERM): saving at step")]
    assert len(said) == 1 and said[0].endswith(f"exiting with {PREEMPTED_EXIT_CODE}"), out[-3000:]
    step = int(said[0].split("saving at step ")[1].split()[0])
    assert (run_dir / PREEMPTED_MARKER).read_text().strip() == str(step)
    assert (run_dir / "checkpoints" / f"step_{step:08d}" / "meta.json").is_file()
