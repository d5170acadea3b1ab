"""Issue 27: the per-rank peak activation memory of a ``cp=2`` training run is at most 0.6x that of the same run on
one process, for every trainable attention variant (read from the registry, at its defaults).

Measured as ``bench.memory`` measures, by the trainer itself (``FOCUSED_PRETRAIN_PEAK_MEMORY=1``,
``pretrain.loop``): the growth of the resident set's peak over one step's forward + backward (glibc returning freed
blocks), on every rank; a run's figure is the largest rank's at step 2 (step 1 warms up). The toy model of the
end-to-end tests (64 wide, 2 layers, fp32, batches of one sequence) on CPU with gloo; one launch per layout runs
every variant (``tests/e2e/run_sequence.py``).

At ``data.seq_len = 8192`` (the issue's length) the two launches take minutes on 2 cores: ``long_context`` (run with
``--long-context``). The slow tier checks the same ratio at 4096 with the ``tiny`` preset's proportions
(``TINY_PROPORTIONS``).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from model.attention import registry
from pretrain.loop import PEAK_MEMORY_ENV
from tests.e2e.helpers import run_sequence, write_summary
from tests.e2e.test_train_cli import overrides

RATIO = 0.6  # the bound, at its length (8192)
# the slow tier's proxy at 4096: the fused LM head (model/loss.py) no longer keeps the per-token logits, which CP
# split, so the toy's replicated share (weights, gradients, AdamW state) weighs more at this length: DGA measured
# 0.605-0.608 against 0.576 with the plain head (2026-11-27); at 8192 every variant holds 0.6 (0.517-0.596)
RATIO_4096 = 0.62
STEPS = 2  # the first warms up (gradients, optimizer state, allocator); the second is measured
KINDS = sorted(kind for kind, entry in registry.items() if entry.cls.trainable)
LAYOUTS = {"single": (0, {}), "cp2": (2, {"train.engine": "fsdp2", "train.parallel.cp": 2})}
# the slow tier's shape: the toy model's width (64) with the ``tiny`` preset's proportions (d_ff 2.69 d, a vocabulary of
# 16 d): the toy's own (d_ff 2 d, vocabulary 8 d) put the per-token layers that CP splits so close to the gathered
# K and V, which it does not split, that the ratio sits at 0.6 already at T = 4096 (see docs/parallel.md)
TINY_PROPORTIONS = {"model.d_ff": 176, "model.vocab_size": 1024}
_launches: dict[tuple[int, str], dict[str, float]] = {}


def _options(kind: str, seq_len: int, shape: dict) -> dict:
    return {
        "model.attention.kind": kind,
        **shape,
        **registry[kind].cls.launch_overrides("llama"),
        "model.max_seq_len": seq_len,
        "data.seq_len": seq_len,
        "train.batch_size": 1,
        "train.micro_batch_size": 1,
        "train.max_steps": STEPS,
        "train.warmup_steps": 1,
        "checkpoint.every": 0,
        "eval.every": 0,  # validation on the final weights only
        "eval.batches": 1,
        "eval.batch_size": 1,
        "eval.sample_tokens": 0,
    }


def _peak_mib(run_dir: Path) -> float:
    """The median over the measured steps (step 2 on) of the largest rank's step peak (MiB)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    peaks = [r["mem/step_peak_mib"] for r in rows if "mem/step_peak_mib" in r and r["step"] > 1]
    assert len(peaks) == STEPS - 1 and min(peaks) > 0, f"{run_dir}: unmeasured steps {peaks}"
    return statistics.median(peaks)


def _measure(seq_len: int, shape: dict, layout: str, root: Path, cache_dir: Path) -> dict[str, float]:
    """kind -> peak MiB of every trainable variant under ``layout`` (one launch, memoised)."""
    key = (seq_len, layout)
    if key not in _launches:
        nproc, extra = LAYOUTS[layout]
        dirs = {kind: root / f"{layout}_{seq_len}" / kind for kind in KINDS}
        runs = {kind: overrides(dirs[kind], cache_dir, **_options(kind, seq_len, shape), **extra) for kind in KINDS}
        status = run_sequence(
            nproc, runs, root / f"{layout}_{seq_len}.status.json", timeout=1500, env={PEAK_MEMORY_ENV: "1"}
        )
        failed = {kind: why for kind, why in status.items() if why != "ok"}
        assert not failed, failed
        _launches[key] = {kind: _peak_mib(dirs[kind]) for kind in KINDS}
    return _launches[key]


def _check(seq_len: int, shape: dict, tmp_path_factory, cache_dir: Path, ratio: float = RATIO) -> None:
    root = tmp_path_factory.getbasetemp() / "cp_memory"
    root.mkdir(exist_ok=True)
    single = _measure(seq_len, shape, "single", root, cache_dir)
    cp2 = _measure(seq_len, shape, "cp2", root, cache_dir)
    ratios = {kind: cp2[kind] / single[kind] for kind in KINDS}
    lines = [f"| variant | one process (MiB) | cp=2, largest rank (MiB) | ratio |  T = {seq_len}", "|---|---|---|---|"]
    lines += [f"| {k} | {single[k]:.1f} | {cp2[k]:.1f} | {ratios[k]:.3f} |" for k in KINDS]
    print("\n".join(lines))
    write_summary(tmp_path_factory, f"cp_memory_{seq_len}.md", "\n".join(lines) + "\n")
    above = {kind: round(r, 3) for kind, r in ratios.items() if not r <= ratio}
    assert not above, f"T={seq_len}: cp=2 per-rank peak above {ratio}x of one process: {above}\n" + "\n".join(lines)


@pytest.mark.slow
def test_cp2_rank_peak_is_at_most_0_62_of_one_process_at_4096(tmp_path_factory, cache_dir):
    _check(4096, TINY_PROPORTIONS, tmp_path_factory, cache_dir, RATIO_4096)


@pytest.mark.slow
@pytest.mark.long_context  # minutes on 2 cores: run with --long-context
def test_cp2_rank_peak_is_at_most_0_6_of_one_process_at_8192(tmp_path_factory, cache_dir):
    _check(8192, {}, tmp_path_factory, cache_dir)
