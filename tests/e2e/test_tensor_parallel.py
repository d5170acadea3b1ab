"""Tensor and context parallelism (``train.parallel.tp`` / ``cp``) against the single-process run, on CPU with gloo, in
fp32.

For every trainable attention variant (its distinct parameter sets, read from the registry as test_matrix.py does) on
LLaMA blocks with GQA, full attention on a GPT-2 block (LayerNorm, biases, learned positions, a tied head split over the
vocabulary, QK-norm): ``tp=2`` and ``cp=2`` (2 processes), ``dp=2 x tp=2`` and ``dp=2 x cp=2`` (4 processes, FSDP2 over
dp, and over dp x cp; the 4-process layouts for the cases of ``LAYOUT_SUBSETS``) runs of 6 steps give the single-process
run's training loss and gradient norm at every step within 1e-5 relative; so does full attention with document masking
(GPT-2's learned and LLaMA's rotary positions restarting per document) under ``cp=2`` and ``tp=2``. Tensor parallelism
runs with sequence parallelism (``train.parallel.sequence_parallel``, the default: the residual stream split on the
sequence over the TP ranks), and a few cases without it, with activation checkpointing, and under ``tp=2 x cp=2``
(hosted in another layout's launch). One launch per process count runs every case of its layouts in sequence
(tests/e2e/run_sequence.py; ``LAUNCH_GROUPS``). The loader is indexed by the data-parallel rank, so each layout trains
on the same global batches; the CP ranks of a replica split each sequence. The step-3 checkpoints of the ``cp=2`` and
``tp=2`` runs resume under another layout.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import pytest

from data.embedded import iter_embedded
from model.attention import registry
from pretrain.resume_config import HISTORY_PREFIX
from tests.e2e.helpers import (
    all_losses,
    console,
    run_sequence,
    runs_of,
    shared_launch,
    train_rows,
    worst_relative,
    write_summary,
)
from tests.e2e.test_matrix import SHAPE, _parameter_set, variant_cases
from tests.e2e.test_train_cli import overrides

TOL = 1e-5  # relative
STEPS = 6  # as the matrix's; 10 until 2026-11-27 (issue 39: the 4-process runs cost about 1 s a step)
# every case with GQA (2 KV heads, one per TP rank); full attention on a GPT-2 block instead (LayerNorm, biases,
# learned positions, a tied head split over the vocabulary) with QK-norm: one run per case keeps the launches short.
# Not QK-norm on Lazy: there its gradient norm moves by up to 1.6e-4 relative in ONE process between micro-batches
# of 1 and 4 (the Elastic-Softmax threshold turns fp32 rounding into a different set of zero weights), above TOL.
SHAPE_TP = {**SHAPE, "model.n_kv_heads": 2, "train.max_steps": STEPS, "eval.batch_size": 1}
GPT2 = {
    "model.family": "gpt2",
    "model.bias": True,
    "model.tie_embeddings": True,
    "model.n_kv_heads": 0,
    "model.qk_norm": True,
}
CASES = {label: options | (GPT2 if label == "full/default" else {}) for label, options in variant_cases().items()}
# document masking (full attention only; positions and document ids stay global under CP), on short documents (the
# speeches of the embedded corpus's first play: most 32-token windows hold several; its plays are whole documents)
DOCUMENTS = {
    "full/documents-gpt2": CASES["full/default"] | {"data.document_masking": True},
    "full/documents-llama": {"model.attention.kind": "full", "data.document_masking": True},
}
# the validation set is the first eval.batch_size x dp x eval.batches sequences: 2 on every layout
VAL_DP1 = {"eval.batches": 2}
LAYOUTS = {  # label -> (processes, overrides)
    "single": (0, VAL_DP1),
    "tp2": (2, {"train.engine": "fsdp2", "train.parallel.tp": 2, **VAL_DP1}),
    "dp2_tp2": (4, {"train.engine": "fsdp2", "train.parallel.tp": 2}),
    "cp2": (2, {"train.engine": "fsdp2", "train.parallel.cp": 2, **VAL_DP1}),
    "dp2_cp2": (4, {"train.engine": "fsdp2", "train.parallel.cp": 2}),
}
# dp2_cp2 runs the cases whose variant reads replicated state in its CP path (full on GPT-2, Focus) rather than
# every variant: the data-parallel dimension adds FSDP's sharding over dp x cp and the gradient reduction, which
# see no variant code; each variant's CP path and its parameters sharded over the CP ranks are cp2's (issue 39).
# dp2_tp2 runs full on GPT-2 (the tied head split over the vocabulary) and the cases whose variant has parameters of
# its own (``variant_parameters``), which FSDP shards over dp on top of their TP placement; a variant without any
# (focal's constant temperature, DGA) runs the backbone's 2-D sharding and its own TP path, which tp2 checks
LAYOUT_SUBSETS = {
    "dp2_cp2": ("full/default", "focus/soft-prefix"),
    "dp2_tp2": ("full/default", "focal/learned-query", "focus/soft-prefix", "lazy/default"),
}
# the layouts that also run the DOCUMENTS cases: under tp=2 sequence parallelism splits the per-document positions
WITH_DOCUMENTS = ("single", "cp2", "tp2")
# label -> (the launch that hosts it, its overrides, its cases): layouts that ride in another launch of their
# process count (each run builds its own mesh)
HOSTED = {
    # tp=2 x cp=2 (4 processes, dp=1; sequence parallelism splits each CP rank's chunks over TP), for full attention
    # on GPT-2 (learned positions at the CP chunks' global positions, split over TP; the tied head) and two variants
    # with their own parameters (the TP local-tensor swap must cover the CP path): Focus (replicated, read while
    # gathering the routing scores) and Lazy (split with the heads); every variant passed once (docs/parallel.md)
    "tp2_cp2": ("dp2_cp2", {"train.parallel.tp": 2, **VAL_DP1}, ("full/default", "focus/soft-prefix", "lazy/default")),
    # the replicated residual stream (sequence parallelism off) stays right
    "tp2_nosp": ("tp2", {"train.parallel.sequence_parallel": False}, ("full/default", "focus/soft-prefix")),
    # activation checkpointing recomputes a block under sequence parallelism (its gathers run again)
    "tp2_ac_full": ("tp2", {"train.activation_checkpointing": "full"}, ("full/default",)),
    "tp2_ac_selective": ("tp2", {"train.activation_checkpointing": "selective"}, ("focus/soft-prefix",)),
}
# layouts of one process count share a launch, in this order (each run builds its own mesh; a launch costs about
# 10 s of process start-up on 2 cores: issue 39)
LAUNCH_GROUPS = {"single": ("single",), "two": ("tp2", "cp2"), "four": ("dp2_tp2", "dp2_cp2")}
# the step-3 checkpoints of runs in the cp2 and tp2 launches resume under another layout (DCP reshards); Focus:
# centroids, a learned lambda and the Sinkhorn routing state; full on GPT-2: the tied head split over the vocabulary
# under tp
RESUME_CASES = ("focus/soft-prefix", "full/default")
RESUME_AT = 3
RESUME_AS = {"tp2": (2, {"train.engine": "fsdp2", "train.parallel.tp": 2}), "single": (0, {})}
RESUMES = {"cp2": ("tp2", "single"), "tp2": ("single",)}  # checkpointed under -> resumed as
# resumed as tp2: at the end of the 2-process launch that wrote them (a copy of the run directory up to step 3 each)
RESUME_HOSTS = {"tp2": "two"}
_launches: dict[str, dict[str, str]] = {}
SUMMARY: dict[tuple[str, str], dict[str, float]] = {}  # (layout, case) -> worst relative loss / grad_norm


def _run_dir(root: Path, layout: str, case: str) -> Path:
    return root / layout / case.replace("/", "_")


def _speeches(root: Path) -> Path:
    """A local jsonl corpus of short documents (written once per module)."""
    path = root / "speeches.jsonl"
    if not path.is_file():
        play = next(iter_embedded())
        speeches = [p.strip() for p in play.text.split("\n\n") if len(p.strip()) > 40]
        path.write_text("".join(json.dumps({"text": s}) + "\n" for s in speeches))
    return path


def _cases(layout: str) -> tuple[str, ...]:
    return LAYOUT_SUBSETS.get(layout, tuple(CASES))


def _group(layout: str) -> str:
    return next(group for group, layouts in LAUNCH_GROUPS.items() if layout in layouts)


def _launch(layout: str, root: Path, cache_dir: Path) -> dict[str, str]:
    """Every case under ``layout`` ({name: status}), from the one launch of its group (memoised: the group's first
    test pays); the group's launch also runs the resumes it hosts (``RESUME_HOSTS``)."""
    return runs_of(layout, _group_launch(_group(layout), root, cache_dir))


def _group_launch(group: str, root: Path, cache_dir: Path) -> dict[str, str]:
    def runs() -> dict[str, list[str]]:
        out = {f"{lay}: {name}": args for lay in LAUNCH_GROUPS[group] for name, args in _runs(lay, root, cache_dir)}
        for target, host in RESUME_HOSTS.items():
            if host == group:
                out |= {f"resume_{target}: {name}": args for name, args in _resume_runs(target, root, cache_dir)}
        return out

    nproc = LAYOUTS[LAUNCH_GROUPS[group][0]][0]
    return shared_launch(_launches, group, nproc, runs, root / f"{group}.status.json", timeout=1200)


def _runs(layout: str, root: Path, cache_dir: Path) -> list[tuple[str, list[str]]]:
    """(name, arguments) of every case under ``layout``: its cases (saving at ``RESUME_AT`` where another layout
    resumes them), the document cases and the hosted layouts'."""
    _, extra = LAYOUTS[layout]
    cases = {case: CASES[case] for case in _cases(layout)}
    if layout in WITH_DOCUMENTS:
        local = {"data.source": "local", "data.path": str(_speeches(root))}
        cases |= {case: options | local for case, options in DOCUMENTS.items()}
    if layout == "single":  # the same corpus unmasked: masking must change the losses for the parity to test it
        cases["full/unmasked-gpt2"] = cases["full/documents-gpt2"] | {"data.document_masking": False}
    for label, (host, more, hosted) in HOSTED.items():
        if host == layout:
            cases |= {f"{label}/{case}": CASES[case] | more for case in hosted}
    if layout in RESUMES:  # the checkpoint the other layouts resume from
        cases |= {case: cases[case] | {"checkpoint.every": RESUME_AT} for case in RESUME_CASES}
    return [  # eval.batch_size 1: the same 2 validation sequences on every layout
        (case, overrides(_run_dir(root, layout, case), cache_dir, **{**SHAPE_TP, **options, **extra}))
        for case, options in cases.items()
    ]


@pytest.fixture(scope="module", autouse=True)
def summary(tmp_path_factory):
    yield SUMMARY
    if SUMMARY:
        lines = ["| layout | case | worst relative loss | grad norm | final val loss |", "|---|---|---|---|---|"]
        lines += [
            f"| {lay} | {case} | {w['loss']:.1e} | {w['grad_norm']:.1e} | {w.get('val_loss', float('nan')):.1e} |"
            for (lay, case), w in SUMMARY.items()
        ]
        md = write_summary(tmp_path_factory, "tensor_parallel_summary.md", "\n".join(lines) + "\n")
        print("\n" + "\n".join(lines) + f"\n(written to {md})")


def variant_parameters(case: str) -> list[str]:
    """The attention core's own parameters under ``case`` (centroids, temperatures, distance tables)."""
    kind = CASES[case]["model.attention.kind"]
    prefix = f"model.attention.{kind}."
    options = {k.removeprefix(prefix): v for k, v in CASES[case].items() if k.startswith(prefix)}
    return [name for name, _ in _parameter_set(kind, options) if ".core." in name]


def test_the_cases_cover_every_trainable_variant_and_both_families():
    assert {c.split("/")[0] for c in CASES} >= {k for k, e in registry.items() if e.cls.trainable}
    assert CASES["full/default"]["model.family"] == "gpt2" and CASES["full/default"]["model.qk_norm"]
    # a launch group is one process count, and runs every layout once
    assert sorted(lay for layouts in LAUNCH_GROUPS.values() for lay in layouts) == sorted(LAYOUTS)
    assert all(len({LAYOUTS[lay][0] for lay in layouts}) == 1 for layouts in LAUNCH_GROUPS.values())
    assert all(RESUME_AS[t][0] == LAYOUTS[LAUNCH_GROUPS[g][0]][0] for t, g in RESUME_HOSTS.items())
    # dp2_tp2 keeps every case whose variant has parameters of its own (a new one joins it, or fails here)
    assert {c for c in CASES if variant_parameters(c)} | {"full/default"} == set(LAYOUT_SUBSETS["dp2_tp2"])


def test_document_masking_is_not_a_no_op(root, cache_dir):
    """The windows hold several documents: the masked run's first loss differs from the same corpus unmasked."""
    status = _launch("single", root, cache_dir)
    assert status["full/documents-gpt2"] == status["full/unmasked-gpt2"] == "ok", status
    masked, plain = (train_rows(_run_dir(root, "single", c)) for c in ("full/documents-gpt2", "full/unmasked-gpt2"))
    assert abs(plain[1]["loss"] - masked[1]["loss"]) > 1e-4


LAYOUT_CASES = (
    [(lay, c) for lay in LAYOUTS if lay != "single" for c in _cases(lay)]
    + [(lay, c) for lay in WITH_DOCUMENTS if lay != "single" for c in DOCUMENTS]
    + [(lay, c) for lay, (_, _, hosted) in HOSTED.items() for c in hosted]
)


@pytest.mark.parametrize(("layout", "case"), LAYOUT_CASES)
def test_layout_equals_the_single_process_run(layout, case, root, cache_dir):
    launch, name = (HOSTED[layout][0], f"{layout}/{case}") if layout in HOSTED else (layout, case)
    status, reference = _launch(launch, root, cache_dir), _launch("single", root, cache_dir)
    assert reference[case] == "ok", reference[case]
    assert status[name] == "ok", status[name]
    run_dir, ref_dir = _run_dir(root, launch, name), _run_dir(root, "single", case)
    run, ref = train_rows(run_dir), train_rows(ref_dir)
    assert sorted(run) == sorted(ref) == list(range(1, STEPS + 1))
    worst = {k: worst_relative({s: run[s][k] for s in run}, {s: ref[s][k] for s in ref}) for k in ("loss", "grad_norm")}
    # the final validation (the same 2 sequences on every layout; CP ranks score their chunks of them)
    val, val_ref = (all_losses(d)[(STEPS, "val_loss")] for d in (run_dir, ref_dir))
    worst["val_loss"] = abs(val - val_ref) / abs(val_ref)
    SUMMARY[(layout, case)] = worst
    for key in ("loss", "grad_norm", "val_loss"):
        assert worst[key] <= TOL, f"{key}: worst relative difference {worst[key]:.3g} against the single-process run"


def _layout_line(args: list[str], nproc: int) -> str:
    """The layout line a run of ``args`` (``--set key=value`` pairs) in a launch of ``nproc`` processes prints."""
    pairs = [kv.split("=", 1) for flag, kv in zip(args[::2], args[1::2]) if flag == "--set"]
    sets = {key: value.strip('"') for key, value in pairs}
    tp, cp, world = int(sets.get("train.parallel.tp", 1)), int(sets.get("train.parallel.cp", 1)), max(nproc, 1)
    dims = f"dp_replicate 1 x dp_shard {world // (cp * tp)} x cp {cp} x tp {tp}"
    return f"layout: {dims} (world {world}, {sets.get('train.engine', 'single')})"


@pytest.mark.parametrize("group", list(LAUNCH_GROUPS))
def test_the_console_names_each_layout_once_and_carries_no_torch_warning(group, root, cache_dir):
    """Issue 50: a launch's console (every rank's stdout and stderr) says each run's layout in one line (rank 0's)
    and holds none of torch's per-rank warnings: DTensor's ``[rank0]:W ... _redistribute`` (the gradient norm's two
    all-reduces, the consolidated checkpoint's two all-gathers) and FSDP2's "returned a view tensor" (the block
    handed out the attention output, a view under TP); docs/parallel.md, "Warnings". The tp=2 runs are the ``two``
    launch's, with the cp=2 runs and the tp=2 resumes."""
    status = _group_launch(group, root, cache_dir)
    path = root / f"{group}.status.json"
    text = console(path).read_text()
    spec = json.loads(path.with_suffix(".spec.json").read_text())["runs"]
    assert all(s == "ok" for s in status.values()), status
    torch_warnings = [line for line in text.splitlines() if re.match(r"\[rank\d+\]:W", line)]
    assert not torch_warnings, "\n".join(torch_warnings[:4])
    assert "returned a view tensor" not in text and "UserWarning" not in text, text[-3000:]
    nproc = LAYOUTS[LAUNCH_GROUPS[group][0]][0]
    # found anywhere in a line: the ranks share the console, and another rank's line may lack its newline yet
    printed = Counter(re.findall(r"layout: [^(\n]*\([^)\n]*\)", text))
    assert printed == Counter(_layout_line(args, nproc) for args in spec.values()), printed
    if group == "two":  # the row of issue 50: tp=2 alone
        assert printed["layout: dp_replicate 1 x dp_shard 1 x cp 1 x tp 2 (world 2, fsdp2)"] >= len(_cases("tp2"))


_resumed: dict[str, dict[str, str]] = {}


def _resume_runs(target: str, root: Path, cache_dir: Path) -> list[tuple[str, list[str]]]:
    """(``<source>/<case>``, arguments) of every run that resumes as ``target``: each in a copy of the source layout's
    run directory as it stood after its step-``RESUME_AT`` checkpoint (``--copy-run`` of the checkpoint: made when
    the run starts, after the source run in a launch that hosts both)."""
    _, extra = RESUME_AS[target]
    extra = extra | {"checkpoint.every": RESUME_AT}
    runs = []
    for source, targets in RESUMES.items():
        if target in targets:
            for case in RESUME_CASES:
                run_dir = _run_dir(root, f"resume_{target}", f"{source}/{case}")
                copy = ["--copy-run", str(_run_dir(root, source, case) / "checkpoints" / f"step_{RESUME_AT:08d}")]
                runs.append(
                    (f"{source}/{case}", copy + overrides(run_dir, cache_dir, **{**SHAPE_TP, **CASES[case], **extra}))
                )
    return runs


def _resume(target: str, root: Path, cache_dir: Path) -> dict[str, str]:
    """Every run that resumes as ``target`` (memoised): ``<source>/<case>`` -> status; in the launch of
    ``RESUME_HOSTS``, else in one launch after the launches that wrote the checkpoints."""
    if target in RESUME_HOSTS:
        return runs_of(f"resume_{target}", _group_launch(RESUME_HOSTS[target], root, cache_dir))
    if target not in _resumed:
        for source, targets in RESUMES.items():
            if target in targets:
                status = _launch(source, root, cache_dir)
                for case in RESUME_CASES:
                    assert status[case] == "ok", status[case]
        runs = dict(_resume_runs(target, root, cache_dir))
        _resumed[target] = run_sequence(RESUME_AS[target][0], runs, root / f"resume_{target}.status.json", timeout=600)
    return _resumed[target]


@pytest.mark.parametrize(("source", "target"), [(s, t) for s, targets in RESUMES.items() for t in targets])
def test_a_checkpoint_resumes_under_another_layout(source, target, root, cache_dir):
    """Checkpointed at step 3 under cp=2 (resumed as tp=2 and as one process) or under tp=2 with sequence
    parallelism (resumed as one process): steps 4-6 are the single-process run's. (Stopping under several ranks,
    ``train.stop_at``, is test_recipes'; a stopped run per case here repeated its layout run's first steps.)"""
    resumed, reference = _resume(target, root, cache_dir), _launch("single", root, cache_dir)
    key = source.rstrip("0123456789")  # the degree the history line names: cp2 -> cp
    for case in RESUME_CASES:
        name = f"{source}/{case}"
        assert reference[case] == "ok" and resumed[name] == "ok", (reference[case], resumed[name])
        run_dir = _run_dir(root, f"resume_{target}", name)
        assert f"{HISTORY_PREFIX}{RESUME_AT}: train.parallel.{key}: 2 -> 1" in (run_dir / "config.toml").read_text()
        run, ref = train_rows(run_dir), train_rows(_run_dir(root, "single", case))
        assert sorted(run) == sorted(ref) == list(range(1, STEPS + 1))
        keys = ("loss", "grad_norm")
        worst = {k: worst_relative({s: run[s][k] for s in run}, {s: ref[s][k] for s in ref}) for k in keys}
        SUMMARY[(f"{source} -> {target} at step {RESUME_AT}", case)] = worst
        for key_ in keys:
            assert worst[key_] <= TOL, f"{case} {key_}: worst relative difference {worst[key_]:.3g} against one process"
