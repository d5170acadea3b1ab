"""Where step metrics go: metrics.jsonl (always), console, TensorBoard, Weights & Biases.

Non-finite numbers are written to JSON as the strings ``"nan"``, ``"inf"`` and ``"-inf"`` (JSON has
no literal for them; ``float()`` reads them back), here and in ``eval.run``'s results.

TensorBoard's writer and the W&B run are created on the first ``log()``, so a relaunch that has
nothing to do (a finished run) writes no new event file and no new W&B run. W&B's mode is
``log.wandb`` unless the environment says otherwise: ``WANDB_MODE`` (``disabled``, ``offline``,
``online``; ``dryrun`` = offline) or ``WANDB_DISABLED=true`` win over the config. W&B says one line, where its run
is; ``WANDB_SILENT`` or ``WANDB_QUIET`` in the environment (``false`` for all of it) leave its output to W&B.

One voice per job: under torchrun, a rank other than 0 writes its console lines and Python warnings to
``<run.dir>/logs/rank_N.log`` (``rank_log``); errors still reach the console from every rank.
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
import secrets
import sys
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TextIO, cast

from run.config import LogConfig

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter
    from wandb.sdk.wandb_run import Run

METRICS_FILE = "metrics.jsonl"
# WANDB_MODE values wandb accepts -> ours (run.config.WANDB_MODES)
_WANDB_ENV_MODES = {
    "disabled": "disabled",
    "offline": "offline",
    "dryrun": "offline",
    "online": "online",
    "run": "online",
}


def _plain(value: Any) -> Any:
    """A JSON-ready value: tensors as numbers, non-finite floats as strings, containers converted inside."""
    if hasattr(value, "item"):  # a tensor or numpy scalar
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf literals
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _note(line: str) -> None:
    print(f"note: {line}", file=sys.stderr, flush=True)


class MetricsFile:
    """Append-only JSON lines. On resume, lines past the restored step are dropped, so the
    file reads as one trajectory even after a crash between checkpoints."""

    def __init__(self, path: Path):
        self.path = path

    def truncate_after(self, step: int) -> None:
        """Keep the records of steps <= ``step``. A torn line (a write cut short by a kill) or any
        other line that is not a JSON record is dropped with a one-line note; the file is rewritten
        (atomically) only when something changes."""
        if not self.path.exists():
            return
        data = self.path.read_bytes()
        lines = [(number, raw) for number, raw in enumerate(data.split(b"\n"), 1) if raw.strip()]
        kept, damaged = [], []
        for number, raw in lines:
            record = _record(raw)
            if record is None:
                damaged.append(number)
            elif _step_of(record) <= step:
                kept.append(raw.decode("utf-8"))
        if damaged:
            where = "its last line" if damaged == [lines[-1][0]] else f"line(s) {', '.join(map(str, damaged[:5]))}"
            _note(f"{self.path.name}: dropped {where}: not a complete JSON record (a write cut short)")
        if len(kept) < len(lines) or (data and not data.endswith(b"\n")):
            self._rewrite(kept)

    def clear(self) -> None:
        """Drop every record: a run that restarts from step 0 (no checkpoint) starts a fresh file."""
        if self.path.exists() and self.path.stat().st_size:
            self._rewrite([])

    def _rewrite(self, lines: list[str]) -> None:
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
        os.replace(tmp, self.path)

    def write(self, record: dict[str, Any]) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps({k: _plain(v) for k, v in record.items()}, allow_nan=False) + "\n")


def _record(raw: bytes) -> dict[str, Any] | None:
    try:
        record = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    return record if isinstance(record, dict) else None


def _step_of(record: dict[str, Any]) -> float:
    step = record.get("step", 0)
    return step if isinstance(step, (int, float)) and not isinstance(step, bool) else 0


def wandb_mode(configured: str) -> str:
    """``log.wandb``, unless ``WANDB_MODE`` / ``WANDB_DISABLED`` in the environment say otherwise."""
    if os.environ.get("WANDB_DISABLED", "").strip().lower() in ("true", "1", "yes"):
        return "disabled"
    env = os.environ.get("WANDB_MODE", "").strip().lower()
    return _WANDB_ENV_MODES.get(env, configured)


class Loggers:
    """metrics.jsonl, console, TensorBoard and W&B behind one ``log()``; only the writing rank
    (``enabled``) touches any of them. TensorBoard and W&B start on the first ``log()``."""

    def __init__(self, run_dir: Path, cfg: LogConfig, *, run_name: str, config: dict[str, Any], enabled: bool = True):
        self.cfg = cfg
        self.enabled = enabled
        self.run_dir = Path(run_dir)
        self.run_name = run_name
        self.config = config
        self.metrics = MetricsFile(self.run_dir / METRICS_FILE)
        self.tb: SummaryWriter | None = None
        self.wandb: Run | None = None
        self._started = False

    def _start(self) -> None:
        """The writers, on the first record: a relaunch with nothing to log leaves no trace."""
        self._started = True
        if self.cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=str(self.run_dir / "tb"))
        mode = wandb_mode(self.cfg.wandb)
        if mode != self.cfg.wandb:
            _note(f"W&B {mode} (the environment's WANDB_MODE / WANDB_DISABLED), not log.wandb={self.cfg.wandb}")
        if mode != "disabled":
            self.wandb = _init_wandb(self.run_dir, self.cfg, mode, self.run_name, self.config)

    def truncate_after(self, step: int) -> None:
        """Drop metrics past ``step`` (resume); only the writing rank touches the file."""
        if self.enabled:
            self.metrics.truncate_after(step)

    def start_fresh(self) -> None:
        """Drop every metrics record (a restart with no checkpoint: the stale records would be
        repeated); only the writing rank touches the file."""
        if self.enabled:
            self.metrics.clear()

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self.metrics.write(record)
        if not self._started:
            self._start()
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


def _init_wandb(run_dir: Path, cfg: LogConfig, mode: str, run_name: str, config: dict[str, Any]) -> Run:
    import wandb

    # The run id lives in the run directory so a resumed run continues the same W&B run.
    id_file = run_dir / "wandb_id"
    run_id = id_file.read_text().strip() if id_file.exists() else secrets.token_hex(4)
    id_file.write_text(run_id)
    # W&B prints about 30 lines per run; it stays silent and we say where its run is, unless the environment asks
    quiet = not ({"WANDB_SILENT", "WANDB_QUIET"} & os.environ.keys())
    run = wandb.init(
        project=cfg.wandb_project,
        entity=cfg.wandb_entity or None,
        name=run_name,
        id=run_id,
        resume="allow",
        dir=str(run_dir),
        mode=cast("Literal['online', 'offline', 'disabled']", mode),  # log.wandb is checked to be one of these
        config=config,
        settings=wandb.Settings(silent=True) if quiet else None,
    )
    if quiet:
        print(wandb_line(run), flush=True)
    return run


def wandb_line(run: Run) -> str:
    """The one line W&B's run gets on the console: where it is."""
    if run.offline:
        where = run.settings.sync_dir
        return f"wandb: offline run in {where} (upload it: wandb sync {where})"
    return f"wandb: run at {run.url}"


class _RankFile(io.TextIOBase):
    """A text stream appending to ``path``, opened on the first write (a rank with nothing to say leaves no file)."""

    def __init__(self, path: Path):
        self.path = path
        self._file: TextIO | None = None

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        if self._file is None:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._file = open(self.path, "a", encoding="utf-8")
            except OSError:  # an unwritable run.dir: the run itself says so; these lines are dropped
                self._file = open(os.devnull, "w")
        return self._file.write(text)

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()


def rank_log(run_dir: Path, rank: int) -> Path:
    """Rank ``rank`` (not 0) of a distributed job speaks to ``<run_dir>/logs/rank_<rank>.log`` instead of the
    console: its standard output (progress, notes), Python warnings and log records without a handler of their own.
    Standard error stays the console's, for every rank's one-line error."""
    path = Path(run_dir) / "logs" / f"rank_{rank}.log"
    stream = _RankFile(path)
    sys.stdout = stream

    def show(
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: TextIO | None = None,
        line: str | None = None,
    ) -> None:
        stream.write(warnings.formatwarning(message, category, filename, lineno, line))
        stream.flush()

    warnings.showwarning = show
    logging.lastResort = logging.StreamHandler(stream)
    logging.lastResort.setLevel(logging.WARNING)
    return path


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
