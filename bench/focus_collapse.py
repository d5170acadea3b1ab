"""Group dominance: softmax assignment collapses, Sinkhorn stays balanced (Focus paper, tables 19 and 21).

Trains the tiny LLaMA with Focus (K = 8 groups, every weight trainable) on the same data once
per run (softmax assignment; Sinkhorn in the causal prefix scope; optionally Sinkhorn in the
paper's sequence scope), and prints the largest group's share of
tokens (argmax, mean over layers) every ``--every`` steps for each run, side by side.

    python -m bench.focus_collapse --data ../shared/data/english_novels --steps 300
"""

from __future__ import annotations

import argparse
import glob
import json
import sys
import tempfile
from pathlib import Path

from bench.reproduce import MEASUREMENT_RUN
from core.errors import cli_errors

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "english_novels"


RUNS = {  # label -> (assignment, sinkhorn_scope)
    "softmax": ("softmax", "prefix"),
    "sinkhorn": ("sinkhorn", "prefix"),  # the causal default
    "sinkhorn-sequence": ("sinkhorn", "sequence"),  # the paper's form (non-causal)
}


def run(label: str, args: argparse.Namespace, root: Path) -> dict[int, dict]:
    from pretrain.loop import Trainer
    from run.config import load_run_config

    assignment, scope = RUNS[label]
    overrides = [
        f"run.dir={root / label}",
        "model.preset=tiny",
        "model.attention.kind=focus",
        f"model.attention.focus.n_groups={args.groups}",
        f"model.attention.focus.assignment={assignment}",
        f"model.attention.focus.sinkhorn_scope={scope}",
        f"model.attention.focus.window={args.window}",
        "data.source=local",
        f"data.path={args.data}",
        f"data.seq_len={args.seq_len}",
        f"data.cache_dir={args.cache_dir or root / 'cache'}",
        f"train.max_steps={args.steps}",
        f"train.batch_size={args.batch_size}",
        "train.lr=3e-3",
        "train.warmup_steps=20",
        f"train.log_every={args.every}",
        f"train.seed={args.seed}",
        *MEASUREMENT_RUN,
    ]
    trainer = Trainer(load_run_config(None, overrides))
    trainer.setup()
    trainer.run()
    rows = {}
    for line in (root / label / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "attn/focus/max_group_share" in record:
            rows[record["step"]] = record
    return rows


@cli_errors
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--data",
        default=str(DEFAULT_DATA),
        help="text file, folder or glob (default: the novels corpus beside the repo)",
    )
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--every", type=int, default=50)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--window", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache-dir", default="")
    p.add_argument("--runs", default="softmax,sinkhorn", help=f"comma-separated, from {', '.join(RUNS)}")
    args = p.parse_args(argv)
    if not (Path(args.data).exists() or glob.glob(args.data)):
        print(f"--data: {args.data} does not exist; pass the novels corpus (or any text) with --data", file=sys.stderr)
        return 2
    labels = [x.strip() for x in args.runs.split(",") if x.strip()]
    bad = [x for x in labels if x not in RUNS]
    if bad or not labels:
        print(f"--runs: {','.join(bad) or 'empty'} not allowed; choose from {', '.join(RUNS)}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        results = {label: run(label, args, Path(tmp)) for label in labels}
    print(
        f"largest group's share of tokens (K = {args.groups}, uniform = {1 / args.groups:.1%}, argmax assignment, mean "
        "over layers); "
        f"tiny LLaMA, window {args.window}, batch {args.batch_size} x {args.seq_len}, every weight trainable"
    )
    print("| step | " + " | ".join(f"{label} max group | {label} confidence" for label in labels) + " |")
    print("|---:|" + "---:|---:|" * len(labels))
    for step in sorted(set().union(*results.values())):
        cells = []
        for label in labels:
            r = results[label].get(step, {})
            cells.append(
                f"{r.get('attn/focus/max_group_share', float('nan')):.1%} | "
                f"{r.get('attn/focus/confidence', float('nan')):.2f}"
            )
        print(f"| {step} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
