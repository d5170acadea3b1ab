"""``profile.*``: a torch.profiler trace of chosen steps under the run directory, rank 0 only unless asked, and the
keys' validation (issue 50)."""

from __future__ import annotations

import json

import pytest

from core.errors import ConfigError
from pretrain.callbacks import default_callbacks
from pretrain.profiling import PROFILE_DIR, Profiler
from tests.pretrain.test_robustness import config, train


def test_a_trace_of_the_chosen_steps_is_written_and_names_the_models_ops(tmp_path, capsys):
    cfg = config(tmp_path / "run", tmp_path / "cache", **{"train.max_steps": 5, "profile.start": 2, "profile.steps": 2})
    assert isinstance(default_callbacks(cfg, report=False)[0], Profiler)
    _, result = train(cfg)
    assert result.step == 5
    traces = sorted((tmp_path / "run" / PROFILE_DIR).glob("rank0.*.pt.trace.json"))
    assert len(traces) == 1, traces  # one trace, of the chosen steps
    events = json.loads(traces[0].read_text())["traceEvents"]
    names = {e.get("name") for e in events}
    # the model's operators (its matmuls and attention) and the profiler's step markers of steps 2 and 3 only
    assert {"aten::mm", "aten::scaled_dot_product_attention"} <= names or "aten::linear" in names, sorted(names)[:50]
    steps = {n for n in names if isinstance(n, str) and n.startswith("ProfilerStep#")}
    assert len(steps) == 2, steps
    assert "profile: steps 2-3 traced under" in capsys.readouterr().out


def test_no_profile_keys_no_profiler(tmp_path):
    cfg = config(tmp_path / "run", tmp_path / "cache", **{"train.max_steps": 2})
    assert not any(isinstance(c, Profiler) for c in default_callbacks(cfg, report=False))


def test_a_memory_snapshot_on_a_cpu_run_says_it_writes_none(tmp_path, capsys):
    cfg = config(tmp_path / "run", tmp_path / "cache", **{"train.max_steps": 2, "profile.memory_snapshot": "oom"})
    train(cfg)
    assert "profile.memory_snapshot='oom' records CUDA memory" in capsys.readouterr().out
    assert not (tmp_path / "run" / PROFILE_DIR).exists()


@pytest.mark.parametrize(
    "sets, words",
    [
        ({"profile.start": -1}, "profile.start: must be >= 0"),
        ({"profile.start": 2, "profile.steps": 0}, "profile.steps"),
        ({"profile.memory_snapshot": "always"}, "profile.memory_snapshot"),
        ({"profile.memory_snapshot": "traced"}, "set profile.start too"),
    ],
    ids=["start-negative", "steps-0", "snapshot-unknown", "traced-without-start"],
)
def test_bad_profile_keys_are_one_line(tmp_path, sets, words):
    with pytest.raises(ConfigError, match=words):
        config(tmp_path / "run", tmp_path / "cache", **sets)
