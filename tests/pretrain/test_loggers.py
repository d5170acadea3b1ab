from __future__ import annotations

import json

from pretrain.loggers import Loggers, MetricsFile
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


def test_tensorboard_and_offline_wandb_resume_the_same_run(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = LogConfig(tensorboard=True, wandb="offline", console=False)
    first = Loggers(tmp_path, cfg, run_name="t", config={"a": 1})
    first.log({"step": 1, "loss": 2.0, "note": "text is not a scalar"})
    first.close()
    run_id = (tmp_path / "wandb_id").read_text()
    second = Loggers(tmp_path, cfg, run_name="t", config={"a": 1})
    second.close()
    assert (tmp_path / "wandb_id").read_text() == run_id
    assert any((tmp_path / "tb").iterdir())
    assert any(p.name.endswith(run_id) for p in (tmp_path / "wandb").iterdir())
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["note"] == "text is not a scalar"
