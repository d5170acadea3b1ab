"""A relaunch that changes the stored run's config (issue 30 item 3): model and data keys refused in one
line naming each key and both values; the learning rate and other hyperparameters honoured from the
resume step, said once per key, and recorded in config.toml under the config."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import tomllib

from core.errors import ConfigError
from pretrain import resume_config
from pretrain.loop import Trainer
from pretrain.optim import lr_multiplier
from tests.pretrain.test_robustness import config, train


def test_key_classes():
    assert resume_config.kind_of("model.attention.kind") == resume_config.REFUSE
    assert resume_config.kind_of("model.attention.focus.window") == resume_config.REFUSE
    assert resume_config.kind_of("data.seq_len") == resume_config.REFUSE
    assert resume_config.kind_of("data.cache_dir") == resume_config.LAUNCH
    assert resume_config.kind_of("train.lr") == resume_config.HONOUR
    assert resume_config.kind_of("train.seed") == resume_config.REFUSE
    assert resume_config.kind_of("train.deepspeed.zero_stage") == resume_config.LAUNCH
    assert resume_config.kind_of("train.parallel.cp") == resume_config.LAUNCH  # DCP reshards onto another layout
    assert resume_config.kind_of("eval.every") == resume_config.HONOUR


@pytest.fixture(scope="module")
def stopped_at_2(tmp_path_factory, cache):
    run_dir = tmp_path_factory.mktemp("stopped") / "run"
    train(config(run_dir, cache, **{"train.stop_at": 2}))
    return run_dir


def _copy(stopped_at_2, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(stopped_at_2, run_dir)
    (run_dir / ".lock").unlink(missing_ok=True)
    return run_dir


@pytest.mark.slow  # a few seconds of training
@pytest.mark.parametrize(
    "changed,named",
    [
        ({"model.attention.kind": "focal"}, "model.attention.kind 'full' -> 'focal'"),
        ({"model.d_model": 64, "data.seq_len": 16}, "data.seq_len 32 -> 16; model.d_model 32 -> 64"),
        ({"train.seed": 7}, "train.seed"),
    ],
    ids=["attention-kind", "shape-and-seq-len", "seed"],
)
def test_a_relaunch_that_changes_the_model_or_data_is_refused_in_one_line(
    stopped_at_2, tmp_path, cache, changed, named
):
    run_dir = _copy(stopped_at_2, tmp_path)
    before = (run_dir / "config.toml").read_text()
    with pytest.raises(ConfigError) as info:
        Trainer(config(run_dir, cache, **changed)).setup()
    message = str(info.value)
    assert "\n" not in message and message.startswith("resume: the relaunch changes the model or the data"), message
    assert named in message, message
    assert (run_dir / "config.toml").read_text() == before


@pytest.mark.slow  # a few seconds of training
def test_a_new_learning_rate_is_honoured_from_the_resume_step_and_recorded(stopped_at_2, tmp_path, cache, capsys):
    run_dir = _copy(stopped_at_2, tmp_path)
    _, result = train(config(run_dir, cache, **{"train.lr": 0.01}))
    assert result.exit_code == 0
    out = capsys.readouterr().out
    assert "config: train.lr: 0.003 -> 0.01 (honoured from step 2)" in out, out
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    lrs = {r["step"]: r["lr"] for r in rows if "lr" in r}
    cfg = config(run_dir, cache, **{"train.lr": 0.01}).train
    assert math.isclose(lrs[2], 0.003 * lr_multiplier(1, cfg), rel_tol=1e-9)  # before the relaunch
    for step in (3, 6):  # the lr of optimizer step `step` (0-based step - 1) under the new base lr
        assert math.isclose(lrs[step], 0.01 * lr_multiplier(step - 1, cfg), rel_tol=1e-9), (step, lrs)
    text = (run_dir / "config.toml").read_text()
    assert tomllib.loads(text)["train"]["lr"] == 0.01
    assert "# resumed at step 2: train.lr: 0.003 -> 0.01 (honoured from step 2)" in text
