"""``python -m launch.plan --config FILE --gpus N --gpu-memory 80GiB [--set k=v ...] [--emit PATH]``

The layout planner: for every layout a run config can take on N devices (``dp_replicate x dp_shard x cp x tp``, each
with activation checkpointing none / selective / full) the bytes one device holds at the largest micro-batch that
fits, which layouts fit, and the one it picks; ``--emit`` writes that layout as a launch config. The model is built
on the meta device from the config, so every parameter a variant adds is counted. The memory model and the choice
live in ``pretrain.layout_plan`` (``bench.train_step`` plans its arms with them); see docs/planner.md for what is
exact and what is estimated.

- Parameters, gradients, optimizer state: EXACT, the arithmetic of the sharded state (TP's and FSDP2's chunks).
- Activations: ESTIMATED from the architecture and the attention core's ``saved_activation_bytes`` hook.
- Working memory: ESTIMATED (FSDP2's gathered parameters, the LM head's transients, unsharded gradients while
  accumulating micro-batches), plus ``--reserve`` of the device for the CUDA context, NCCL and fragmentation.

The pick: among the layouts that fit, the least model parallelism (cp x tp), then the least recomputation (none,
selective, full), then the largest micro-batch (one that divides the replica's share of train.batch_size), then the
largest margin.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from core import configlib
from core.errors import ConfigError, OneLineParser, cli_errors
from core.files import atomic_write_text
from pretrain.layout_plan import (  # the memory model's names are read through this module too (its tests)
    Estimate,
    ParamInfo,
    activation_bytes,
    meta_model,
    pick,
    plan,
    state_bytes,
    table_state_bytes,
)
from run.parallel import check_world_size
from run.sizes import GIB, check_parameters_fit

if TYPE_CHECKING:
    from run.config import RunConfig

__all__ = ["ParamInfo", "activation_bytes", "meta_model", "state_bytes", "table_state_bytes"]
_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_UNITS |= {"kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


def parse_bytes(text: str, key: str = "--gpu-memory") -> int:
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if match is None or match.group(2).lower() not in _UNITS:
        raise ConfigError(f"{key}: {text!r} is not a size (e.g. 80GiB, 141GB, 81920MiB)")
    value = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if value <= 0:
        raise ConfigError(f"{key}: must be > 0, got {text!r}")
    return value


def _gib(n: int) -> str:
    return f"{n / GIB:8.2f}"


def report(estimates: list[Estimate], chosen: Estimate | None, cfg: RunConfig, gpus: int, memory: int) -> str:
    head = (
        f"{cfg.model.preset or 'model'} ({cfg.model.attention.kind}), seq_len {cfg.data.seq_len}, batch "
        f"{cfg.train.batch_size}, {gpus} devices of {memory / GIB:.1f} GiB "
        f"(usable {estimates[0].capacity / GIB:.1f} GiB after the reserve)"
        if estimates
        else ""
    )
    lines = [
        head,
        "layout = dp_replicate x dp_shard x cp x tp; GiB per device "
        "(params, grads, optimizer exact; the rest estimated)",
        f"{'layout':>12} {'ac':>9} {'micro':>5} {'params':>8} {'grads':>8} {'optim':>8} {'activ':>8} {'working':>8} "
        f"{'total':>8}  fits",
    ]
    for e in estimates:
        s = e.state
        mark = " <- picked" if e is chosen else ""
        lines.append(
            f"{e.layout.label():>12} {e.ac:>9} {e.micro:>5} {_gib(s.parameters)} {_gib(s.gradients)} "
            f"{_gib(s.optimizer)} {_gib(e.activations)} {_gib(e.working)} {_gib(e.total)}  "
            f"{'yes' if e.fits else 'no '}{mark}"
        )
    if chosen is not None:
        lay = chosen.layout
        lines.append(
            f"picked {lay.label()} (dp_replicate {lay.dp_replicate}, dp_shard {lay.dp_shard}, cp {lay.cp}, "
            f"tp {lay.tp}), "
            f"activation checkpointing {chosen.ac}, micro-batch {chosen.micro}: {chosen.total / GIB:.2f} GiB of "
            f"{chosen.capacity / GIB:.2f} usable ({chosen.margin / GIB:.2f} GiB margin); the rule: the least model "
            "parallelism (cp x tp), then the least recomputation, then the largest micro-batch"
        )
    return "\n".join(lines)


def breakdown(e: Estimate) -> str:
    """Why a layout fits, in one line."""
    s = e.state
    return (
        f"per device: parameters {s.parameters / GIB:.2f} GiB, gradients {s.gradients / GIB:.2f}, optimizer "
        f"{s.optimizer / GIB:.2f} (exact); activations {e.activations / GIB:.2f}, working {e.working / GIB:.2f} "
        f"(estimated); total {e.total / GIB:.2f} of {e.capacity / GIB:.2f} GiB usable"
    )


def emitted_config(raw: dict, chosen: Estimate) -> dict:
    """The run config ``raw`` (overrides applied) set to the chosen layout."""
    lay = chosen.layout
    train = raw.setdefault("train", {})
    train["engine"] = "fsdp2"
    train["activation_checkpointing"] = chosen.ac
    train["micro_batch_size"] = chosen.micro
    train.setdefault("fsdp2", {})["replicate"] = lay.dp_replicate
    if lay.model_parallel > 1:
        train["compile"] = False  # not supported with tp / cp > 1 yet (run.parallel.check_layout)
        train.setdefault("parallel", {}).update(tp=lay.tp, cp=lay.cp)  # the config's sequence_parallel stays
    else:
        train.pop("parallel", None)
    return raw


# ---- the command --------------------------------------------------------------------------------

MAX_DEVICE_MEMORY = 1 << 50


def check_emit_path(path: Path) -> None:
    """``--emit``'s file can be written: its folder exists and is writable, and it is not a folder itself."""
    import os

    folder = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise ConfigError(f"--emit: {path} is a directory; name the .toml file to write")
    if not folder.is_dir():
        raise ConfigError(f"--emit: the folder {folder} does not exist (create it, or name a file in one that does)")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ConfigError(f"--emit: the folder {folder} is not writable")


@cli_errors
def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(
        name_prog=False,
        prog="python -m launch.plan",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", required=True, help="TOML run config")
    configlib.add_set_argument(p, "dotted override, repeatable")
    p.add_argument("--gpus", type=int, required=True, help="devices in the job")
    p.add_argument("--gpu-memory", required=True, help="memory of one device, e.g. 80GiB")
    p.add_argument("--gpus-per-node", type=int, default=8, help="tensor parallelism stays within a node (default 8)")
    p.add_argument("--reserve", type=float, default=0.1, help="fraction of a device kept free (default 0.1)")
    p.add_argument("--emit", default="", help="write the picked layout as a launch config here")
    args = p.parse_args(argv)
    try:
        from run.config import load_run_config, raw_run_config

        check_world_size(args.gpus, "--gpus")
        check_world_size(args.gpus_per_node, "--gpus-per-node")
        if not 0 <= args.reserve < 1:
            raise ConfigError(f"--reserve: must be in [0, 1), got {args.reserve}")
        memory = parse_bytes(args.gpu_memory)
        if memory > MAX_DEVICE_MEMORY:
            raise ConfigError(f"--gpu-memory: {args.gpu_memory} is beyond 1 PiB (a sane upper bound for one device)")
        if args.emit:
            check_emit_path(Path(args.emit))
        cfg = load_run_config(args.config, args.overrides)
        if cfg.train.engine not in ("fsdp2",):
            raise ConfigError(
                f"train.engine: the planner plans fsdp2 layouts; got {cfg.train.engine} (--set train.engine=fsdp2)"
            )
        # a model whose float32 parameters exceed every device together fits no layout: said before it is built
        usable = int(memory * (1 - args.reserve))
        check_parameters_fit(cfg.model, usable * args.gpus, f"--gpus {args.gpus:,} x {usable / GIB:.1f} GiB usable")
        estimates = plan(cfg, args.gpus, memory, gpus_per_node=args.gpus_per_node, reserve=args.reserve)
        if not estimates:
            raise ConfigError(
                f"--gpus: no layout of {args.gpus} devices suits the config (train.batch_size, data.seq_len, heads)"
            )
        chosen = pick(estimates)
        print(report(estimates, chosen, cfg, args.gpus, memory))
        if chosen is None:  # the table says what each layout needs; the exit status says that none fits
            raise ConfigError(
                f"--gpus: no layout of {args.gpus} x {args.gpu_memory} fits, even at micro-batch 1: raise --gpus or "
                f"--gpu-memory, or lower data.seq_len{' (nothing written to --emit)' if args.emit else ''}"
            )
        if args.emit:
            raw = raw_run_config(args.config)
            for assignment in args.overrides:
                configlib.apply_override(raw, assignment)
            text = configlib.dump_toml(emitted_config(raw, chosen))
            header = [
                f"# Written by python -m launch.plan --gpus {args.gpus} --gpu-memory {args.gpu_memory} "
                f"from {args.config}",
                *(f"#   --set {o}" for o in args.overrides),
                f"# {report([chosen], chosen, cfg, args.gpus, memory).splitlines()[-1]}",
                f"# {breakdown(chosen)}",
                f"#   python -m launch.submit --config {args.emit} --nodes {max(1, args.gpus // args.gpus_per_node)} "
                f"--gpus-per-node {min(args.gpus, args.gpus_per_node)}",
            ]
            try:
                atomic_write_text(Path(args.emit), "\n".join(header) + "\n" + text)
            except OSError as exc:  # the checks above passed, the file system still said no (full, read-only)
                raise ConfigError(f"--emit: cannot write {args.emit} ({exc.strerror or exc})") from None
            print(f"wrote {args.emit}")
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
