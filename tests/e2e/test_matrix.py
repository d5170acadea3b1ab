"""Every trainable attention variant x every engine, derived from the registries (a new variant or engine joins
with no edit here), on CPU: 2 gloo processes for the data-parallel engines.

- Variants: each trainable variant's causal suite cases (``Attention.suite_cases``, options sized for short
  sequences), one per distinct parameter set: full, focal constant and learned, lazy, focus soft, dga causal.
- Engines: each registered engine; fsdp2 also as HSDP (2 replicas x 1 shard), deepspeed as ZeRO 1, 2 and 3; and
  activation checkpointing (full, selective) and ``train.compile`` under fsdp2 (``BLOCK_ENGINES``).
- Per (variant, engine): the losses of an uninterrupted 6-step run (training losses per step and the final
  validation loss) equal the single-process run's to 1e-5 relative, and a new trainer resumed from that run's
  step-3 checkpoint (a copy of its directory as it stood then: run_sequence's ``--copy-run`` of the checkpoint)
  gives steps 4-6 bit for bit (loss and gradient norm), for every variant under the engines that write different
  kinds of checkpoint (``RESUME_EVERY_VARIANT``) and for one variant under the other engine options and under
  ``train.compile`` (``RESUME_ONE_VARIANT``, ``RESUME_UNDER_COMPILE``). Stopping itself (``train.stop_at``) is
  test_tensor_parallel's, test_recipes' and test_train_cli's; here a separate stopped run per case repeated the
  uninterrupted run's first steps (issue 39: a quarter of the matrix's runs).

One launch per process count (one for the single-process engine, one for every data-parallel engine and option)
runs every variant's runs in sequence (``tests/e2e/run_sequence.py``). The summary table (variant, engine, worst
relative loss difference, resume exact) is written to ``matrix_summary.md`` and ``.json`` under pytest's base
temporary directory (or ``$MATRIX_SUMMARY_DIR``) and printed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from model.attention import registry
from model.attention.common.base import SuiteCase
from model.config import AttentionConfig
from model.transformer import build_model
from pretrain.engines import ENGINES
from pretrain.resume_config import HISTORY_PREFIX
from run.engines import ENGINE_SPECS
from tests.conftest import small_model_config
from tests.e2e.helpers import (
    HAVE_DEEPSPEED,
    all_losses,
    runs_of,
    shared_launch,
    train_rows,
    worst_relative,
    write_summary,
)
from tests.e2e.test_train_cli import overrides

TOL = 1e-5  # relative
STEPS, STOP = 6, 3
SHAPE = {
    "model.d_model": 32,
    "model.n_layers": 2,
    "model.n_heads": 4,
    "model.d_ff": 64,
    "model.max_seq_len": 32,
    "data.seq_len": 32,
    "train.batch_size": 4,
    "train.micro_batch_size": 1,  # gradient accumulation on every engine (no_sync paths)
    "train.max_steps": STEPS,
    "train.warmup_steps": 2,
    "checkpoint.every": 0,
    "eval.every": 0,  # validation on the final weights only
    "eval.batches": 1,
    "eval.sample_tokens": 0,
}
# the validation set is the first eval.batch_size x world size x eval.batches sequences: the same 4 on any world
# size only with eval.batch_size = 4 / world size (its default, the micro-batch, is not: accumulation is on here)
VAL_SEQUENCES = 4
# the option settings each engine is covered with (label -> overrides); an engine not named here runs as it is
ENGINE_OPTIONS: dict[str, dict[str, dict]] = {
    "fsdp2": {"fsdp2": {}, "hsdp": {"train.fsdp2.replicate": 2}},
    "deepspeed": {f"zero{s}": {"train.deepspeed.zero_stage": s} for s in (1, 2, 3)},
}
# recomputation and compilation, under these engines
BLOCK_OPTIONS = {
    "ac_full": {"train.activation_checkpointing": "full"},
    "ac_selective": {"train.activation_checkpointing": "selective"},
    "compile": {"train.compile": True},
}
# under fsdp2 only: it runs the same per-block recomputation and compilation as one process (parallelize applies both
# before the wrap) and shards the compiled, checkpointed blocks besides; the single-process legs repeated them at the
# cost of one more cold compile of every variant (the suite's slowest launch, 2026-11-27)
BLOCK_ENGINES = ("fsdp2",)
# Compiled runs cost a compile each (minutes for all variants on 2 cores): every variant's uninterrupted run is
# compared with the single-process run, and stop / resume is checked on one variant (what resume depends on under
# compile, the checkpoint's parameter names and RNG state, does not depend on the variant)
RESUME_UNDER_COMPILE = "full/default"
# Stop / resume for every variant under the engines whose checkpoints differ in kind (one process's files, DDP, FSDP2's
# DCP shards, ZeRO-3's partitions): what a variant adds to a checkpoint (its parameters and buffers: centroids,
# temperatures, Sinkhorn state) meets each writer there. The other engine options write the same kind of checkpoint
# (HSDP: FSDP2's DCP on a 2-D mesh; ZeRO 1 and 2: DeepSpeed's writer with optimizer partitions; recomputation adds
# nothing to a checkpoint) and resume one variant, the one with the most state of its own (issue 39: about a third of
# the matrix's runs, dropped as repeats of what the first engines check for the same code)
RESUME_EVERY_VARIANT = ("single", "ddp", "fsdp2", "zero3")
RESUME_ONE_VARIANT = "focus/soft-prefix"


def _parameter_set(kind: str, options: dict) -> tuple:
    cfg = small_model_config(attention=AttentionConfig(kind=kind, options={kind: registry[kind].config_cls(**options)}))
    return tuple((name, tuple(p.shape)) for name, p in build_model(cfg, device="meta").named_parameters())


def variant_cases() -> dict[str, dict]:
    """label ``<variant>/<case>`` -> config overrides: every trainable variant's causal suite cases, the first of
    each distinct parameter set (focal's constant and learned temperature; Focus's soft mode, not its hard
    inference mode or other gates, which train the same parameters), with the variant's launch settings."""
    cases = {}
    for kind in sorted(registry):
        cls = registry[kind].cls
        if not cls.trainable:
            continue
        seen = set()
        for case in cls.suite_cases() or [SuiteCase("default")]:
            signature = _parameter_set(kind, case.options)
            if not case.causal or signature in seen:
                continue
            seen.add(signature)
            extra = {"model.attention.kind": kind, **cls.launch_overrides("llama")}
            cases[f"{kind}/{case.name}"] = extra | {f"model.attention.{kind}.{k}": v for k, v in case.options.items()}
    return cases


def engine_cases() -> dict[str, dict]:
    """label -> overrides: every registered engine with its option settings, then the block options."""
    cases = {}
    for name in ENGINES:
        for label, extra in ENGINE_OPTIONS.get(name, {name: {}}).items():
            cases[label] = {"train.engine": name, **extra}
    for name in BLOCK_ENGINES:
        for label, extra in BLOCK_OPTIONS.items():
            cases[f"{name}+{label}"] = {"train.engine": name, **extra}
    return cases


VARIANTS, ENGINE_CASES = variant_cases(), engine_cases()
REFERENCE = "single"
_launches: dict[int, dict[str, str]] = {}  # process count -> {"<label>: <variant> <run>": status}
SUMMARY: dict[tuple[str, str], dict] = {}


def _run_dir(root: Path, engine: str, variant: str, run: str) -> Path:
    return root / engine.replace("+", "_") / variant.replace("/", "_") / run


def _runs(engine: str, variant: str) -> list[str]:
    """The runs of (engine, variant): uninterrupted, then resumed from its step-STOP checkpoint where this pair
    checks resume (see RESUME_EVERY_VARIANT, RESUME_UNDER_COMPILE)."""
    if engine.endswith("+compile"):
        resumes = variant == RESUME_UNDER_COMPILE
    else:
        resumes = engine in RESUME_EVERY_VARIANT or variant == RESUME_ONE_VARIANT
    return ["full", "resume"] if resumes else ["full"]


def _nproc(engine: str) -> int:
    """2 processes for a data-parallel engine's labels, else 0 (one process, no launcher)."""
    return 2 if ENGINE_SPECS[ENGINE_CASES[engine]["train.engine"]].distributed else 0


def _launch(engine: str, root: Path, cache_dir: Path) -> dict[str, str]:
    """Every variant's runs under ``engine`` ({"<variant> <run>": status}). One launch per process count runs every
    engine label of that count (memoised: the first test pays): each run builds its own engine, mesh and compiled
    blocks, as runs of one label already did; a launch costs about 10 s of process start-up (issue 39)."""
    nproc = _nproc(engine)

    def runs() -> dict[str, list[str]]:
        out = {}
        for label, extra in ENGINE_CASES.items():
            if _nproc(label) != nproc or (extra["train.engine"] == "deepspeed" and not HAVE_DEEPSPEED):
                continue  # (a deepspeed label's tests skip without it)
            extra = {**extra, "eval.batch_size": VAL_SEQUENCES // max(nproc, 1)}
            for variant, options in VARIANTS.items():
                runs = _runs(label, variant)
                # a resumed pair's uninterrupted run also saves at STOP (the checkpoint the resume starts from)
                saves = {"checkpoint.every": STOP} if "resume" in runs else {}
                full = _run_dir(root, label, variant, "full")
                args = {**SHAPE, **options, **extra, **saves}
                out[f"{label}: {variant} full"] = overrides(full, cache_dir, **args)
                if "resume" in runs:
                    resumed = overrides(_run_dir(root, label, variant, "resumed"), cache_dir, **args)
                    step = full / "checkpoints" / f"step_{STOP:08d}"
                    out[f"{label}: {variant} resume"] = ["--copy-run", str(step), *resumed]
        return out

    return runs_of(engine, shared_launch(_launches, nproc, nproc, runs, root / f"nproc{nproc}.status.json"))


@pytest.fixture(scope="module", autouse=True)
def summary(tmp_path_factory):
    yield SUMMARY
    if not SUMMARY:
        return
    lines = ["| variant | engine | worst relative loss difference | resume exact |", "|---|---|---|---|"]
    for (variant, engine), row in SUMMARY.items():
        worst = "failed" if row["worst"] is None else f"{row['worst']:.2e}"
        lines.append(f"| {variant} | {engine} | {worst} | {row['resume']} |")
    table = "\n".join(lines)
    md = write_summary(tmp_path_factory, "matrix_summary.md", table + "\n")
    rows = {f"{v} x {e}": r for (v, e), r in SUMMARY.items()}
    write_summary(tmp_path_factory, "matrix_summary.json", json.dumps(rows, indent=1))
    print(f"\n{table}\n(written to {md})")


def test_the_matrix_covers_every_trainable_variant_and_engine():
    kinds = {label.split("/")[0] for label in VARIANTS}
    assert kinds == {k for k, e in registry.items() if e.cls.trainable}
    assert {"focal/constant", "focal/learned-query", "focus/soft-prefix", "dga/causal"} <= VARIANTS.keys()
    assert {c["train.engine"] for c in ENGINE_CASES.values()} == set(ENGINES)
    assert {"single", "ddp", "fsdp2", "hsdp", "zero1", "zero2", "zero3"} <= ENGINE_CASES.keys()
    assert set(RESUME_EVERY_VARIANT) <= ENGINE_CASES.keys() and RESUME_ONE_VARIANT in VARIANTS
    # every engine resumes something, and every variant resumes under every kind of checkpoint
    assert all(any("resume" in _runs(e, v) for v in VARIANTS) for e in ENGINE_CASES)


@pytest.mark.parametrize(("engine", "variant"), [(e, v) for e in ENGINE_CASES for v in VARIANTS])
def test_variant_under_engine(engine, variant, root, cache_dir):
    if ENGINE_CASES[engine]["train.engine"] == "deepspeed" and not HAVE_DEEPSPEED:
        pytest.skip("deepspeed is not installed (pip install -e '.[deepspeed]')")
    row = SUMMARY.setdefault((variant, engine), {"worst": None, "resume": "no"})
    status = _launch(engine, root, cache_dir)
    runs = _runs(engine, variant)
    failed = {run: status[f"{variant} {run}"] for run in runs if status[f"{variant} {run}"] != "ok"}
    assert not failed, failed
    reference = _launch(REFERENCE, root, cache_dir)
    assert reference[f"{variant} full"] == "ok", reference[f"{variant} full"]

    full = _run_dir(root, engine, variant, "full")
    row["worst"] = worst = worst_relative(all_losses(full), all_losses(_run_dir(root, REFERENCE, variant, "full")))
    assert len(all_losses(full)) == STEPS + 1, "a training loss per step and the final validation loss"
    assert worst <= TOL, f"worst relative loss difference {worst:.3g} against the single-process run"
    if "resume" not in runs:
        on = RESUME_UNDER_COMPILE if engine.endswith("+compile") else RESUME_ONE_VARIANT
        row["resume"] = f"not run (checked on {on})"
        return
    resumed_dir = _run_dir(root, engine, variant, "resumed")
    # a trainer that found no checkpoint would start afresh and give the same losses: it must have resumed
    assert f"{HISTORY_PREFIX}{STOP}: " in (resumed_dir / "config.toml").read_text(), "not resumed from step 3"
    resumed, uninterrupted = train_rows(resumed_dir), train_rows(full)
    exact = sorted(resumed) == list(range(1, STEPS + 1)) and all(
        (resumed[s]["loss"], resumed[s]["grad_norm"]) == (uninterrupted[s]["loss"], uninterrupted[s]["grad_norm"])
        for s in range(STOP + 1, STEPS + 1)
    )
    row["resume"] = "yes" if exact else "no"
    assert exact, {s: (resumed.get(s, {}).get("loss"), uninterrupted[s]["loss"]) for s in range(STOP + 1, STEPS + 1)}
