"""The GPU measured in one call: ``python -m bench.gpu --out DIR [--budget 540] [--only WORDS]``.

On one CUDA device: the training-step benchmark (``bench.train_step``: tokens/s, step time, peak memory, MFU per
trainable variant), ``bench.attention``'s figures for every variant (forward, forward+backward, peak memory, decode)
at two attention shapes, where the time goes in each (``bench.profiling``: top kernels by device time, kernels
launched and host synchronisations per step) and the CUDA test suite (pytest in a child process, each outcome
counted as it finishes). Writes ``DIR/gpu_suite.json`` and ``DIR/gpu_suite.md`` (``bench.gpu_report``: device,
torch / CUDA versions, commit, command, a headline table against the goals, every item's status and figures) after
every item, so a run cut off anywhere still reports what it measured.

Order: the work is a list of items run in turn until ``--budget`` seconds are spent, the most important first:

1. ``train llama-1.3b full``: MFU at T = 4096, the headline figure, with the activation checkpointing and
   micro-batch the layout planner picks for the device (``bench.train_step.arm_plan``), stated in the headline.
2. ``train llama-1.3b <variant>`` for every trainable variant, each planned alike: time per token / full
   attention's (an arm whose timed steps pass 30 s stops after 3 of them: lazy's step took 12 s on an H200 at
   micro-batch 2).
3. ``tests``: the CUDA test file ``tests/attention/test_gpu_suite.py`` (fast paths against references on the
   device, causality, KV cache), fast tier; counted per test as it finishes, so a cut-off run still counts what ran.
   It comes before the attention items so that it finishes inside the default budget.
4. ``focus hard forward``: Focus hard k = 1 (K = 4 and 8) beside full attention at 16K and 64K, forward, at the
   small attention shape (batch 1, 4 heads x 64).
5. ``decode``: one token at a 16K context for full attention, Focus hard k = 1 and DGA, small shape.
6. ``focus hard forward llama-1.3b``, ``decode llama-1.3b``: items 4 and 5 at llama-1.3b's attention shape
   (16 heads x 128, a batch of 32K tokens: 2 x 16384, 1 x 65536).
7. ``tests shared suite``: the shared suite ``tests/attention/test_suite.py`` on the device (CI runs it on CPU).
7b. ``train llama-2.7b full`` and ``train llama-2.7b full float8 rowwise`` / ``... tensorwise`` (``train.float8``):
   the bf16 arm and the two float8 arms at T = 4096, each planned for the device with its own recipe (the planner
   counts float8's working memory); a float8 arm's MFU is on the bf16 FLOPs and peak, and it reports its tokens/s /
   the bf16 arm's (``float8_speedup``; the quick run: one rowwise arm of the tiny model). These three run 50 steps
   in all (one fixed random batch, as every arm) and the headline compares the float8 arms' final losses with bf16's.
8. ``train llama-124m <variant>``: full attention and every trainable variant.
9. ``attention T=...`` and ``attention T=... llama-1.3b``: every variant at 4K, 16K and 64K (forward,
   forward+backward, peak memory) at each shape, then ``attention decode`` (and ``... llama-1.3b``): every
   variant's decode at 16K.
10. ``focus hard long T=...`` (and ``... llama-1.3b``): Focus hard k = 1 (K = 8) beside full attention at 256K and 1M.

Profiles (``bench.profiling``) come with the items' own measurements, on the compiled model or module they have just
timed, so that no arm compiles twice: every training item profiles 2 more steps (1 when a step takes over a second),
every attention item one more call of each case (forward+backward where it was timed) and one more decode token.
``--no-profile`` leaves them out.

Each item has a cap (seconds) and is not started with less than its minimum left; one that errs (out of memory,
a missing kernel) is reported with its traceback's tail and the run goes on; one that passes its cap or the budget
is cut off by a timer and reported as such, with the rows it had measured (an item fills them in as it goes). ``--only``
runs the items whose name contains one of the given words (a later run can fill in what a cut-off run left out).

``--device cpu --quick`` runs the same items on tiny shapes (a 2-layer model at T = 128, attention at 128-1024, the
llama-1.3b shape with a batch of 256 tokens, the test file that needs CUDA, which then skips), one CPU thread: the CI
check that the suite still runs. Its profiles are of CPU operators (no device: kernels and synchronisations n/a).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import torch

from bench import attention as attn
from bench import gpu_report, profiling, train_step
from bench.pytest_outcomes import OUTCOMES_ENV
from core.errors import OneLineParser

REPO = Path(__file__).resolve().parents[1]
FOCUS_HARD = ("focus hard k=1 (K=4, w=128)", "focus hard k=1 (K=8, w=128)")
FOCUS_HARD_MAIN = FOCUS_HARD[1]
DGA_CAUSAL = "dga causal (C=128, m=16, gamma=0.1)"
BIG_SHAPE = "llama-1.3b"  # the second attention shape: this preset's heads x head dimension
FLOAT8_PRESET = "llama-2.7b"  # the float8 arms' model (issue 49's goal: rowwise >= 1.2x, tensorwise >= 1.25x bf16)


@dataclass
class Plan:
    """The sizes of a run: a GPU's, or the quick stand-ins on CPU."""

    seq_len: int  # training steps
    train_steps: int
    train_warmup: int
    focus_lengths: list[int]
    decode_context: int
    matrix_lengths: list[int]
    long_lengths: list[int]
    repeat: int  # attention: median of this many runs / decode rounds
    decode_steps: int  # decode tokens per round
    max_seconds: float  # attention: skip a run predicted to take longer
    big_tokens: int  # tokens per call at the llama-1.3b attention shape (the batch: tokens // T, at least 1)
    tests: list[str] = field(default_factory=list)  # the "tests" item: the CUDA test file
    shared_tests: list[str] = field(default_factory=list)  # the "tests shared suite" item (none: no item)
    train_timed_s: float = 0.0  # a training arm's timed steps stop past this many seconds, after 3 (0: no limit)
    # the float8 items' steps in all (warm-up included, no time limit): their losses after this many steps compare
    # with the bf16 arm's (issue 49: within 1% after 50); 0: the other arms' steps
    float8_steps: int = 0
    profile_steps: int = 2  # training steps profiled per arm (0: no profiles)
    profile_top: int = profiling.TOP  # kernels (CPU: operators) listed per profile


GPU_PLAN = Plan(
    seq_len=train_step.SEQ_LEN,
    train_steps=10,
    train_warmup=3,
    focus_lengths=[16384, 65536],
    decode_context=16384,
    matrix_lengths=[4096, 16384, 65536],
    long_lengths=[262144, 1048576],
    repeat=3,
    decode_steps=16,
    max_seconds=15.0,
    big_tokens=attn.PRESET_TOKENS,
    tests=["tests/attention/test_gpu_suite.py"],
    shared_tests=["tests/attention/test_suite.py"],
    train_timed_s=30.0,
    float8_steps=50,
)
QUICK_PLAN = Plan(
    seq_len=train_step.QUICK_SEQ_LEN,
    train_steps=1,
    train_warmup=0,
    focus_lengths=[256, 512],
    decode_context=256,
    matrix_lengths=[128],
    long_lengths=[1024],
    repeat=1,
    decode_steps=2,
    max_seconds=20.0,
    big_tokens=256,
    tests=["tests/attention/test_gpu_suite.py"],
    profile_steps=1,
    profile_top=5,
)


Run = Callable[[float, dict[str, Any]], dict[str, Any]]


@dataclass
class Item:
    name: str
    # given a deadline to stop by (time.perf_counter()) and a dict to fill in as it measures (what a cut-off or
    # failing item reports), returns its figures
    run: Run
    cap_s: float  # cut off past this many seconds
    min_s: float = 15.0  # not started with less of the budget left


class Cutoff(BaseException):
    """The item's timer ran out. A BaseException, so that no ``except Exception`` inside the work swallows it."""


def _alarm(signum: int, frame: FrameType | None) -> None:
    raise Cutoff


# ---- items -----------------------------------------------------------------------------------------------------------
def train_item(
    preset: str, kind: str, device: str, plan: Plan, quick: bool, float8: str = "none", steps: int = 0
) -> Run:
    """``steps`` > 0: that many steps in all, warm-up included, with no time limit on the timed ones (the float8
    items, whose final losses are compared)."""

    def run(deadline: float, sofar: dict[str, Any]) -> dict[str, Any]:
        # the planner's checkpointing and micro-batch for this device (bench.train_step.arm_plan)
        cfg, chosen = train_step.arm_plan(preset, kind, seq_len=plan.seq_len, device=device, quick=quick, float8=float8)
        row = train_step.measure_arm(
            cfg,
            plan=chosen,
            steps=steps - plan.train_warmup if steps else plan.train_steps,
            warmup=plan.train_warmup,
            deadline=deadline,
            max_timed_s=0.0 if steps else plan.train_timed_s,
            profile_steps=plan.profile_steps,
            profile_top=plan.profile_top,
            measured=lambda r: sofar.update(preset=preset, **r),  # kept if the profile is cut off
        )
        return {"preset": preset, **row}

    return run


def cases(labels: tuple[str, ...] | None = None, backward: bool = True) -> list[attn.Case]:
    """bench.attention's cases by label (full attention always first; None: every case)."""
    chosen = [c for c in attn.CASES if c.kind == "full" or labels is None or c.label in labels]
    return chosen if backward else [dataclasses.replace(c, backward=False) for c in chosen]


def shape_for(name: str, plan: Plan) -> Callable[[int], attn.Shape]:
    """An attention item's shape at each length: the small one, or the llama-1.3b one with ``plan.big_tokens``."""
    return attn.small_shape if name == "small" else attn.preset_shape(name, plan.big_tokens)


def forward_item(
    chosen: list[attn.Case], lengths: list[int], device: str, plan: Plan, quick: bool, shape: str = "small"
) -> Run:
    def run(deadline: float, sofar: dict[str, Any]) -> dict[str, Any]:
        # rows go into ``sofar`` as they are measured: a cut-off item keeps them
        sofar.update(forward=[], attention_skips=[])
        attn.bench_forward(
            chosen,
            lengths,
            device,
            attention_dtype(device),
            plan.repeat,
            1.0,
            plan.max_seconds,
            sofar["attention_skips"],
            cpu_memory=not quick,
            shape=shape_for(shape, plan),
            rows=sofar["forward"],
            profile_top=plan.profile_top if plan.profile_steps else 0,
        )
        return sofar

    return run


def decode_item(chosen: list[attn.Case], context: int, device: str, plan: Plan, shape: str = "small") -> Run:
    def run(deadline: float, sofar: dict[str, Any]) -> dict[str, Any]:
        sofar.update(decode=[], attention_skips=[])
        attn.bench_decode(
            chosen,
            [context],
            device,
            attention_dtype(device),
            plan.decode_steps,
            plan.repeat,
            1.0,
            sofar["attention_skips"],
            shape=shape_for(shape, plan),
            rows=sofar["decode"],
            profile_top=plan.profile_top if plan.profile_steps else 0,
        )
        return sofar

    return run


def attention_dtype(device: str) -> torch.dtype:
    return torch.bfloat16 if device == "cuda" else torch.float32


class PytestRun:
    """pytest (fast tier) on ``paths`` in a child process, its output in ``DIR/<stem>.log``; each test's outcome is
    written as it finishes (``bench.pytest_outcomes``, ``DIR/<stem>.jsonl``), so a run stopped at its deadline still
    reports the counts so far. ``start`` may come early (the quick run overlaps it with the other items; a GPU run
    starts it in turn, so that it does not disturb the timings)."""

    def __init__(self, paths: list[str], out: Path, stem: str = "tests"):
        self.paths, self.outcomes, self.log = paths, out / f"{stem}.jsonl", out / f"{stem}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        if self.proc is not None:
            return
        self.outcomes.unlink(missing_ok=True)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
        env[OUTCOMES_ENV] = str(self.outcomes)
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "bench.pytest_outcomes"]
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [*cmd, "-m", "not slow", *self.paths], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT
            )

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def __call__(self, deadline: float, sofar: dict[str, Any]) -> dict[str, Any]:
        self.start()
        assert self.proc is not None
        timeout = max(1.0, deadline - time.perf_counter())
        try:
            code: int | None = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            code = None
        except BaseException:
            self.stop()
            raise
        counts = outcome_counts(self.outcomes)
        if code is not None and code not in (0, 1, 5):  # 1: tests failed, 5: none collected; others: pytest failed
            raise RuntimeError(f"pytest exited {code}: {self._tail()}")
        return {
            **counts,
            "finished": code is not None,
            "exit_code": code,
            "summary": self._tail(1) if code is not None else f"stopped at its deadline ({timeout:.0f} s)",
            "paths": self.paths,
        }

    def _tail(self, lines: int = 5) -> str:
        text = self.log.read_text(errors="replace") if self.log.is_file() else ""
        return " / ".join(text.strip().splitlines()[-lines:])[-600:]


def outcome_counts(path: Path) -> dict[str, Any]:
    """Tests, passed, failed, errors, skipped and the failing test ids from ``bench.pytest_outcomes``' lines."""
    counts: dict[str, Any] = {"tests": 0, "passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failures: list[str] = []
    lines = path.read_text().splitlines() if path.is_file() else []
    for line in lines:
        row = json.loads(line)
        counts["tests"] += 1
        counts[{"error": "errors"}.get(row["outcome"], row["outcome"])] += 1
        if row["outcome"] in ("failed", "error"):
            failures.append(row["id"])
    return {**counts, "failures": failures}


def build_items(device: str, plan: Plan, quick: bool, out: Path) -> list[Item]:
    """The run's items in order of importance (see the module docstring)."""
    variants = train_step.trainable_variants()
    items = [
        Item(f"train llama-1.3b {kind}", train_item("llama-1.3b", kind, device, plan, quick), 150) for kind in variants
    ]
    items[0].cap_s = 180  # the first compile
    focus, decode = cases(FOCUS_HARD, backward=False), cases((FOCUS_HARD_MAIN, DGA_CAUSAL))
    big = BIG_SHAPE
    items += [
        # right after the headline arms: the CUDA tests finish inside the default budget (docs/benchmarks.md)
        Item("tests", PytestRun(plan.tests, out), 300, min_s=30),
        Item("focus hard forward", forward_item(focus, plan.focus_lengths, device, plan, quick), 90),
        Item("decode", decode_item(decode, plan.decode_context, device, plan), 90),
        Item(f"focus hard forward {big}", forward_item(focus, plan.focus_lengths, device, plan, quick, big), 120),
        Item(f"decode {big}", decode_item(decode, plan.decode_context, device, plan, big), 90),
    ]
    if plan.shared_tests:
        items.append(Item("tests shared suite", PytestRun(plan.shared_tests, out, "tests-shared"), 240, min_s=30))
    # float8 beside bf16 (issue 49): the quick run's one rowwise arm runs the same code on the tiny model
    float8s = ("rowwise",) if quick else ("none", "rowwise", "tensorwise")
    items += [
        Item(
            f"train {FLOAT8_PRESET} full" + (f" float8 {recipe}" if recipe != "none" else ""),
            train_item(FLOAT8_PRESET, "full", device, plan, quick, recipe, plan.float8_steps),
            240,
        )
        for recipe in float8s
    ]
    small = ["full"] if quick else variants  # quick: its variants' arms are the 1.3b arms' code again
    items += [
        Item(f"train llama-124m {kind}", train_item("llama-124m", kind, device, plan, quick), 120) for kind in small
    ]
    for t in plan.matrix_lengths:
        items.append(Item(f"attention T={t}", forward_item(cases(), [t], device, plan, quick), 120))
        items.append(Item(f"attention T={t} {big}", forward_item(cases(), [t], device, plan, quick, big), 120))
    items.append(Item("attention decode", decode_item(cases(), plan.decode_context, device, plan), 120))
    items.append(Item(f"attention decode {big}", decode_item(cases(), plan.decode_context, device, plan, big), 120))
    long = cases((FOCUS_HARD_MAIN,))
    for t in plan.long_lengths:
        items.append(Item(f"focus hard long T={t}", forward_item(long, [t], device, plan, quick), 120))
        if not quick:  # quick: the same code as the other items at this shape, and the costliest on a CPU
            items.append(Item(f"focus hard long T={t} {big}", forward_item(long, [t], device, plan, quick, big), 120))
    return items


# ---- the run ---------------------------------------------------------------------------------------------------------
def kept(sofar: dict[str, Any]) -> str:
    """A note's tail on what a cut-off or failing item keeps: the rows it measured before."""
    rows = sum(len(v) for k, v in sofar.items() if k in ("forward", "decode"))
    if rows:
        return f"; kept the {rows} row{'s' if rows > 1 else ''} measured before"
    if "step_s" in sofar:
        return "; kept its timed steps (the profile was cut off)"
    return ""


def run_items(
    items: list[Item], report: dict[str, Any], out: Path, device: str, budget_s: float, overlap_tests: bool = False
) -> None:
    """Run the items in turn within ``budget_s`` seconds of the start, writing the report after each.
    ``overlap_tests``: start the pytest child first, beside the other items (the quick CPU run: on a loaded machine
    two processes get twice the share)."""
    start = time.perf_counter()
    deadline = start + budget_s
    previous = signal.signal(signal.SIGALRM, _alarm)
    children = [i.run for i in items if isinstance(i.run, PytestRun)]
    try:
        if overlap_tests:
            for child in children:
                child.start()
        for item in items:
            left = deadline - time.perf_counter()
            entry: dict[str, Any] = {"name": item.name}
            if left < item.min_s:
                entry.update(status="skipped", note=f"{max(left, 0):.0f} s of the budget left (needs {item.min_s:.0f})")
                report["items"].append(entry)
                continue
            limit = min(left, item.cap_s)
            print(f"[bench.gpu] {item.name} (up to {limit:.0f} s)", flush=True)
            t0, cpu0 = time.perf_counter(), time.process_time()
            sofar: dict[str, Any] = {}  # what the item has measured so far: reported if it is cut off or fails
            try:
                signal.setitimer(signal.ITIMER_REAL, limit)
                # the item's own deadline comes before the timer's, so that one which can stop early (the training
                # steps, pytest) stops with what it has measured instead of being cut off
                entry.update(status="ok", result=item.run(t0 + limit - min(0.1 * limit, 10.0), sofar))
            except Cutoff:
                signal.setitimer(signal.ITIMER_REAL, 0)
                why = "the budget" if limit < item.cap_s else f"its cap of {item.cap_s:.0f} s"
                entry.update(status="cut off", note=f"stopped at {limit:.0f} s ({why})" + kept(sofar))
            except Exception as err:  # report it and go on: one broken item must not lose the others
                signal.setitimer(signal.ITIMER_REAL, 0)
                lines = traceback.format_exception(err)
                first = f"{type(err).__name__}: {str(err).splitlines()[0][:160]}" if str(err) else type(err).__name__
                entry.update(status="error", note=first + kept(sofar), error="".join(lines)[-3000:])
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            if entry["status"] != "ok" and sofar:
                entry["result"] = sofar
            entry["seconds"] = time.perf_counter() - t0
            entry["cpu_seconds"] = time.process_time() - cpu0  # this process only (not a pytest child)
            report["items"].append(entry)
            train_step.release(torch.device(device))
            report["meta"]["elapsed_s"] = time.perf_counter() - start
            gpu_report.write(report, out)
        report["meta"]["finished"] = True
    finally:
        for child in children:
            child.stop()
        signal.signal(signal.SIGALRM, previous)
        report["meta"]["elapsed_s"] = time.perf_counter() - start
        report["meta"]["loadavg_end"] = " / ".join(f"{x:.2f}" for x in os.getloadavg())
        if "attention_meta" in report:
            report["attention_meta"]["loadavg_end"] = report["meta"]["loadavg_end"]
        gpu_report.write(report, out)


def _writable_out(out: Path) -> str:
    """'' when ``out`` is (or can be made) a directory this process writes into, else why not (one line)."""
    if out.exists() and not out.is_dir():
        return f"{out} is a file; name a directory for gpu_suite.json and gpu_suite.md"
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):  # the one sure test of a write (root ignores permission bits)
            pass
    except OSError as exc:
        return f"cannot write into {out} ({exc.strerror or exc})"
    return ""


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = OneLineParser(prog="python -m bench.gpu", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for gpu_suite.json and gpu_suite.md")
    parser.add_argument("--budget", type=float, default=540.0, help="seconds for the whole run (default 540)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--quick", action="store_true", help="tiny shapes, one CPU thread: the CI smoke run")
    parser.add_argument("--no-profile", action="store_true", help="leave out the torch.profiler profiles")
    parser.add_argument(
        "--only", default="", help="run only items whose name contains one of these comma-separated words"
    )
    args = parser.parse_args(argv)
    # every argument is checked before any work starts: a wasted GPU run is the cost of a typo found late
    if not math.isfinite(args.budget) or args.budget <= 0:
        parser.error(f"--budget: must be a finite number of seconds > 0, got {args.budget}")
    plan = QUICK_PLAN if args.quick else GPU_PLAN
    if args.no_profile:
        plan = dataclasses.replace(plan, profile_steps=0)
    every = build_items(args.device, plan, args.quick, args.out)
    words = [w.strip() for w in args.only.split(",") if w.strip()]
    if args.only and not words:
        parser.error(f"--only: {args.only!r} names no word")
    items = [i for i in every if any(w in i.name for w in words)] if words else every
    if not items:
        names = ", ".join(dict.fromkeys(i.name.split(" T=")[0] for i in every))
        parser.error(f"--only: {args.only!r} matches no item's name (items: {names})")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here (--device cpu --quick runs the suite on tiny shapes)")
    problem = _writable_out(args.out)
    if problem:
        parser.error(f"--out: {problem}")
    if args.device == "cpu" and args.quick:
        torch.set_num_threads(1)  # a CI machine is shared: one thread measures less noise than contended ones
    command = gpu_report.command_line(argv)
    env = gpu_report.environment(args.device, command)
    report: dict[str, Any] = {
        "meta": {**env, "device_kind": args.device, "quick": args.quick, "budget_s": args.budget, "plan": vars(plan)},
        "attention_meta": {
            "date": env["date"],
            "device": env["device"],
            "command": command,
            "dtype": str(attention_dtype(args.device)).removeprefix("torch."),
            "repeat": plan.repeat,
            "steps": plan.decode_steps,
            "loadavg_start": env["loadavg_start"],
            "loadavg_end": "-",
            "memory_method": "torch.cuda.max_memory_allocated growth during the call"
            if args.device == "cuda"
            else ("not measured (quick)" if args.quick else "peak RSS growth in a child process (bench.attention)"),
        },
        "items": [],
    }
    print(f"# bench.gpu on {env['device']}: {len(items)} items, budget {args.budget:.0f} s", flush=True)
    run_items(items, report, args.out, args.device, args.budget, overlap_tests=args.quick)
    print(f"wrote {args.out / 'gpu_suite.json'} and {args.out / 'gpu_suite.md'}", flush=True)
    return report


if __name__ == "__main__":
    main()
