"""Sequence parallelism's per-rank peak memory: a ``tp=2`` training run with ``train.parallel.sequence_parallel``
against the same run without it, with activation checkpointing ``none`` and ``full`` (one launch of 2 gloo
processes runs the four).

Measured as ``bench.memory`` measures, by the trainer itself (``FOCUSED_PRETRAIN_PEAK_MEMORY=1``,
``pretrain.loop``): the growth of the resident set's peak over one step's forward + backward, on every rank; a run's
figure is the largest rank's at step 2 (step 1 warms up). A model where the residual stream is a fair share of the
activations: the ``tiny`` preset's width and proportions (d_model 256, 4 layers, 4 heads, 2 KV heads, d_ff 688) with
a vocabulary of 1024, at 2048 tokens, one sequence per step, fp32, full attention (figures: docs/parallel.md).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from pretrain.loop import PEAK_MEMORY_ENV
from tests.e2e.helpers import run_sequence, write_summary
from tests.e2e.test_train_cli import overrides

STEPS = 2  # the first warms up (gradients, optimizer state, allocator); the second is measured
SEQ_LEN = 2048
SHAPE = {
    "model.d_model": 256,
    "model.n_layers": 4,
    "model.n_heads": 4,
    "model.n_kv_heads": 2,
    "model.d_ff": 688,
    "model.vocab_size": 1024,
    "model.max_seq_len": SEQ_LEN,
    "data.seq_len": SEQ_LEN,
    "train.engine": "fsdp2",
    "train.parallel.tp": 2,
    "train.batch_size": 1,
    "train.micro_batch_size": 1,
    "train.max_steps": STEPS,
    "train.warmup_steps": 1,
    "checkpoint.every": 0,
    "eval.every": 0,
    "eval.batches": 1,
    "eval.batch_size": 1,
    "eval.sample_tokens": 0,
}
RUNS = {
    f"{ac}/{'sp' if sp else 'replicated'}": {
        "train.activation_checkpointing": ac,
        "train.parallel.sequence_parallel": sp,
    }
    for ac in ("none", "full")
    for sp in (False, True)
}


def _peak_mib(run_dir: Path) -> float:
    """The median over the measured steps (step 2 on) of the largest rank's step peak (MiB)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    peaks = [r["mem/step_peak_mib"] for r in rows if "mem/step_peak_mib" in r and r["step"] > 1]
    assert len(peaks) == STEPS - 1 and min(peaks) > 0, f"{run_dir}: unmeasured steps {peaks}"
    return statistics.median(peaks)


def test_sequence_parallel_lowers_the_tp2_rank_peak(tmp_path_factory, cache_dir):
    root = tmp_path_factory.mktemp("sp_memory")
    dirs = {name: root / name.replace("/", "_") for name in RUNS}
    runs = {name: overrides(dirs[name], cache_dir, **SHAPE, **options) for name, options in RUNS.items()}
    status = run_sequence(2, runs, root / "status.json", timeout=1200, env={PEAK_MEMORY_ENV: "1"})
    assert all(s == "ok" for s in status.values()), status
    peak = {name: _peak_mib(d) for name, d in dirs.items()}
    lines = [
        f"| activation checkpointing (T = {SEQ_LEN}) | tp=2 replicated (MiB) | tp=2 sequence parallel (MiB) | ratio |",
        "|---|---|---|---|",
    ]
    for ac in ("none", "full"):
        plain, sp = peak[f"{ac}/replicated"], peak[f"{ac}/sp"]
        lines.append(f"| {ac} | {plain:.1f} | {sp:.1f} | {sp / plain:.3f} |")
    print("\n" + "\n".join(lines))
    write_summary(tmp_path_factory, "sp_memory.md", "\n".join(lines) + "\n")
    for ac in ("none", "full"):
        assert peak[f"{ac}/sp"] < peak[f"{ac}/replicated"], "\n".join(lines)
