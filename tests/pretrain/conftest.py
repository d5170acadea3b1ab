"""Fixtures of the trainer-on-a-bad-day tests (test_robustness.py, test_checkpoint_integrity.py): a
tokenizer cache and the uninterrupted run's losses, once per module."""

from __future__ import annotations

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
