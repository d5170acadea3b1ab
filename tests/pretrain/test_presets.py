"""launch/configs/: one run config per preset x attention variant, written by launch.presets."""

from __future__ import annotations

import subprocess
import sys

import pytest

from launch.presets import files
from model.attention import registry
from run.config import load_run_config
from tests.conftest import REPO

CONFIGS = sorted(files())


def test_every_preset_and_variant_has_an_up_to_date_config():
    assert len(CONFIGS) == 10 * len(registry)
    stale = [p.name for p, text in files().items() if not p.is_file() or p.read_text() != text]
    assert not stale, f"run python -m launch.presets: {stale}"


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_config_validates_and_its_batch_fits_one_node_of_eight(path):
    cfg = load_run_config(str(path), [])
    preset, variant = (
        path.stem.rsplit("_", 1)
        if not path.stem.endswith("prescored_hyper")
        else (path.stem[: -len("_prescored_hyper")], "prescored_hyper")
    )
    assert cfg.model.preset == preset and cfg.model.attention.kind == variant
    assert cfg.train.batch_size * cfg.data.seq_len == 1 << 20
    assert cfg.train.batch_size % (cfg.train.micro_batch_size * 8) == 0


def test_submit_renders_a_preset_for_two_nodes():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "launch.submit",
            "--config",
            str(REPO / "launch/configs/llama-1.3b_focus.toml"),
            "--nodes",
            "2",
            "--gpus-per-node",
            "8",
            "--time",
            "24:00:00",
            "--dry-run",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    script = proc.stdout
    for line in (
        "#SBATCH --nodes=2",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --signal=USR1@120",
        "#SBATCH --requeue",
        "#SBATCH --time=24:00:00",
        "NPROC_PER_NODE=8",
    ):
        assert line in script, line
    assert "scontrol show hostnames" in script and "--rdzv_backend=c10d" in script
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "launch.submit",
            "--config",
            str(REPO / "launch/configs/llama-1.3b_focus.toml"),
            "--nodes",
            "1",
            "--gpus-per-node",
            "6",
            "--dry-run",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "train.batch_size" in bad.stderr
