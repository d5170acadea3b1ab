"""The layout planner (``launch.plan``) against what real runs hold: one optimizer step of a tiny LLaMA model (GQA)
in fp32 on CPU under five layouts, one process (the single engine) and, in one launch of 2 gloo processes, fsdp2
over dp=2, tp=2 (with and without sequence parallelism) and cp=2. Each rank writes its local state's bytes
(``PRETRAIN_STATE_SIZES``, ``pretrain.state_sizes``); the planner's parameter, gradient and optimizer bytes must
equal every rank's exactly, and its activation estimate must be within 25% of the bytes the rank's autograd graph
saved for the backward (no activation checkpointing: that is the peak of saved activations).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launch.plan import activation_bytes, meta_model, state_bytes
from pretrain.state_sizes import ENV as STATE_SIZES
from run.config import load_run_config
from run.parallel import ParallelLayout as Layout
from tests.e2e.helpers import run_sequence
from tests.e2e.test_train_cli import TINY, overrides

SHAPE = {
    "model.n_kv_heads": 2,
    "model.d_model": 64,
    "model.n_heads": 4,
    "data.seq_len": 128,
    "model.max_seq_len": 128,
    "train.max_steps": 1,
    "train.micro_batch_size": 0,  # no accumulation: the first micro-batch is the step's
    "train.batch_size": 4,
    "checkpoint.every": 0,
    "eval.every": 0,
    "eval.sample_tokens": 0,
}
LAYOUTS = {  # label -> (processes, overrides, layout)
    "single": (0, {}, Layout(1, 1, 1, 1)),
    # a frozen parameter has no gradient and no optimizer state (the embedding: the blocks save what they did)
    "single_frozen": (0, {"train.freeze": ["tok_emb.*"]}, Layout(1, 1, 1, 1)),
    "dp2": (2, {"train.engine": "fsdp2"}, Layout(1, 2, 1, 1)),
    "tp2": (2, {"train.engine": "fsdp2", "train.parallel.tp": 2}, Layout(1, 1, 1, 2)),  # sequence parallel
    "tp2_nosp": (
        2,
        {"train.engine": "fsdp2", "train.parallel.tp": 2, "train.parallel.sequence_parallel": False},
        Layout(1, 1, 1, 2),
    ),
    "cp2": (2, {"train.engine": "fsdp2", "train.parallel.cp": 2}, Layout(1, 1, 2, 1)),
}
ACTIVATION_TOL = 0.25
FIGURES: dict[str, list[str]] = {}


def _args(root: Path, cache_dir: Path, label: str) -> list[str]:
    return overrides(root / label, cache_dir, **SHAPE, **LAYOUTS[label][1])


@pytest.fixture(scope="module")
def launched(root, cache_dir) -> dict[str, str]:
    """Every layout's run: one launch per process count (2 gloo processes run dp2, the tp2s and cp2 in sequence)."""
    status: dict[str, str] = {}
    for nproc in sorted({n for n, _, _ in LAYOUTS.values()}):
        runs = {label: _args(root, cache_dir, label) for label, (n, _, _) in LAYOUTS.items() if n == nproc}
        status |= run_sequence(nproc, runs, root / f"nproc{nproc}.status.json", timeout=600, env={STATE_SIZES: "1"})
    return status


@pytest.fixture(scope="module", autouse=True)
def figures():
    yield
    if FIGURES:
        print(
            "\nplanner vs measured (bytes per rank)\n" + "\n".join(f"{k}: {', '.join(v)}" for k, v in FIGURES.items())
        )


@pytest.mark.parametrize("label", list(LAYOUTS))
def test_planner_matches_the_sharded_state(label, launched, root, cache_dir):
    assert launched[label] == "ok", launched[label]
    _, _, layout = LAYOUTS[label]
    pairs = list(zip(*[iter(_args(root, cache_dir, label))] * 2))
    cfg = load_run_config(TINY, [value for flag, value in pairs if flag == "--set"])
    model = meta_model(cfg)
    files = sorted((root / label / "state_sizes").glob("rank*.json"))
    assert len(files) == max(1, layout.world)
    micro = cfg.train.batch_size // layout.dp
    for path in files:
        measured = json.loads(path.read_text())
        at = layout.coordinates(measured["rank"])
        state = state_bytes(model, layout, at.tp, at.dp_shard_cp)
        act = activation_bytes(
            model,
            micro=micro,
            seq_len=cfg.data.seq_len,
            cp=layout.cp,
            tp=layout.tp,
            mode="none",
            dtype_bytes=4,
            sequence_parallel=cfg.train.parallel.sequence_parallel,
            fused_head=cfg.train.fused_cross_entropy and layout.tp == 1,  # a TP head takes the plain path
        )
        error = act.total / measured["activations"] - 1
        FIGURES[f"{label} rank {measured['rank']}"] = [
            f"params {state.parameters}/{measured['parameters']}",
            f"grads {state.gradients}/{measured['gradients']}",
            f"optimizer {state.optimizer}/{measured['optimizer']}",
            f"activations {act.total}/{measured['activations']} ({error:+.1%})",
        ]
        assert (state.parameters, state.gradients, state.optimizer) == (
            measured["parameters"],
            measured["gradients"],
            measured["optimizer"],
        ), FIGURES[f"{label} rank {measured['rank']}"]
        assert abs(error) <= ACTIVATION_TOL, FIGURES[f"{label} rank {measured['rank']}"]
