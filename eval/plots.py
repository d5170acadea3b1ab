"""PNG plots for evaluations and runs: the needle depth x length heatmap, training / validation loss
curves and the Focus attention statistics from a run's metrics.jsonl.

matplotlib (Agg backend) is imported only inside the plotting functions, so the rest of ``eval``
works without it. Every PNG is written under a temporary name and moved into place, so a reader
never sees half a file.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from core.errors import ConfigError

if TYPE_CHECKING:
    from matplotlib.figure import Figure

FOCUS_PREFIX = "attn/focus/"
FOCUS_FIRST = FOCUS_PREFIX + "max_group_share"


def _pyplot() -> ModuleType:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Figure, path: str | Path) -> Path:
    """Write ``fig`` as PNG to ``path`` atomically (temporary name in the same folder, then os.replace)."""
    plt = _pyplot()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fig.savefig(tmp, format="png", dpi=120)
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)
    return path


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _read_metrics(metrics_jsonl: str | Path) -> list[dict]:
    """The JSON objects of a metrics.jsonl; unparsable lines (a run still writing its last one) are skipped."""
    path = Path(metrics_jsonl)
    if not path.is_file():
        raise ConfigError(f"metrics_jsonl: no such file {str(path)!r} (expected a run's metrics.jsonl)")
    rows = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and _is_number(row.get("step")):
            rows.append(row)
    return rows


def _series(rows: list[dict], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of ``key``, the last value per step (a resumed run logs some steps twice)."""
    by_step = {row["step"]: row[key] for row in rows if _is_number(row.get(key))}
    steps = sorted(by_step)
    return steps, [by_step[s] for s in steps]


def plot_needle_heatmap(grid: Mapping, path: str | Path, title: str = "") -> Path:
    """Depth (rows) x length (columns) heatmap of scores 0..100, from a runner's "grid" (or its whole result)."""
    if isinstance(grid.get("grid"), Mapping):
        grid = grid["grid"]
    lengths = sorted(grid, key=float)
    depths = sorted({d for row in grid.values() for d in row}, key=float)
    if not lengths or not depths:
        raise ConfigError("grid: no scores to plot (expected {length: {depth: score}})")
    import numpy as np

    data = np.full((len(depths), len(lengths)), np.nan)
    for j, length in enumerate(lengths):
        for i, depth in enumerate(depths):
            if depth in grid[length]:
                data[i, j] = float(grid[length][depth])
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(4.0, 1.0 * len(lengths) + 2.5), max(3.0, 0.4 * len(depths) + 1.8)))
    image = ax.imshow(data, vmin=0, vmax=100, cmap="RdYlGn", aspect="auto", interpolation="nearest")
    ax.set_xticks(range(len(lengths)), [str(int(float(x))) for x in lengths])
    ax.set_yticks(range(len(depths)), [f"{float(d):g}" for d in depths])
    for i in range(len(depths)):
        for j in range(len(lengths)):
            if not np.isnan(data[i, j]):
                ax.text(j, i, f"{data[i, j]:.0f}", ha="center", va="center", fontsize=8)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth (fraction of the context)")
    ax.set_title(title or "needle retrieval score")
    fig.colorbar(image, ax=ax, label="score (0-100)")
    fig.tight_layout()
    return _save(fig, path)


def plot_loss_curves(metrics_jsonl: str | Path, path: str | Path, title: str = "") -> Path:
    """Training ``loss`` and validation ``val_loss`` against step from a run's metrics.jsonl."""
    rows = _read_metrics(metrics_jsonl)
    train, val = _series(rows, "loss"), _series(rows, "val_loss")
    if not train[0] and not val[0]:
        raise ConfigError(f"metrics_jsonl: {metrics_jsonl} has no lines with 'step' and 'loss' or 'val_loss'")
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.8))
    if train[0]:
        ax.plot(*train, linewidth=1, label="train loss")
    if val[0]:
        ax.plot(*val, marker="o", markersize=3, linewidth=1.5, label="val loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / token)")
    ax.set_title(title or "loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return _save(fig, path)


def plot_group_sizes(metrics_jsonl: str | Path, path: str | Path, title: str = "") -> Path:
    """One panel per ``attn/focus/*`` statistic against step, max_group_share first."""
    rows = _read_metrics(metrics_jsonl)
    keys = sorted({k for row in rows for k, v in row.items() if k.startswith(FOCUS_PREFIX) and _is_number(v)})
    if not keys:
        raise ConfigError(
            f"metrics_jsonl: {metrics_jsonl} has no {FOCUS_PREFIX}* metrics (only runs with Focus attention log them)"
        )
    if FOCUS_FIRST in keys:
        keys.remove(FOCUS_FIRST)
        keys.insert(0, FOCUS_FIRST)
    cols = min(3, len(keys))
    nrows = math.ceil(len(keys) / cols)
    plt = _pyplot()
    fig, axes = plt.subplots(nrows, cols, figsize=(4.0 * cols, 2.6 * nrows), squeeze=False)
    for ax, key in zip(axes.flat, keys):
        ax.plot(*_series(rows, key), linewidth=1)
        ax.set_title(key[len(FOCUS_PREFIX) :], fontsize=9)
        ax.grid(alpha=0.3)
        if key == FOCUS_FIRST:
            ax.set_ylim(0, 1)  # a share of the tokens
    for ax in list(axes.flat)[len(keys) :]:
        ax.set_visible(False)
    fig.supxlabel("step")
    fig.suptitle(title or "Focus attention group statistics")
    fig.tight_layout()
    return _save(fig, path)


def plot_loss_by_length(results: dict[int, dict], path: str | Path, *, train_length: int, title: str = "") -> Path:
    """Perplexity against context length (eval.length.loss_by_length's results), the training length marked."""
    plt = _pyplot()
    points = sorted((length, r["perplexity"]) for length, r in results.items() if "perplexity" in r)
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot([p[0] for p in points], [p[1] for p in points], marker="o")
    ax.axvline(train_length, color="grey", linestyle="--", linewidth=1, label=f"training length {train_length}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("perplexity")
    ax.set_title(title or "perplexity against context length")
    ax.legend()
    fig.tight_layout()
    return _save(fig, path)
