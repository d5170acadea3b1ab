"""Impossible ``[train.parallel]`` layouts stop before anything starts: one line each, exit code 2 (from the
config alone, ``--dry-run`` included; the world size from ``WORLD_SIZE`` under torchrun or the launcher's
``--nodes`` x processes). The mesh and the tensor-parallel runs themselves: tests/e2e/test_tensor_parallel.py."""

from __future__ import annotations

import pytest

from core.errors import ConfigError
from launch import submit
from pretrain import train
from run.config import load_run_config
from run.parallel import ParallelLayout
from tests.conftest import REPO

TINY = REPO / "launch" / "configs" / "tiny.toml"
FSDP2 = "train.engine=fsdp2"

IMPOSSIBLE = {  # label -> (overrides, the one line's start)
    "tp_heads": (
        [FSDP2, "model.n_heads=4", "train.parallel.tp=3"],
        "train.parallel.tp: 3 does not divide model.n_heads=4",
    ),
    "tp_kv_heads": (
        [FSDP2, "model.n_heads=4", "model.n_kv_heads=2", "train.parallel.tp=4"],
        "train.parallel.tp: 4 does not divide model.n_kv_heads=2",
    ),
    "cp_seq_len": ([FSDP2, "data.seq_len=250", "train.parallel.cp=4"], "data.seq_len: 250 is not divisible by 2 x"),
    # sequence parallelism splits each CP rank's seq_len / cp tokens over the TP ranks
    "sp_seq_len": (
        [FSDP2, "data.seq_len=252", "train.parallel.cp=2", "train.parallel.tp=4"],
        "data.seq_len: 252 is not divisible by train.parallel.cp x tp = 8 (sequence parallelism splits",
    ),
    "ddp_tp": (["train.engine=ddp", "train.parallel.tp=2"], "train.parallel.tp: 2 needs an engine that hosts"),
    "deepspeed_tp": (["train.engine=deepspeed", "train.parallel.tp=2"], "train.parallel.tp: 2 needs an engine"),
    "single_cp": (["train.parallel.cp=2"], "train.parallel.cp: 2 needs an engine that hosts"),
    "tp_compile": ([FSDP2, "train.parallel.tp=2", "train.compile=true"], "train.compile: not supported with train.par"),
    "tp_zero": ([FSDP2, "train.parallel.tp=0"], "train.parallel.tp: must be >= 1"),
    "cp_compile": ([FSDP2, "train.parallel.cp=2", "train.compile=true"], "train.compile: not supported with train.par"),
    # the variant's own chunk under CP: DGA's chunk_size (128 by default) must divide each of the 2 cp chunks
    "cp_dga_chunk": (
        [FSDP2, "model.attention.kind=dga", "train.parallel.cp=2"],
        "data.seq_len: 256 is not divisible by 512 (2 x train.parallel.cp = 4 chunks of a multiple of dga's 128)",
    ),
    "cp_dga_sequence": (
        [FSDP2, "model.attention.kind=dga", "model.attention.dga.selection=sequence", "train.parallel.cp=2"],
        "model.attention.dga: no context parallelism (train.parallel.cp=2): ",
    ),
}


@pytest.mark.parametrize("label", IMPOSSIBLE)
def test_impossible_layout_is_one_line_and_exit_2_under_dry_run(label, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    sets, line = IMPOSSIBLE[label]
    args = ["--config", str(TINY), "--dry-run"] + [x for s in sets for x in ("--set", s)]
    assert train.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {line}") and "\n" not in err, err


def test_world_size_must_be_dp_x_cp_x_tp(capsys, monkeypatch):
    cfg = load_run_config(TINY, [FSDP2, "train.parallel.tp=2", "train.fsdp2.replicate=2"])
    assert ParallelLayout.of(cfg.train, 8) == ParallelLayout(dp_replicate=2, dp_shard=2, cp=1, tp=2)
    with pytest.raises(ConfigError, match=r"^train.parallel: dp x cp x tp must equal the world size 3"):
        ParallelLayout.of(cfg.train, 3)
    with pytest.raises(ConfigError, match=r"^train.fsdp2.replicate: 2 does not divide the data-parallel size 3"):
        ParallelLayout.of(cfg.train, 6)
    monkeypatch.setenv("WORLD_SIZE", "3")  # as torchrun sets it: checked before any process group
    assert train.main(["--config", str(TINY), "--dry-run", "--set", FSDP2, "--set", "train.parallel.tp=2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: train.parallel: dp x cp x tp must equal the world size 3") and "\n" not in err
    monkeypatch.delenv("WORLD_SIZE")
    launch = ["--config", str(TINY), "--set", FSDP2, "--set", "train.parallel.tp=2", "--nodes", "1", "--dry-run"]
    assert submit.main([*launch, "--gpus-per-node", "3"]) == 2
    assert capsys.readouterr().err.strip().startswith("error: train.parallel: dp x cp x tp must equal the world size 3")
    assert submit.main([*launch, "--gpus-per-node", "4"]) == 0  # dp 2 x tp 2: the batch of 16 splits over dp


def test_sequence_parallelism_off_lifts_its_seq_len_check(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    sets = [FSDP2, "data.seq_len=252", "train.parallel.cp=2", "train.parallel.tp=4"]
    cfg = load_run_config(TINY, [*sets, "train.parallel.sequence_parallel=false"])
    assert not cfg.train.parallel.sequence_parallel


def test_default_layout_is_data_parallel_only():
    cfg = load_run_config(TINY, [])
    assert (cfg.train.parallel.tp, cfg.train.parallel.cp) == (1, 1)
    assert cfg.train.parallel.sequence_parallel  # meaningful only with tp > 1
    assert ParallelLayout.of(cfg.train, 5).dp == 5
    assert "[train.parallel]" in cfg.to_toml()


@pytest.mark.parametrize(
    "sets,world,line",
    [
        # dp = 4 / (tp 2) = 2 ranks: a batch of 3 cannot split over them
        ([FSDP2, "train.parallel.tp=2", "train.batch_size=3"], 4, "train.batch_size: 3 is not divisible by the 2 data"),
        # pure data parallelism is checked the same way, before the process group
        (["train.engine=ddp", "train.batch_size=6", "train.micro_batch_size=2"], 2, "train.batch_size: 6 is not divi"),
    ],
)
def test_batch_that_does_not_split_over_dp_is_one_line_under_dry_run(sets, world, line, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    assert train.main(["--config", str(TINY), "--dry-run"] + [x for s in sets for x in ("--set", s)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {line}") and "\n" not in err, err
    monkeypatch.delenv("WORLD_SIZE")
    launch = ["--config", str(TINY), "--nodes", "1", "--gpus-per-node", str(world), "--dry-run"]
    assert submit.main([*launch] + [x for s in sets for x in ("--set", s)]) == 2
    assert capsys.readouterr().err.strip().startswith(f"error: {line}")


def test_layout_numbers_ranks_as_the_device_mesh_lays_them_out():
    """``ParallelLayout.coordinates`` (the loader's data rank, the planner's shard rank) is ``init_device_mesh``'s
    row-major ``arange(world).view(dp_replicate, dp_shard, cp, tp)``; the engines' mesh also checks it per rank."""
    import torch

    layout = ParallelLayout(dp_replicate=2, dp_shard=3, cp=2, tp=2)
    assert (layout.dp, layout.model_parallel, layout.dp_shard_cp, layout.dp_cp, layout.world) == (6, 4, 6, 12, 24)
    assert layout.label() == "2x3x2x2"
    grid = torch.arange(layout.world).view(layout.mesh_shape)
    for rank in range(layout.world):
        at = layout.coordinates(rank)
        assert int(grid[at.dp_replicate, at.dp_shard, at.cp, at.tp]) == rank
        assert rank in grid.flatten(0, 1)[at.dp]  # the flattened dp_replicate x dp_shard view
        assert rank in grid[at.dp_replicate].flatten(0, 1)[at.dp_shard_cp]  # the flattened dp_shard x cp view


def test_model_parallel_degrees_divide_the_world_with_tp_within_a_node():
    assert list(ParallelLayout.model_parallel_degrees(8, max_tp=2)) == [
        (1, 1),
        (2, 1),
        (4, 1),
        (8, 1),
        (1, 2),
        (2, 2),
        (4, 2),
    ]


def test_the_console_line_names_every_degree_and_the_world():
    """Issue 50: the one line a run prints (rank 0) says its layout, dp x cp x tp, whatever the engine."""
    assert (
        ParallelLayout(2, 3, 1, 2).describe("fsdp2")
        == "layout: dp_replicate 2 x dp_shard 3 x cp 1 x tp 2 (world 12, fsdp2)"
    )
    assert ParallelLayout().describe("single") == "layout: dp_replicate 1 x dp_shard 1 x cp 1 x tp 1 (world 1, single)"
