"""Where step metrics go: metrics.jsonl (always), console, TensorBoard, Weights & Biases."""

from __future__ import annotations

import json
import math
import os
import secrets
import time
from pathlib import Path
from typing import Any

from run.config import LogConfig

METRICS_FILE = "metrics.jsonl"


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf literals
    return value


class MetricsFile:
    """Append-only JSON lines. On resume, lines past the restored step are dropped, so the
    file reads as one trajectory even after a crash between checkpoints."""

    def __init__(self, path: Path):
        self.path = path

    def truncate_after(self, step: int) -> None:
        if not self.path.exists():
            return
        kept = [
            line
            for line in self.path.read_text().splitlines()
            if line.strip() and json.loads(line).get("step", 0) <= step
        ]
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, self.path)

    def write(self, record: dict[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({k: _plain(v) for k, v in record.items()}) + "\n")


class Loggers:
    def __init__(self, run_dir: Path, cfg: LogConfig, *, run_name: str, config: dict[str, Any], enabled: bool = True):
        self.cfg = cfg
        self.enabled = enabled
        self.metrics = MetricsFile(run_dir / METRICS_FILE)
        self.tb = None
        self.wandb = None
        if not enabled:
            return
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=str(run_dir / "tb"))
        if cfg.wandb != "disabled":
            self.wandb = _init_wandb(run_dir, cfg, run_name, config)

    def truncate_after(self, step: int) -> None:
        """Drop metrics past ``step`` (resume); only the writing rank touches the file."""
        if self.enabled:
            self.metrics.truncate_after(step)

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self.metrics.write(record)
        step = record["step"]
        scalars = {k: _plain(v) for k, v in record.items() if k != "step" and isinstance(_plain(v), (int, float))}
        if self.tb is not None:
            for key, value in scalars.items():
                self.tb.add_scalar(key, value, step)
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)

    def console(self, line: str) -> None:
        if self.enabled and self.cfg.console:
            print(line, flush=True)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def _init_wandb(run_dir: Path, cfg: LogConfig, run_name: str, config: dict[str, Any]):
    import wandb

    # The run id lives in the run directory so a resumed run continues the same W&B run.
    id_file = run_dir / "wandb_id"
    run_id = id_file.read_text().strip() if id_file.exists() else secrets.token_hex(4)
    id_file.write_text(run_id)
    return wandb.init(
        project=cfg.wandb_project,
        entity=cfg.wandb_entity or None,
        name=run_name,
        id=run_id,
        resume="allow",
        dir=str(run_dir),
        mode=cfg.wandb,
        config=config,
    )


def format_duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


class Stopwatch:
    def __init__(self) -> None:
        self.t = time.perf_counter()

    def lap(self) -> float:
        now = time.perf_counter()
        dt, self.t = now - self.t, now
        return dt
