"""launch/configs/: one run config per preset, written by launch.presets, and every attention variant
of the registry as a derived config (<preset>_<variant>.toml: no file on disk)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from launch.presets import CONFIG_DIR, SIZES, files
from model.attention import registry
from run.config import load_run_config
from tests.conftest import REPO

# (preset, variant) pairs, read off the registries at collection time: a new variant or size joins
PAIRS = [(p, v) for p in SIZES for v in sorted(registry)]


def test_every_preset_has_an_up_to_date_config():
    assert sorted(files()) == sorted(CONFIG_DIR / f"{p}.toml" for p in SIZES)
    stale = [p.name for p, text in files().items() if not p.is_file() or p.read_text() != text]
    assert not stale, f"run python -m launch.presets: {stale}"


@pytest.mark.parametrize("preset,variant", PAIRS, ids=[f"{p}_{v}" for p, v in PAIRS])
def test_derived_config_validates_and_its_batch_fits_one_node_of_eight(preset, variant):
    path = CONFIG_DIR / f"{preset}_{variant}.toml"
    assert not path.exists()  # derived, not written
    cfg = load_run_config(str(path), [])
    assert cfg.model.preset == preset and cfg.model.attention.kind == variant
    assert cfg.run.dir == f"runs/{preset}_{variant}"
    assert cfg.train.batch_size * cfg.data.seq_len == 1 << 20
    assert cfg.train.batch_size % (cfg.train.micro_batch_size * 8) == 0
    for key, value in registry[variant].cls.launch_overrides(cfg.model.family).items():
        section, name = key.removeprefix("model.").split(".")
        assert getattr(getattr(cfg.model, section), name) == value, key


def test_lazy_on_llama_derives_the_large_rope_base_and_gpt2_does_not():
    assert load_run_config(str(CONFIG_DIR / "llama-124m_lazy.toml"), []).model.rope.theta == 500000.0
    assert load_run_config(str(CONFIG_DIR / "llama-124m_focus.toml"), []).model.rope.theta != 500000.0


def submit(*args: str) -> subprocess.CompletedProcess:
    config = str(REPO / "launch/configs/llama-1.3b_focus.toml")  # a derived config: no file of its own
    cmd = [sys.executable, "-m", "launch.submit", "--config", config, *args, "--dry-run"]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)


def test_submit_renders_a_preset_for_two_nodes():
    proc = submit("--nodes", "2", "--gpus-per-node", "8", "--time", "24:00:00")
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
    bad = submit("--nodes", "1", "--gpus-per-node", "6")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "train.batch_size" in bad.stderr
