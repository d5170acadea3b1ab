"""TrainState: the trainer's checkpointed state, and old checkpoints still resuming.

``tests/fixtures/resume_v1`` was written by the code before TrainState (trainer.pt as a plain dict,
format 1): a 1-layer model stopped at step 3 of 6, with that code's uninterrupted 6-step metrics
beside it. The current code must resume it and reproduce those losses bit for bit. Its ``meta.json`` was
resealed with every file's checksum (``tests.conftest.reseal_checkpoint``): since issue 41 no checkpoint
without a complete manifest loads, and the subject here is trainer.pt's layout.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from core.rng import rng_state
from pretrain.state import FORMAT, TrainState
from run.checkpoint import load_trainer_state
from tests.conftest import REPO

FIXTURE = REPO / "tests" / "fixtures" / "resume_v1"


def test_round_trip_through_a_weights_only_load(tmp_path):
    state = TrainState(step=7, tokens=896, rng=[rng_state()], loader=[{"consumed": 28}], config="x = 1")
    torch.save(state.state_dict(), tmp_path / "trainer.pt")
    loaded = TrainState.from_state_dict(torch.load(tmp_path / "trainer.pt", weights_only=True))
    assert loaded.step == 7 and loaded.tokens == 896 and loaded.loader == [{"consumed": 28}]
    assert torch.equal(loaded.rng[0]["torch"], state.rng[0]["torch"])
    assert state.state_dict()["format"] == FORMAT


def test_format_1_layouts_are_upgraded():
    one = {"step": 3, "tokens": 9, "rng": {"torch": torch.zeros(2)}, "loader": {"consumed": 3}, "config": ""}
    state = TrainState.from_state_dict(one)  # the single-process layout: one rng, one loader state
    assert state.world_size == 1 and state.loader == [{"consumed": 3}] and len(state.rng) == 1
    two = {"step": 3, "tokens": 9, "rng": [{"a": 0}, {"a": 1}], "world_size": 2, "loader": [{}, {}], "config": ""}
    state = TrainState.from_state_dict(two)
    assert state.rng_for(1, 2) == {"a": 1} and state.rng_for(0, 4) == {"a": 0}  # resharded: rank 0's


def test_a_newer_format_is_refused():
    with pytest.raises(ValueError, match="format 99 is newer"):
        TrainState.from_state_dict({"format": 99, "step": 0})


def test_fixture_is_format_1():
    state = load_trainer_state(FIXTURE / "run" / "checkpoints" / "step_00000003")
    assert "format" not in state and state["step"] == 3


def _losses(path):
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


@pytest.mark.slow
def test_a_checkpoint_written_before_trainstate_resumes_exactly(tmp_path):
    for name in ("config.toml", "corpus.txt"):
        shutil.copy(FIXTURE / name, tmp_path / name)
    shutil.copytree(FIXTURE / "run", tmp_path / "run")
    env = {**os.environ, "PYTHONPATH": str(REPO), "HOME": str(tmp_path / "home")}  # no shared token cache
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pretrain.train",
            "--config",
            "config.toml",
            "--set",
            "run.dir=run",
            "--set",
            "train.stop_at=0",
            "--set",  # the head that code computed with: the fused one equals it to float32 rounding, not bit for bit
            "train.fused_cross_entropy=false",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout and "at step 3" in proc.stdout
    resumed, reference = _losses(tmp_path / "run" / "metrics.jsonl"), _losses(FIXTURE / "uninterrupted_metrics.jsonl")
    assert sorted(resumed) == [1, 2, 3, 4, 5, 6]
    assert resumed == reference  # bit for bit, steps 4-6 computed by the current code
    new = load_trainer_state(tmp_path / "run" / "checkpoints" / "step_00000006")
    assert new["format"] == FORMAT
