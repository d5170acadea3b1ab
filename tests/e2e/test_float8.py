"""``train.float8`` through the trainer on CPU (gloo): a 2-process FSDP2 run (tensorwise: the float8 all-gather, its
scales precomputed after each optimizer step) and a ``tp=2`` run (rowwise) train and resume exactly from their own
step-3 checkpoints (a real restart on a copy of the run directory up to that checkpoint), and so does a ``cp=2`` run
(tensorwise: float8 all-gather over the CP ranks' shards); ``ddp`` trains in float8;
one process: a high-precision checkpoint resumes into float8 and a float8 one back, the change reported in one line;
and the FSDP2 float8 run's export loads in transformers with the logits of its weights in the project's own model.

Two launches (tests/e2e/run_sequence.py): one of 2 processes for the distributed runs, one of 1 for the precision
changes; 6 steps each on the toy shape (64 wide, head_dim 16: every block linear converts)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pretrain.resume_config import HISTORY_PREFIX
from tests.e2e.helpers import run_sequence, train_rows
from tests.e2e.test_train_cli import overrides

pytest.importorskip("torchao")

STEPS, AT = 6, 3
_launches: dict[int, dict[str, str]] = {}

DISTRIBUTED = {  # name -> overrides (2 processes)
    "fsdp2": {"train.engine": "fsdp2", "train.float8": "tensorwise"},
    "tp2": {"train.engine": "fsdp2", "train.parallel.tp": 2, "train.float8": "rowwise"},
    "cp2": {"train.engine": "fsdp2", "train.parallel.cp": 2, "train.float8": "tensorwise"},
    "ddp": {"train.engine": "ddp", "train.float8": "tensorwise"},
}
# name -> (overrides, the run whose step-AT checkpoint it resumes, or None): FSDP2's DCP shards across float8 and
# back (2 processes, after DISTRIBUTED's runs), and the single engine's files (1 process)
FSDP2_PRECISION = {
    "fsdp2_to_high": ({"train.engine": "fsdp2"}, "fsdp2"),
    "fsdp2_high": ({"train.engine": "fsdp2"}, None),
    "fsdp2_high_to_float8": ({"train.engine": "fsdp2", "train.float8": "tensorwise"}, "fsdp2_high"),
}
PRECISION = {
    "high": ({}, None),
    "high_to_float8": ({"train.float8": "tensorwise"}, "high"),
    "float8": ({"train.float8": "rowwise"}, None),
    "float8_to_high": ({}, "float8"),
}


def _args(run_dir: Path, cache_dir: Path, extra: dict) -> list[str]:
    saves = {"train.max_steps": STEPS, "checkpoint.every": AT, "eval.every": AT, "eval.batches": 1}
    return overrides(run_dir, cache_dir, **saves, **extra)


def _checkpoint(run_dir: Path) -> Path:
    return run_dir / "checkpoints" / f"step_{AT:08d}"


@pytest.fixture(scope="module")
def distributed(root, cache_dir) -> dict[str, Path]:
    runs: dict[str, list[str]] = {}
    for name, extra in DISTRIBUTED.items():
        runs[name] = _args(root / name, cache_dir, extra)
        if name != "ddp":
            runs[f"{name}_resumed"] = ["--copy-run", str(_checkpoint(root / name))] + _args(
                root / f"{name}_resumed", cache_dir, extra
            )
    for name, (extra, source) in FSDP2_PRECISION.items():
        copy = ["--copy-run", str(_checkpoint(root / source))] if source else []
        runs[name] = copy + _args(root / name, cache_dir, extra)
    status = run_sequence(2, runs, root / "two.status.json")
    assert all(s == "ok" for s in status.values()), status
    return {name: root / name for name in runs}


@pytest.fixture(scope="module")
def precision(root, cache_dir) -> dict[str, Path]:
    runs: dict[str, list[str]] = {}
    for name, (extra, source) in PRECISION.items():
        copy = ["--copy-run", str(_checkpoint(root / source))] if source else []
        runs[name] = copy + _args(root / name, cache_dir, extra)
    status = run_sequence(0, runs, root / "one.status.json")
    assert all(s == "ok" for s in status.values()), status
    return {name: root / name for name in runs}


@pytest.mark.parametrize("name", ["fsdp2", "tp2", "cp2"])
def test_float8_runs_resume_exactly_from_their_own_checkpoints(distributed, name):
    full, resumed = train_rows(distributed[name]), train_rows(distributed[f"{name}_resumed"])
    assert sorted(full) == sorted(resumed) == list(range(1, STEPS + 1))
    for step in range(AT + 1, STEPS + 1):
        assert resumed[step]["loss"] == full[step]["loss"], (step, resumed[step], full[step])
        assert resumed[step]["grad_norm"] == full[step]["grad_norm"], step


def test_ddp_trains_in_float8_like_fsdp2(distributed):
    """The same tensorwise recipe, weights replicated instead of sharded (FSDP2 all-gathers them in float8 with the
    same per-tensor scales): the same losses up to the reduction order."""
    ddp, fsdp2 = train_rows(distributed["ddp"]), train_rows(distributed["fsdp2"])
    assert sorted(ddp) == list(range(1, STEPS + 1))
    for step in ddp:
        assert ddp[step]["loss"] == pytest.approx(fsdp2[step]["loss"], rel=1e-4), step


def test_checkpoints_hold_plain_weights_under_the_usual_names(distributed):
    from safetensors import safe_open

    from run.checkpoint import load_model

    ckpt = distributed["fsdp2"] / "checkpoints" / f"step_{STEPS:08d}"
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        weight = f.get_tensor("blocks.0.attn.wq.weight")
    model, _ = load_model(ckpt)
    assert keys == set(model.state_dict()) and "blocks.0.attn.wq.weight" in keys
    assert weight.dtype.is_floating_point and weight.element_size() == 4  # float32, not float8


@pytest.mark.parametrize(
    "launch, name, source, line",
    [
        ("precision", "high_to_float8", "high", "train.float8: 'none' -> 'tensorwise' (this launch's setting)"),
        ("precision", "float8_to_high", "float8", "train.float8: 'rowwise' -> 'none' (this launch's setting)"),
        ("distributed", "fsdp2_to_high", "fsdp2", "train.float8: 'tensorwise' -> 'none' (this launch's setting)"),
        (
            "distributed",
            "fsdp2_high_to_float8",
            "fsdp2_high",
            "train.float8: 'none' -> 'tensorwise' (this launch's setting)",
        ),
    ],
)
def test_a_checkpoint_resumes_across_float8_and_reports_it_in_one_line(request, launch, name, source, line):
    """The weights and optimizer state are the same tensors either way (FSDP2's DCP shards hold plain tensors, not
    torchao's float8 all-gather wrapper); the first resumed step's loss is the source run's step-4 loss up to
    float8's rounding of one forward."""
    runs = request.getfixturevalue(launch)
    resumed, before = train_rows(runs[name]), train_rows(runs[source])
    assert sorted(resumed) == list(range(1, STEPS + 1))
    for step in range(1, AT + 1):  # the steps before the checkpoint are the source run's own lines
        assert resumed[step]["loss"] == before[step]["loss"]
    assert resumed[AT + 1]["loss"] == pytest.approx(before[AT + 1]["loss"], rel=0.01)
    assert resumed[AT + 1]["loss"] != before[AT + 1]["loss"]  # float8 on one side only: not the same arithmetic
    history = [h for h in (runs[name] / "config.toml").read_text().splitlines() if h.startswith(HISTORY_PREFIX)]
    # run.dir's change (a copy of the source run) is the other line
    assert [h for h in history if ": train." in h] == [f"{HISTORY_PREFIX}{AT}: {line}"], history


def test_the_export_of_a_float8_run_loads_in_transformers_with_its_weights_logits(distributed, tmp_path):
    transformers = pytest.importorskip("transformers")
    import torch

    from pretrain.export import export_hf
    from run.checkpoint import latest_checkpoint, load_model

    ckpt = latest_checkpoint(distributed["fsdp2"])
    out = export_hf(ckpt, tmp_path / "hf", log=lambda _: None)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    ours, _ = load_model(ckpt)  # the checkpoint's weights in the project's own (high-precision) model
    ids = torch.randint(0, ours.cfg.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b = theirs(ids).logits.float(), ours(ids).logits.float()
    assert float((a - b).abs().max()) <= 1e-5
