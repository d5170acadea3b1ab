"""The GPU suite's report (``bench.gpu``): the environment it ran in, the headline figures against the issue's
goals, and every item's status and figures, as one JSON document and one Markdown page."""

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
from bench import train_step
from core.files import atomic_write_text

REPO = Path(__file__).resolve().parents[1]
HEADLINE_PRESET = "llama-1.3b"
MFU_GOAL = 0.40  # llama-1.3b full attention on an H100
STEP_RATIO_GOAL = 1.3  # trainable variants' step time / full's
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


def headline(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The figures the suite exists for, one row each: what, value, goal (text), met (bool or None)."""
    rows: list[dict[str, Any]] = []
    train = [i["result"] for i in report["items"] if i["status"] == "ok" and i["name"].startswith("train ")]
    for preset in dict.fromkeys(r["preset"] for r in train):
        full = next((r for r in train if r["preset"] == preset and r["kind"] == "full"), None)
        if full is None:
            continue
        goal = MFU_GOAL if preset == HEADLINE_PRESET else None
        known = full["mfu"] is not None
        rows.append(
            {
                "what": f"{preset} full attention MFU (T={full['seq_len']})",
                "value": (f"{full['mfu']:.1%}" if known else "- (device peak unknown)")
                + f" ({full['tokens_per_s']:,.0f} tok/s)",
                "goal": f">= {goal:.0%} on an H100" if goal else "",
                "met": (full["mfu"] >= goal) if goal and known else None,
            }
        )
        for r in train:
            if r["preset"] == preset and r["kind"] != "full":
                ratio = r["step_s"] / full["step_s"]
                rows.append(
                    {
                        "what": f"{preset} {r['kind']} step time / full's",
                        "value": f"{ratio:.2f}x ({r['step_s'] * 1e3:.1f} ms)",
                        "goal": f"<= {STEP_RATIO_GOAL}x",
                        "met": ratio <= STEP_RATIO_GOAL,
                    }
                )
    focus = _item(report, "focus hard forward")
    for r in (focus or {}).get("result", {}).get("forward", []):
        if r["kind"] == "focus" and r.get("fwd_ratio") is not None:
            goal = FOCUS_HARD_GOALS.get(r["T"])
            rows.append(
                {
                    "what": f"{r['case']} forward / full's at T={r['T']}",
                    "value": f"{r['fwd_ratio']:.2f}x ({r['fwd_s'] * 1e3:.2f} ms)",
                    "goal": f"<= {goal}x" if goal else "",
                    "met": r["fwd_ratio"] <= goal if goal else None,
                }
            )
    decode = _item(report, "decode")
    for r in (decode or {}).get("result", {}).get("decode", []):
        rows.append(
            {
                "what": f"decode {r['case']} at context {r['context']}",
                "value": f"{r['ms_per_token']:.2f} ms/token ({r['time_ratio']:.2f}x full's)",
                "goal": "",
                "met": None,
            }
        )
    tests = _item(report, "tests")
    if tests:
        t = tests["result"]
        rows.append(
            {
                "what": "CUDA test suite" if report["meta"]["device_kind"] == "cuda" else "test suite (no CUDA: skips)",
                "value": f"{t['passed']} passed, {t['failed']} failed, {t['errors']} errors, {t['skipped']} skipped"
                + ("" if t["finished"] else f" ({t['summary']}: incomplete)"),
                "goal": "0 failed",
                "met": t["failed"] + t["errors"] == 0 if t["finished"] else None,
            }
        )
    return rows


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
    train = [i["result"] for i in report["items"] if i["status"] == "ok" and i["name"].startswith("train ")]
    if train:
        rows = [dict(r) for r in train]
        for r in rows:
            full = next((f for f in rows if f["preset"] == r["preset"] and f["kind"] == "full"), None)
            r["step_ratio"] = r["step_s"] / full["step_s"] if full else None
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
    fwd = [r for i in report["items"] if i["status"] == "ok" for r in i["result"].get("forward", [])]
    dec = [r for i in report["items"] if i["status"] == "ok" for r in i["result"].get("decode", [])]
    if fwd or dec:
        skipped = [s for i in report["items"] if i["status"] == "ok" for s in i["result"].get("attention_skips", [])]
        attn_meta = {**report["attention_meta"], "skipped": skipped}
        lines += ["", "## Attention (`bench.attention`)", "", attn.markdown(attn_meta, fwd, dec)]
    tests = _item(report, "tests")
    if tests and tests["result"]["failures"]:
        lines += ["", "## Failing tests", ""] + [f"- `{f}`" for f in tests["result"]["failures"]]
    errors = [i for i in report["items"] if i["status"] in ("error", "cut off")]
    if errors:
        lines += ["", "## Errors", ""]
        for i in errors:
            lines += [f"### {i['name']}", "", "```", i.get("error", i.get("note", "")), "```", ""]
    return "\n".join(lines).rstrip() + "\n"


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
    atomic_write_text(out / "gpu_suite.json", json.dumps(report, indent=1, default=str) + "\n")
    atomic_write_text(out / "gpu_suite.md", markdown(report))


def command_line(argv: list[str] | None) -> str:
    import shlex

    return "python -m bench.gpu " + shlex.join(sys.argv[1:] if argv is None else argv)
