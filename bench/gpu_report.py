"""The GPU suite's report (``bench.gpu``): the environment it ran in, the headline figures against the issue's
goals, every item's status and figures, and where the time goes (the items' ``torch.profiler`` profiles), as one
JSON document and one Markdown page. Items cut off by their timer report the rows they measured before."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from bench import attention as attn
from bench import profiling, train_step
from core.files import atomic_write_text

REPO = Path(__file__).resolve().parents[1]
FOCUS_ITEMS = ("focus hard forward", "focus hard forward llama-1.3b")  # the headline's attention items
DECODE_ITEMS = ("decode", "decode llama-1.3b")
TEST_ITEMS = ("tests", "tests shared suite")
MD_TOP = 5  # kernels per profile in the Markdown page (the JSON keeps the plan's profile_top)
HEADLINE_PRESET = "llama-1.3b"
MFU_GOAL = 0.40  # llama-1.3b full attention on an H100
STEP_RATIO_GOAL = 1.3  # trainable variants' step time / full's
FLOAT8_GOALS = {"rowwise": 1.2, "tensorwise": 1.25}  # float8 tokens/s / bf16's (issue 49, llama-2.7b at T = 4096)
FLOAT8_LOSS_GOAL = 0.01  # a float8 arm's loss after its steps / bf16's, less 1 (issue 49: 50 steps)
FOCUS_HARD_GOALS = {16384: 1.0, 65536: 0.5}  # Focus hard k=1 forward / full's; quick runs report their own lengths


def git_commit() -> str:
    """HEAD's hash, ``+dirty`` when the work tree has changes; ``unknown`` outside a git checkout (the device
    machine gets a copy of the work tree)."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return "unknown (no git checkout)"
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True, timeout=10)
        return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown (no git)"


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def environment(device: str, command: str) -> dict[str, Any]:
    """Device name, torch / CUDA / cuDNN versions, commit, command, date and machine load."""
    if device == "cuda":
        name = torch.cuda.get_device_name()
        props = torch.cuda.get_device_properties(0)
        memory = f"{props.total_memory / 2**30:.0f} GiB"
    else:
        name, memory = cpu_name(), f"{os.cpu_count()} cores"
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": name,
        "device_memory": memory,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "commit": git_commit(),
        "command": command,
        "loadavg_start": " / ".join(f"{x:.2f}" for x in os.getloadavg()),
    }


def _item(report: dict[str, Any], name: str) -> dict[str, Any] | None:
    item = next((i for i in report["items"] if i["name"] == name), None)
    return item if item and item["status"] == "ok" else None


def _measured(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Items with figures: those that finished, and those cut off (or failed) after measuring some rows."""
    return [i for i in report["items"] if i.get("result")]


def _rows(report: dict[str, Any], key: str, names: tuple[str, ...] | None = None) -> list[dict[str, Any]]:
    """Every measured item's ``key`` rows (``forward``, ``decode``), or those of the items named."""
    return [r for i in _measured(report) if names is None or i["name"] in names for r in i["result"].get(key, [])]


def _train(report: dict[str, Any]) -> list[dict[str, Any]]:
    return [i["result"] for i in _measured(report) if i["name"].startswith("train ") and "step_s" in i["result"]]


def shape_text(row: dict[str, Any], dtype: str) -> str:
    """An attention row's shape, as the headline states it: ``batch 2, 16 heads x 128 (llama-1.3b), bfloat16``."""
    return f"{attn.row_shape(row).text()}, {dtype}"


def float8_loss_headline(row: dict[str, Any], train: list[dict[str, Any]]) -> dict[str, Any] | None:
    """A float8 arm's final loss against the bf16 arm's after the same number of steps (issue 49: within 1%); None
    when there is no bf16 arm of as many steps."""
    total = row["warmup"] + row["steps"]
    bf16 = next(
        (
            r
            for r in train
            if (r["preset"], r["kind"], r.get("float8", "none")) == (row["preset"], row["kind"], "none")
            and r["warmup"] + r["steps"] == total
        ),
        None,
    )
    if bf16 is None:
        return None
    off = row["loss"] / bf16["loss"] - 1
    return {
        "what": f"{row['preset']} {row['kind']} float8 {row['float8']} loss / bf16's after {total} steps",
        "value": f"{off:+.2%} ({row['loss']:.4f} vs {bf16['loss']:.4f})",
        "goal": f"within {FLOAT8_LOSS_GOAL:.0%}",
        "met": abs(off) <= FLOAT8_LOSS_GOAL,
    }


def float8_headline(row: dict[str, Any], train: list[dict[str, Any]]) -> dict[str, Any]:
    """A float8 arm's headline row: its tokens/s / the bf16 arm's of the same preset and variant, against issue 49's
    goal (rowwise >= 1.2x, tensorwise >= 1.25x)."""
    speedup = train_step.float8_speedup(row, train)
    goal = FLOAT8_GOALS.get(row["float8"])
    return {
        "what": f"{row['preset']} {row['kind']} float8 {row['float8']} tokens/s / bf16's (T={row['seq_len']}, "
        f"{train_step.plan_text(row)})",
        "value": (f"{speedup:.2f}x" if speedup is not None else "- (no bf16 arm)")
        + f" ({row['tokens_per_s']:,.0f} tok/s)",
        "goal": f">= {goal}x on an H100 / H200" if goal else "",
        "met": (speedup >= goal) if goal and speedup is not None else None,
    }


def headline(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The figures the suite exists for, one row each: what, value, goal (text), met (bool or None)."""
    rows: list[dict[str, Any]] = []
    train = _train(report)
    for preset in dict.fromkeys(r["preset"] for r in train):
        bf16 = [r for r in train if r.get("float8", "none") == "none"]
        full = next((r for r in bf16 if r["preset"] == preset and r["kind"] == "full"), None)
        if full is None:
            continue
        goal = MFU_GOAL if preset == HEADLINE_PRESET else None
        known = full["mfu"] is not None
        rows.append(
            {
                "what": f"{preset} full attention MFU (T={full['seq_len']}, {train_step.plan_text(full)})",
                "value": (f"{full['mfu']:.1%}" if known else "- (device peak unknown)")
                + f" ({full['tokens_per_s']:,.0f} tok/s)",
                "goal": f">= {goal:.0%} on an H100" if goal else "",
                "met": (full["mfu"] >= goal) if goal and known else None,
            }
        )
        for r in train:
            if r["preset"] == preset and r.get("float8", "none") != "none":
                rows.append(float8_headline(r, train))
                loss = float8_loss_headline(r, train)
                if loss is not None:
                    rows.append(loss)
            if r["preset"] == preset and r["kind"] != "full" and r.get("float8", "none") == "none":
                ratio = train_step.time_ratio(r, full)
                rows.append(
                    {
                        "what": f"{preset} {r['kind']} step time / full's (per token; {train_step.plan_text(r)})",
                        "value": f"{ratio:.2f}x ({r['step_s'] * 1e3:.1f} ms)",
                        "goal": f"<= {STEP_RATIO_GOAL}x",
                        "met": ratio <= STEP_RATIO_GOAL,
                    }
                )
    dtype = report.get("attention_meta", {}).get("dtype", "")
    for r in _rows(report, "forward", tuple(FOCUS_ITEMS)):
        if r["kind"] == "focus" and r.get("fwd_ratio") is not None:
            goal = FOCUS_HARD_GOALS.get(r["T"])
            rows.append(
                {
                    "what": f"{r['case']} forward / full's at T={r['T']} ({shape_text(r, dtype)})",
                    "value": f"{r['fwd_ratio']:.2f}x ({r['fwd_s'] * 1e3:.2f} ms)",
                    "goal": f"<= {goal}x" if goal else "",
                    "met": r["fwd_ratio"] <= goal if goal else None,
                }
            )
    for r in _rows(report, "decode", tuple(DECODE_ITEMS)):
        rows.append(
            {
                "what": f"decode {r['case']} at context {r['context']} ({shape_text(r, dtype)})",
                "value": f"{r['ms_per_token']:.2f} ms/token ({r['time_ratio']:.2f}x full's)",
                "goal": "",
                "met": None,
            }
        )
    cuda = report["meta"]["device_kind"] == "cuda"
    for name in TEST_ITEMS:
        tests = _item(report, name)
        if tests:
            t = tests["result"]
            rows.append(
                {
                    "what": ("CUDA tests: " if cuda else "tests (no CUDA: skips): ") + ", ".join(t.get("paths", [])),
                    "value": f"{t['passed']} passed, {t['failed']} failed, {t['errors']} errors, {t['skipped']} skipped"
                    + ("" if t["finished"] else f" ({t['summary']}: incomplete)"),
                    "goal": "0 failed",
                    "met": t["failed"] + t["errors"] == 0 if t["finished"] else None,
                }
            )
    return rows


def profiles(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Every profile the items took (``bench.profiling``), labelled with its item, case and shape, in run order."""
    out: list[dict[str, Any]] = []
    dtype = report.get("attention_meta", {}).get("dtype", "")
    for item in _measured(report):
        result = item["result"]
        if "profile" in result:  # a training arm
            shape = f"T={result['seq_len']}, micro-batch {result['micro_batch']}, {result['precision']}"
            out.append({"item": item["name"], "case": result["kind"], "shape": shape, **result["profile"]})
        for r in result.get("forward", []):
            if "profile" in r:
                shape = f"T={r['T']}, {shape_text(r, dtype)}"
                out.append({"item": item["name"], "case": r["case"], "shape": shape, **r["profile"]})
        for r in result.get("decode", []):
            if "profile" in r:
                shape = f"context {r['context']}, {shape_text(r, dtype)}"
                out.append({"item": item["name"], "case": r["case"], "shape": shape, **r["profile"]})
    return out


def _met(met: bool | None) -> str:
    return "" if met is None else ("yes" if met else "**no**")


def markdown(report: dict[str, Any]) -> str:
    meta = report["meta"]
    lines = [
        f"# GPU suite: {meta['device']}",
        "",
        f"- Date: {meta['date']}; {'quick (tiny shapes) ' if meta['quick'] else ''}run on `{meta['device_kind']}`.",
        f"- Device: {meta['device']} ({meta['device_memory']}); torch {meta['torch']}, CUDA {meta['cuda']}, "
        f"cuDNN {meta['cudnn']}, Python {meta['python']}, {meta['threads']} CPU threads.",
        f"- Commit: `{meta['commit']}`.",
        f"- Command: `{meta['command']}`.",
        f"- Budget: {meta['budget_s']:.0f} s; elapsed {meta.get('elapsed_s', 0):.0f} s; "
        f"{'went through its list' if meta.get('finished') else 'in progress, or stopped'}: {_statuses(report)}. "
        f"Load average at the start {meta['loadavg_start']}.",
        "",
        "## Headline",
        "",
        "| figure | value | goal | met |",
        "|---|---|---|---|",
    ]
    lines += [f"| {h['what']} | {h['value']} | {h['goal']} | {_met(h['met'])} |" for h in report["headline"]]
    lines += ["", "## Items (in the order run)", "", "| item | status | seconds | note |", "|---|---|---:|---|"]
    for i in report["items"]:
        lines.append(f"| {i['name']} | {i['status']} | {i.get('seconds', 0):.1f} | {i.get('note', '')} |")
    train = _train(report)
    if train:
        rows = [dict(r) for r in train]
        for r in rows:
            recipe = r.get("float8", "none")
            same = [f for f in rows if f["preset"] == r["preset"] and f.get("float8", "none") == recipe]
            full = next((f for f in same if f["kind"] == "full"), None)
            r["step_ratio"] = train_step.time_ratio(r, full) if full else None
            r["float8_speedup"] = train_step.float8_speedup(r, rows)
        lines += [
            "",
            "## Training step (`bench.train_step`)",
            "",
            "MFU: tokens/s x full attention's FLOPs per token (torchtitan's 6 N + 12 L H D T, "
            "`model.counts.flops_per_token`) / the device's dense bf16 peak "
            f"({_peak_text(train[0]['peak_flops'])}), for every variant.",
            "",
            train_step.markdown(rows),
        ]
    fwd, dec = _rows(report, "forward"), _rows(report, "decode")
    if fwd or dec:
        skipped = [s for i in _measured(report) for s in i["result"].get("attention_skips", [])]
        attn_meta = {**report["attention_meta"], "skipped": skipped}
        lines += ["", "## Attention (`bench.attention`)", "", attn.markdown(attn_meta, fwd, dec)]
    if report.get("profiles"):
        lines += ["", profile_markdown(report["profiles"])]
    failures = [f for name in TEST_ITEMS if (t := _item(report, name)) for f in t["result"]["failures"]]
    if failures:
        lines += ["", "## Failing tests", ""] + [f"- `{f}`" for f in failures]
    errors = [i for i in report["items"] if i["status"] in ("error", "cut off")]
    if errors:
        lines += ["", "## Errors", ""]
        for i in errors:
            lines += [f"### {i['name']}", "", "```", i.get("error", i.get("note", "")), "```", ""]
    return "\n".join(lines).rstrip() + "\n"


def _n(x: float | None, spec: str = ".1f") -> str:
    return "n/a" if x is None else format(x, spec)


def _count(x: float | None) -> str:
    """A per-step count: whole where it is (``4``), else to a tenth (``0.5``: once in two steps); n/a for None."""
    if x is None:
        return "n/a"
    return f"{x:.0f}" if abs(x - round(x)) < 1e-9 else f"{x:.1f}"


def _cell(text: str, chars: int = 70) -> str:
    """A kernel name in a table cell: cut to ``chars``, pipes escaped."""
    text = text if len(text) <= chars else text[: chars - 3] + "..."
    return text.replace("|", "\\|")


def profile_markdown(rows: list[dict[str, Any]]) -> str:
    """The profiles: one summary row each, then each one's top kernels (CPU operators on CPU)."""
    cpu = all(r.get("activity") == "cpu" for r in rows if "error" not in r)
    lines = [
        "## Where the time goes (`torch.profiler`)",
        "",
        "Each item profiles a few more steps of what it has just timed (`bench.profiling`; how many: the steps"
        " column): training steps, an attention call (`fwd+bwd` where it was timed, else `fwd`), a decode token."
        " Per step: wall ms (the steps' ranges, profiler overhead included), device ms (the kernels'"
        " and copies' summed durations), kernels launched, launch API calls and host synchronisations (the CUDA"
        " calls that make the host wait: `cudaStreamSynchronize` behind every `.item()`, `bool(tensor)` or"
        " blocking copy, `cudaDeviceSynchronize`, `cudaEventSynchronize`, synchronous `cudaMemcpy`).",
    ]
    if cpu:
        lines += [
            "",
            "**On CPU (this run): no device.** The time column is the operators' self CPU time, the top rows are CPU "
            "operators, and kernels, launches and synchronisations are n/a (not zero: not measured).",
        ]
    busy = "ops' CPU ms" if cpu else "device ms"
    lines += [
        "",
        f"| item | case | shape | step | steps | wall ms | {busy} | kernels | launch calls | syncs | top (share) |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        head = f"| {r['item']} | {r['case']} | {r['shape']} | {r.get('what', '')} | {r.get('steps', 0)} |"
        if "error" in r:
            lines.append(f"{head} - | - | - | - | - | {_cell(r['error'], 120)} |")
            continue
        top = ", ".join(f"{_cell(k['name'], 60)} ({k['share']:.0%})" for k in r["top"][:2])
        lines.append(
            f"{head} {_n(r['wall_ms'], '.2f')} | {_n(r['busy_ms'], '.2f')} | {_count(r['kernels'])} | "
            f"{_count(r['launch_calls'])} | {_count(r['syncs'])} | {top} |"
        )
    detailed = [r for r in rows if r.get("top")]
    if detailed:
        what = "operators by self CPU time" if cpu else "kernels by device time"
        lines += [
            "",
            f"### Top {what}, per step (the {MD_TOP} largest of each profile; the JSON lists up to {profiling.TOP})",
            "",
            "| item | case | # | name | calls | ms | share |",
            "|---|---|---:|---|---:|---:|---:|",
        ]
        for r in detailed:
            for rank, k in enumerate(r["top"][:MD_TOP], 1):
                lines.append(
                    f"| {r['item']} | {r['case']} | {rank} | `{_cell(k['name'])}` | {_count(k['calls'])} | "
                    f"{k['ms']:.3f} | {k['share']:.1%} |"
                )
        syncs = [r for r in detailed if r.get("sync_calls")]
        if syncs:
            lines += ["", "Host synchronisations per step, by call:", ""]
            for r in syncs:
                calls = ", ".join(f"`{name}` {_count(n)}" for name, n in r["sync_calls"].items())
                lines.append(f"- {r['item']}, {r['case']}: {calls}")
    return "\n".join(lines)


def _statuses(report: dict[str, Any]) -> str:
    counts: dict[str, int] = {}
    for item in report["items"]:
        counts[item["status"]] = counts.get(item["status"], 0) + 1
    return ", ".join(f"{n} {status}" for status, n in counts.items()) or "no items yet"


def _peak_text(peak: float | None) -> str:
    return f"{peak / 1e12:.0f} TFLOP/s" if peak else "unknown here, so no MFU"


def write(report: dict[str, Any], out: Path) -> None:
    """Both files, atomically: a run cut off at any point leaves a complete report of what it measured."""
    import json

    report["headline"] = headline(report)
    report["profiles"] = profiles(report)
    atomic_write_text(out / "gpu_suite.json", json.dumps(report, indent=1, default=str) + "\n")
    atomic_write_text(out / "gpu_suite.md", markdown(report))


def command_line(argv: list[str] | None) -> str:
    import shlex

    return "python -m bench.gpu " + shlex.join(sys.argv[1:] if argv is None else argv)
