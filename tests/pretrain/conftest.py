"""Fixtures of the trainer-on-a-bad-day tests (test_robustness.py, test_checkpoint_integrity.py): a
tokenizer cache and the uninterrupted run's losses, once per module; and the engine runs under torchrun that
test_safe_loading.py and test_attacks.py share, once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.pretrain.test_robustness import config, losses, train


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cache):
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    _, result = train(config(run_dir, cache))
    assert result.exit_code == 0
    return losses(run_dir)


def engine_run(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path, engine: str) -> Path:
    """test_safe_loading.py's run under torchrun (2 gloo processes), uninterrupted to step 4 with checkpoints at 2
    and 4: the attack suite's reference, and the step-2 checkpoint test_safe_loading plants into. Tests attack
    copies of it."""
    from run.checkpoint import complete_checkpoints
    from tests.e2e.helpers import torchrun, why
    from tests.pretrain.test_attacks import engine_args

    run_dir = tmp_path_factory.mktemp(engine) / "run"
    proc = torchrun(2, engine_args(run_dir, cache_dir, engine))
    assert proc.returncode == 0, why(proc)
    assert [p.name for _, p in complete_checkpoints(run_dir)] == ["step_00000002", "step_00000004"]
    return run_dir


@pytest.fixture(scope="session")
def fsdp2_run(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> Path:
    return engine_run(tmp_path_factory, cache_dir, "fsdp2")


@pytest.fixture(scope="session")
def deepspeed_run(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> Path:
    pytest.importorskip("deepspeed")
    return engine_run(tmp_path_factory, cache_dir, "deepspeed")
