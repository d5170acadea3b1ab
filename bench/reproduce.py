"""The five papers' claims at tiny scale, in one command.

    python -m bench.reproduce [--quick | --context] [--only NAME[,NAME]] [--data DIR] [--out docs/reproduce.md]

Trains every arm a claim needs (full attention once per seed, shared by every claim that compares
against it; Focus, Lazy, Focal, DGA and a local-window-only baseline) through the project's trainer
with the same shape, data, token budget and seeds, evaluates each checkpoint through the project's
evaluation code, and writes a table (claim, the paper's figure and its source, our figure, verdict)
to ``--out`` with JSON and plots in the folder beside it (``docs/reproduce/``).

Claim groups (``--only``): focus, lazy, focal, dga, prescored_hyper. Three tiers (budgets), each
sized for 2 CPU cores: the default one trains at 128 tokens (Focus window 32, DGA chunk 32; under 30
minutes, report in docs/reproduce.md), ``--quick`` is a smaller model and fewer steps for a few
minutes (report under runs/reproduce_quick/, not over the committed one), and ``--context`` trains at
512 tokens with the papers' settings at that length (Focus window 128, Lazy evaluated from 512 to 2048
tokens, DGA chunk 128 and group 16; about 45 minutes, report in docs/reproduce_context.md).
Data: a folder of ``.txt`` files (default: the novels corpus at ``../shared/data/english_novels``
beside the repository); the first files by name, up to a byte budget, are used.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import multiprocessing
import os
import resource
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

from core.errors import cli_errors

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA = REPO.parent / "shared" / "data" / "english_novels"
DEFAULT_OUT = REPO / "docs" / "reproduce.md"

GROUPS = ("focus", "lazy", "focal", "dga", "prescored_hyper")  # the claim groups (--only)


def group_arms(group: str, budget: dict) -> dict[str, list[str]]:
    """label -> the evaluations it runs for ``group`` (val loss always runs): the arms the group's claims need."""
    from bench.reproduce_arms import window_label

    needs: dict[str, dict[str, list[str]]] = {
        "focus": {
            "full": [],
            "local_window": [],
            "focus": ["groups"],
            "focus_softmax": ["groups"],
            "focus_k2": [],
            "focus_k4": ["topk"],
            **{window_label(w): [] for w in budget["focus_windows"]},
        },
        "lazy": {"full": ["attn_stats", "length"], "lazy": ["attn_stats", "length"]},
        "focal": {"full": [], "focal_t0.4": [], "focal_learned": []},
        "dga": {"full": ["kv_cache"], "dga": ["kv_cache"], "dga_g0.5": []},
        "prescored_hyper": {"full": ["prescored"]},
    }
    return needs[group]


_SHAPE = dict(n_layers=2, vocab_size=2048, seq_len=128, lr=3e-3, rope_theta=500000.0)
_PRESCORED = {"min_keys": 8, "block_size": 16, "sample_size": 16, "min_seq_len": 32, "lsh_bits": 4}
# focus_window (the local-window baseline's too), focus_windows (the window ablation's pair), dga_chunk, dga_group:
# the lengths the arms are configured with (bench.reproduce_arms.arms)
_FULL = dict(
    _SHAPE, name="full", d_model=128, n_heads=4, d_ff=344, batch_size=8, steps=400, warmup_steps=40, seeds=[0, 1],
    data_bytes=8_000_000, val_windows=64, log_every=40, length_multiples=[1, 2, 4], length_tokens=8192,
    kv_multiples=[1, 4, 16], prescored_windows=16,
    prescored={"scorings": ["kmeans", "kmedian", "leverage"], "top_k": [16, 32, 64, 96], "options": _PRESCORED},
    prescored_claim_top_k=64, focus_window=32, focus_windows=[16, 64], dga_chunk=32, dga_group=8,
)  # fmt: skip
# --quick: a smaller model, fewer steps and less data; the rest as the full run
_QUICK = dict(
    _FULL, name="quick", d_model=64, n_heads=2, d_ff=172, steps=60, warmup_steps=10, data_bytes=3_000_000,
    val_windows=32, log_every=10, length_tokens=4096, prescored_windows=8,
)  # fmt: skip
# --context: trained at 512 tokens, the papers' settings at that length: Focus's window 128 (tables 16 / 25; the
# ablation w = 64 vs 256, appendix C), Lazy evaluated from 512 to 2048 (figure 6), DGA's C = 128 and m = 16 (table 4),
# pre-scored HyperAttention's keys and blocks scaled with T. The model is the default tier's, so only the length and
# the papers' settings differ; the time goes to tokens: 800 x 4 x 512 = 1,638,400 per arm (4x the default tier's,
# under one epoch of the 2.2M training tokens).
# Sizing, measured (2026-11-26, 2-core AMD EPYC, torch 2.13 CPU, 2 workers x 1 thread, otherwise idle; every arm, one
# seed, 100 steps of 4 x 512, logging every 25): s/step focus 0.25-0.27 (the six Focus arms), lazy 0.30, full 0.23,
# dga 0.23-0.24, focal 0.21-0.23, local window 0.22: 3.22 s for one step of all 13 arms; evaluations 70 s per seed
# (full's pre-scored sweep, length and KV cache 27 s, Focus K = 4's top-k 12, lazy 10, dga 8, the others 1-2).
# 2 seeds on 2 workers: wall ~ 3.22 s x steps + 70 s + about 60 s (start, setup per arm, the last arm alone,
# report) = 2576 + 130 s for 800 steps: about 45 minutes, under the 60-minute target with room for a slower machine.
_CONTEXT: dict[str, Any] = dict(
    _FULL, name="context", seq_len=512, batch_size=4, steps=800, warmup_steps=80, log_every=80,
    length_tokens=32768, kv_multiples=[1, 4, 16],
    prescored={
        "scorings": ["kmeans", "kmedian", "leverage"], "top_k": [64, 128, 256, 384],
        "options": {"min_keys": 32, "block_size": 64, "sample_size": 64, "min_seq_len": 128, "lsh_bits": 4},
    },
    prescored_claim_top_k=256, focus_window=128, focus_windows=[64, 256], dga_chunk=128, dga_group=16,
)  # fmt: skip
_CONTEXT["about"] = (
    f"the context tier (`--context`): trained at {_CONTEXT['seq_len']} tokens with the papers' settings at that "
    f"length (Focus window {_CONTEXT['focus_window']}, Lazy evaluated from 1x to "
    f"{_CONTEXT['length_multiples'][-1]}x the training length, DGA chunk {_CONTEXT['dga_chunk']} and group "
    f"{_CONTEXT['dga_group']}); the default tier, at {_FULL['seq_len']} tokens, is reported in docs/reproduce.md"
)
BUDGETS: dict[str, dict[str, Any]] = {"full": _FULL, "quick": _QUICK, "context": _CONTEXT}
# --quick is a smoke run: its report goes under runs/ (ignored by git), never over a committed measured report
DEFAULT_OUTS = {
    "full": DEFAULT_OUT,
    "quick": REPO / "runs" / "reproduce_quick" / "reproduce.md",
    "context": REPO / "docs" / "reproduce_context.md",
}

# a run trained only to be measured: no periodic checkpoints (one kept) or evaluation, no loggers
MEASUREMENT_RUN = [
    "checkpoint.every=0",
    "checkpoint.keep=1",
    "eval.every=0",
    "eval.batches=2",
    "log.tensorboard=false",
    "log.wandb=disabled",
    "log.console=false",
]


def common_overrides(budget: dict, data_path: Path, cache_dir: str) -> list[str]:
    b = budget
    out = [
        "model.preset=tiny",
        f"model.d_model={b['d_model']}",
        f"model.n_layers={b['n_layers']}",
        f"model.n_heads={b['n_heads']}",
        f"model.d_ff={b['d_ff']}",
        f"model.vocab_size={b['vocab_size']}",
        f"model.max_seq_len={b['seq_len']}",
        f"model.rope.theta={b['rope_theta']}",
        "data.source=local",
        f"data.path={data_path}",
        f"data.seq_len={b['seq_len']}",
        f"train.max_steps={b['steps']}",
        f"train.batch_size={b['batch_size']}",
        f"train.lr={b['lr']}",
        f"train.warmup_steps={b['warmup_steps']}",
        "train.min_lr_ratio=0.1",
        "train.weight_decay=0.1",
        "train.grad_clip=1.0",
        f"train.log_every={b['log_every']}",
        *MEASUREMENT_RUN,
    ]
    return out + ([f"data.cache_dir={cache_dir}"] if cache_dir else [])


def select_files(data: Path, max_bytes: int) -> list[Path]:
    """``data`` itself (a file), or the first ``.txt`` files of the folder by name up to ``max_bytes`` (at least 2)."""
    if data.is_file():
        return [data]
    files = sorted(p for p in data.rglob("*.txt") if p.is_file())
    chosen: list[Path] = []
    for path in files:
        if len(chosen) >= 2 and sum(p.stat().st_size for p in chosen) >= max_bytes:
            break
        chosen.append(path)
    return chosen


def link_subset(files: list[Path], root: Path, folder: Path) -> Path:
    """A folder of links to ``files`` (names relative to ``root``, so document ids and the token cache stay stable)."""
    folder.mkdir(parents=True, exist_ok=True)
    for path in files:
        name = path.name if path == root else str(path.relative_to(root)).replace(os.sep, "__")
        target = folder / name
        try:
            target.symlink_to(path.resolve())
        except OSError:  # no symlinks here: copy
            target.write_bytes(path.read_bytes())
    return folder


def plan(groups: list[str], budget: dict) -> list[dict]:
    """One job per (arm, seed), the evaluations merged over the selected groups; costliest first."""
    from bench.reproduce_arms import arms

    costs = {label: arm[2] for label, arm in arms(budget).items()}
    evals: dict[str, set[str]] = {}
    for group in groups:
        for label, needed in group_arms(group, budget).items():
            evals.setdefault(label, set()).update(needed)
    jobs = [
        {"label": label, "seed": seed, "evals": sorted(evals[label]), "cost": costs[label] + 0.5 * len(evals[label])}
        for label in evals
        for seed in budget["seeds"]
    ]
    return sorted(jobs, key=lambda j: (-j["cost"], j["seed"], j["label"]))


def cpu_line(jobs: int, threads: int) -> str:
    import torch

    from bench.data_throughput import cpu_name

    return (
        f"{cpu_name()}, {os.cpu_count()} cores, torch {torch.__version__}, {jobs} worker process(es) x "
        f"{threads} thread(s); no GPU used"
    )


def cpu_seconds() -> float:
    """User + system CPU time of this process and its finished children (the workers, once the pool is shut)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def git_version() -> str:
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=REPO, capture_output=True, text=True)
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def run_jobs(jobs: list[dict], n_workers: int, say: Callable[[str], None]) -> list[dict]:
    from bench.reproduce_arms import run_arm

    done: list[dict] = []

    def report(result: dict) -> None:
        done.append(result)
        what = (
            f"error: {result['error']}"
            if "error" in result
            else f"val loss {result['val_loss']:.4f} (train {result['train_seconds']:.0f} s, "
            f"eval {result['eval_seconds']:.0f} s)"
        )
        say(f"[{len(done)}/{len(jobs)}] {result['label']} seed {result['seed']}: {what}")

    if n_workers <= 1:
        for job in jobs:
            report(run_arm(job))
        return done
    with ProcessPoolExecutor(max_workers=n_workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(run_arm, job) for job in jobs]
        for future in as_completed(futures):
            report(future.result())
    return done


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.reproduce", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smaller model and fewer steps (a few minutes)")
    p.add_argument(
        "--context", action="store_true", help="train at 512 tokens with the papers' settings (about 45 minutes)"
    )
    p.add_argument("--only", default="", help=f"comma-separated claim groups: {', '.join(GROUPS)}")
    p.add_argument("--data", default="", help="a folder of .txt files or one file (default: the novels corpus)")
    p.add_argument(
        "--out",
        default="",
        help="markdown report; JSON and plots go in the folder beside it (default: docs/reproduce.md, "
        "docs/reproduce_context.md with --context, runs/reproduce_quick/reproduce.md with --quick)",
    )
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="arms trained at once")
    p.add_argument("--threads", type=int, default=1, help="torch threads per arm")
    p.add_argument("--cache-dir", default="", help="data cache (tokenizer, tokens); default the project's")
    p.add_argument("--keep-runs", default="", help="keep the arms' run directories here (default: a temp dir)")
    return p.parse_args(argv)


@cli_errors
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started, load_start = time.perf_counter(), os.getloadavg()
    if args.quick and args.context:
        print("error: --context: not with --quick (each is a tier of its own; choose one)", file=sys.stderr)
        return 2
    tier = "context" if args.context else "quick" if args.quick else "full"
    groups = [g.strip() for g in args.only.split(",") if g.strip()] or list(GROUPS)
    unknown = [g for g in groups if g not in GROUPS]
    if unknown:
        print(f"error: --only: {', '.join(unknown)} unknown; choose from {', '.join(GROUPS)}", file=sys.stderr)
        return 2
    data = Path(args.data) if args.data else DEFAULT_DATA
    if not data.exists():
        hint = "the default novels corpus" if not args.data else "--data"
        print(
            f"error: --data: {data} ({hint}) does not exist; pass a folder of .txt files with --data DIR",
            file=sys.stderr,
        )
        return 2
    budget = BUDGETS[tier]
    files = select_files(data, budget["data_bytes"])
    if not files:
        print(
            f"error: --data: {data} holds no .txt files; pass a folder of .txt files with --data DIR", file=sys.stderr
        )
        return 2

    from bench import reproduce_arms
    from bench.reproduce_report import write_report

    with tempfile.TemporaryDirectory(prefix="reproduce-") as tmp:
        root = Path(args.keep_runs) if args.keep_runs else Path(tmp)
        subset = link_subset(files, data if data.is_dir() else data.parent, Path(tmp) / "data")
        common = common_overrides(budget, subset, args.cache_dir)
        corpus = prepare_corpus(common)
        jobs = plan(groups, budget)
        for job in jobs:
            run_dir = root / f"{job['label']}-seed{job['seed']}"
            job.update(
                run_dir=str(run_dir),
                overrides=reproduce_arms.arm_overrides(job["label"], budget, common, run_dir, job["seed"]),
                budget=budget,
                threads=args.threads,
            )
        print(
            f"reproduce: {len(jobs)} arm runs ({', '.join(groups)}), {budget['steps']} steps x "
            f"{budget['batch_size']} x {budget['seq_len']} tokens each, seeds {budget['seeds']}, {args.jobs} at once",
            flush=True,
        )
        raw = run_jobs(jobs, args.jobs, lambda line: print(line, flush=True))
    results: dict[str, list[dict]] = {}
    for r in sorted(raw, key=lambda r: (r["label"], r["seed"])):
        results.setdefault(r["label"], []).append(r)
    command = "python -m bench.reproduce" + "".join(
        f" {shlex.quote(a)}" for a in (sys.argv[1:] if argv is None else argv)
    )
    meta = {
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": command,
        "device": cpu_line(args.jobs, args.threads),
        "load_average_start": [round(x, 2) for x in load_start],
        "load_average_end": [round(x, 2) for x in os.getloadavg()],
        "wall_seconds": time.perf_counter() - started,
        "cpu_seconds": cpu_seconds(),
        "code_version": git_version(),
        "groups": groups,
        "jobs": args.jobs,
        "data": {
            "path": str(data),
            "files": [f.name for f in files],
            "bytes": sum(f.stat().st_size for f in files),
            "sha256_of_names": hashlib.sha256("|".join(f.name for f in files).encode()).hexdigest()[:12],
            **corpus,
        },
    }
    out = Path(args.out) if args.out else DEFAULT_OUTS[tier]
    write_report(out, meta, budget, groups, results)
    print(f"reproduce: {out} written in {meta['wall_seconds'] / 60:.1f} min", flush=True)
    failed = sorted({f"{r['label']} seed {r['seed']}" for r in raw if "error" in r})
    if failed:
        print(
            f"error: {len(failed)} arm run(s) failed ({', '.join(failed)}); their claims say 'not measured'",
            file=sys.stderr,
        )
        return 1
    return 0


def prepare_corpus(common: list[str]) -> dict:
    """Tokenise once, before the workers start (they then read the cache), and return the split sizes."""
    from bench.reproduce_arms import corpus_for
    from run.config import load_run_config

    corpus = corpus_for(load_run_config(None, [*common, "run.dir=unused"]))
    assert corpus.train is not None and corpus.val is not None  # a prepared corpus has both splits
    return {"train_tokens": int(len(corpus.train.tokens)), "val_tokens": int(len(corpus.val.tokens))}


if __name__ == "__main__":
    sys.exit(main())
