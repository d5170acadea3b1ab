"""``python -m launch.submit --config FILE --nodes N --gpus-per-node G [--dry-run]``

Renders ``launch/slurm/train.sbatch`` for a run config (validated first, with the same
``--set`` overrides as ``pretrain.train``) and submits it with ``sbatch``; ``--dry-run`` prints
the script instead. The rendered script is kept in the run directory beside what it trains.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from core import configlib
from core.errors import ConfigError, OneLineParser, cli_errors
from core.files import atomic_write_text

if TYPE_CHECKING:
    from run.config import RunConfig

TEMPLATE = Path(__file__).resolve().parent / "slurm" / "train.sbatch"
MARKER = "# --- launch.submit writes its settings here ---"
REPO = TEMPLATE.parents[2]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = OneLineParser(
        name_prog=False,
        prog="python -m launch.submit",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", required=True, help="TOML run config")
    configlib.add_set_argument(p, "dotted override, repeatable")
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument(
        "--gpus-per-node", type=int, required=True, help="GPUs per node; 0 runs on CPUs (see --procs-per-node)"
    )
    p.add_argument(
        "--procs-per-node",
        type=int,
        default=0,
        help="worker processes per node (default: --gpus-per-node, or 1 on CPUs)",
    )
    p.add_argument("--cpus-per-node", type=int, default=0, help="CPUs to request per node (0: the site's default)")
    p.add_argument("--partition", default="")
    p.add_argument("--account", default="")
    p.add_argument("--qos", default="")
    p.add_argument("--time", default="", help="time limit, e.g. 24:00:00")
    p.add_argument(
        "--signal-seconds", type=int, default=120, help="SIGUSR1 this long before the time limit (checkpoint, requeue)"
    )
    p.add_argument(
        "--sbatch-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra #SBATCH line, repeatable: --sbatch-arg=--exclusive",
    )
    p.add_argument("--python", default=sys.executable, help="the interpreter the job runs (default: this one)")
    p.add_argument("--dry-run", action="store_true", help="print the rendered script, submit nothing")
    return p.parse_args(argv)


def _check(args: argparse.Namespace, cfg: RunConfig) -> int:
    """Worker processes per node, after checking the layout against the config."""
    if args.nodes < 1:
        raise ConfigError(f"--nodes: must be >= 1, got {args.nodes}")
    if args.gpus_per_node < 0:
        raise ConfigError(f"--gpus-per-node: must be >= 0, got {args.gpus_per_node}")
    if args.procs_per_node < 0:
        raise ConfigError(f"--procs-per-node: must be >= 0, got {args.procs_per_node}")
    if args.gpus_per_node and args.procs_per_node and args.procs_per_node != args.gpus_per_node:
        raise ConfigError(
            f"--procs-per-node: {args.procs_per_node} differs from --gpus-per-node {args.gpus_per_node}; one process "
            "drives one GPU"
        )
    if args.signal_seconds < 1:
        raise ConfigError(f"--signal-seconds: must be >= 1, got {args.signal_seconds}")
    procs = args.gpus_per_node or args.procs_per_node or 1
    world = args.nodes * procs
    if world > 1 and cfg.train.engine == "single":
        raise ConfigError(
            f"train.engine: single runs one process, but {args.nodes} node(s) x {procs} make {world}; use ddp, fsdp2 "
            "or deepspeed"
        )
    from run.parallel import check_world

    check_world(cfg.train, world)  # dp x cp x tp = world and the batch splits over dp, else one line
    return procs


def render(args: argparse.Namespace, cfg: RunConfig, procs: int) -> str:
    run_dir = cfg.run_dir.resolve()
    directives = [
        f"--job-name={cfg.run.name or run_dir.name}",
        f"--nodes={args.nodes}",
        "--ntasks-per-node=1",  # one torchrun per node; it starts the workers
        *([f"--gpus-per-node={args.gpus_per_node}"] if args.gpus_per_node else []),
        *([f"--cpus-per-task={args.cpus_per_node}"] if args.cpus_per_node else []),
        *([f"--partition={args.partition}"] if args.partition else []),
        *([f"--account={args.account}"] if args.account else []),
        *([f"--qos={args.qos}"] if args.qos else []),
        *([f"--time={args.time}"] if args.time else []),
        f"--signal=USR1@{args.signal_seconds}",
        "--requeue",
        "--open-mode=append",
        f"--output={run_dir / 'slurm-%j.out'}",
        *args.sbatch_arg,
    ]
    train_args = ["--config", str(Path(args.config).resolve())]
    for item in args.overrides:
        train_args += ["--set", item]
    train_args += ["--set", f"run.dir={run_dir}"]  # the job starts elsewhere; a relative run.dir must not move
    settings = [
        MARKER,
        f"REPO_DIR={shlex.quote(str(REPO))}",
        f"PYTHON={shlex.quote(args.python)}",
        f"NPROC_PER_NODE={procs}",
        "TRAIN_ARGS=(" + " ".join(shlex.quote(a) for a in train_args) + ")",
    ]
    out, placed = [], False
    for line in TEMPLATE.read_text().splitlines():
        if line.startswith("#SBATCH"):
            if not placed:
                out += [
                    f'#SBATCH "{d}"' if " " in d else f"#SBATCH {d}" for d in directives
                ]  # sbatch reads double quotes
                placed = True
        elif line == MARKER:
            out += settings
        else:
            out.append(line)
    return "\n".join(out) + "\n"


@cli_errors
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        from run.config import load_run_config

        cfg = load_run_config(args.config, args.overrides)
        procs = _check(args, cfg)
        script = render(args, cfg, procs)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(script, end="")
        return 0
    run_dir = cfg.run_dir.resolve()
    path = run_dir / "slurm" / f"train-{time.strftime('%Y%m%d-%H%M%S')}.sbatch"
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, script)
    try:
        proc = subprocess.run(["sbatch", "--parsable", str(path)], capture_output=True, text=True)
    except FileNotFoundError:
        print(
            f"error: sbatch: not found on PATH (the script is at {path}; submit it on a SLURM login node)",
            file=sys.stderr,
        )
        return 2
    if proc.returncode:
        print(
            f"error: sbatch failed: {proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else proc.returncode}",
            file=sys.stderr,
        )
        return 1
    job = proc.stdout.strip().split(";")[0]
    print(f"submitted job {job}: {path}; output {run_dir / f'slurm-{job}.out'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
