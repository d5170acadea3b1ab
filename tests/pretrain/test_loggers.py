from __future__ import annotations

import json

import pytest

from pretrain.loggers import Loggers, MetricsFile, wandb_mode
from run.config import LogConfig


def test_metrics_file_truncates_past_the_restored_step(tmp_path):
    m = MetricsFile(tmp_path / "metrics.jsonl")
    for step in range(1, 6):
        m.write({"step": step, "loss": float(step)})
    m.write({"step": 4, "val_loss": 1.0})
    m.truncate_after(3)
    rows = [json.loads(line) for line in m.path.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    m.write({"step": 4, "loss": float("nan")})
    assert json.loads(m.path.read_text().splitlines()[-1])["loss"] == "nan"


def test_tensorboard_and_offline_wandb_resume_the_same_run(tmp_path, monkeypatch, capfd):
    """... and W&B says one line, where its run is (issue 40: about 34 lines before)."""
    for name in ("WANDB_MODE", "WANDB_SILENT", "WANDB_QUIET"):
        monkeypatch.delenv(name, raising=False)
    cfg = LogConfig(tensorboard=True, wandb="offline", console=False)
    first = Loggers(tmp_path, cfg, run_name="t", config={"a": 1})
    first.log({"step": 1, "loss": 2.0, "note": "text is not a scalar"})
    first.log({"step": 2, "loss": 1.0})
    first.close()
    out, err = capfd.readouterr()
    said = [line for line in (out + err).splitlines() if "wandb" in line.lower()]
    assert len(said) == 1 and said[0].startswith("wandb: offline run in "), out + err
    assert said[0].endswith(f"(upload it: wandb sync {said[0].split()[4]})") and str(tmp_path) in said[0]
    run_id = (tmp_path / "wandb_id").read_text()
    second = Loggers(tmp_path, cfg, run_name="t", config={"a": 1})
    second.close()
    assert (tmp_path / "wandb_id").read_text() == run_id
    assert any((tmp_path / "tb").iterdir())
    assert any(p.name.endswith(run_id) for p in (tmp_path / "wandb").iterdir())
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])["note"] == "text is not a scalar"


def test_a_torn_last_line_is_dropped_with_a_note(tmp_path, capsys):
    m = MetricsFile(tmp_path / "metrics.jsonl")
    for step in range(1, 4):
        m.write({"step": step, "loss": float(step)})
    with open(m.path, "a") as f:
        f.write('{"step": 4, "lo')  # what a kill in the middle of a write leaves
    m.truncate_after(3)
    assert [json.loads(line)["step"] for line in m.path.read_text().splitlines()] == [1, 2, 3]
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "metrics.jsonl: dropped its last line" in err[0]
    m.write({"step": 4, "loss": 4.0})
    assert json.loads(m.path.read_text().splitlines()[-1]) == {"step": 4, "loss": 4.0}


def test_truncate_rewrites_only_when_something_is_dropped_and_clear_starts_fresh(tmp_path):
    m = MetricsFile(tmp_path / "metrics.jsonl")
    for step in range(1, 4):
        m.write({"step": step, "loss": 1.0})
    inode = m.path.stat().st_ino
    m.truncate_after(3)
    assert m.path.stat().st_ino == inode, "a finished run's relaunch rewrites nothing"
    m.clear()
    assert m.path.read_text() == ""
    m.write({"step": 1, "loss": 1.0})
    assert len(m.path.read_text().splitlines()) == 1


def test_non_finite_values_are_strings_and_the_file_is_strict_json(tmp_path):
    m = MetricsFile(tmp_path / "metrics.jsonl")
    m.write({"step": 1, "loss": float("inf"), "nested": {"a": float("-inf"), "b": [float("nan"), 1.0]}})
    row = json.loads(m.path.read_text(), parse_constant=lambda c: pytest.fail(f"bare {c} in JSON"))
    assert row == {"step": 1, "loss": "inf", "nested": {"a": "-inf", "b": ["nan", 1.0]}}


def test_writers_start_on_the_first_record_so_a_relaunch_with_nothing_to_do_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = LogConfig(tensorboard=True, wandb="offline", console=False)
    idle = Loggers(tmp_path, cfg, run_name="t", config={})
    idle.truncate_after(10)
    idle.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize("env", [{"WANDB_MODE": "disabled"}, {"WANDB_DISABLED": "true"}])
def test_the_environment_can_turn_wandb_off(tmp_path, monkeypatch, capsys, env):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    loggers = Loggers(tmp_path, LogConfig(tensorboard=False, wandb="offline", console=False), run_name="t", config={})
    loggers.log({"step": 1, "loss": 1.0})
    loggers.close()
    assert loggers.wandb is None and not (tmp_path / "wandb").exists() and not (tmp_path / "wandb_id").exists()
    assert "not log.wandb=offline" in capsys.readouterr().err
    assert wandb_mode("online") == "disabled"


def test_a_rank_other_than_0_speaks_to_its_file(tmp_path, monkeypatch, capsys):
    """One voice per job: rank 1's progress lines, Python warnings and unhandled log records go to its file; its
    errors (standard error) stay on the console; nothing is written until it has something to say."""
    import logging
    import sys
    import warnings

    from pretrain.loggers import rank_log

    monkeypatch.setattr(sys, "stdout", sys.stdout)
    monkeypatch.setattr(warnings, "showwarning", warnings.showwarning)
    monkeypatch.setattr(logging, "lastResort", logging.lastResort)
    path = rank_log(tmp_path / "run", 1)
    assert path == tmp_path / "run" / "logs" / "rank_1.log" and not (tmp_path / "run").exists()
    print("step 1 | loss 2.0", flush=True)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn("a library's warning", UserWarning, stacklevel=1)
    library = logging.getLogger("some.library")
    monkeypatch.setattr(library, "propagate", False)  # pytest's own handlers sit on the root logger
    library.warning("a log record")
    print("error: what every rank says", file=sys.stderr)
    sys.stdout.flush()
    text = path.read_text()
    assert "step 1 | loss 2.0" in text and "UserWarning: a library's warning" in text and "a log record" in text
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == "error: what every rank says\n"
