"""``python -m launch.plan --config FILE --gpus N --gpu-memory 80GiB [--set k=v ...] [--emit PATH]``

The layout planner: for every layout a run config can take on N devices (``dp_replicate x dp_shard x cp x tp``, each
with activation checkpointing none / selective / full) the bytes one device holds, which layouts fit, and the one it
picks; ``--emit`` writes that layout as a launch config. The model is built on the meta device from the config, so
every parameter a variant adds is counted. See docs/planner.md for the model, what is exact and what is estimated.

- Parameters, gradients, optimizer state: EXACT, the arithmetic of the sharded state. Tensor parallelism splits a
  parameter's dimension as ``apply_tp`` does (``tp_shard_dims``: torch.chunk sizes); FSDP2 then splits dim 0 of
  each rank's local tensor over ``dp_shard x cp`` (``torch.chunk``) and stores each shard padded to the first
  chunk's rows (``FSDPParam._init_sharded_param``); a group's sharded gradients are views of one reduce-scatter
  output of the padded sizes. The engine keeps float32 parameters and gradients (bf16 is FSDP2's compute copy);
  AdamW keeps exp_avg and exp_avg_sq like each rank's unpadded shard, and a float32 step per parameter.
- Activations: ESTIMATED from the architecture (per layer: norms, projections, the MLP, and the attention core's
  own ``Attention.saved_activation_bytes`` hook), the bytes autograd saves for the backward.
- Working memory: ESTIMATED (FSDP2's gathered parameters, the logits' transients, unsharded gradients while
  accumulating micro-batches), plus ``--reserve`` of the device for the CUDA context, NCCL and fragmentation.

The pick: among the layouts that fit, the least model parallelism (cp x tp), then the least recomputation (none,
selective, full), then the largest margin.
"""

from __future__ import annotations

import argparse
import functools
import math
import re
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from core import configlib
from core.errors import ConfigError, OneLineParser, cli_errors
from core.files import atomic_write_text
from run.parallel import ParallelLayout

if TYPE_CHECKING:
    from torch import nn

    from model.transformer import Transformer
    from run.config import RunConfig

AC_MODES = ("none", "selective", "full")
_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_UNITS |= {"kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
GIB = 1 << 30


def parse_bytes(text: str, key: str = "--gpu-memory") -> int:
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if match is None or match.group(2).lower() not in _UNITS:
        raise ConfigError(f"{key}: {text!r} is not a size (e.g. 80GiB, 141GB, 81920MiB)")
    value = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if value <= 0:
        raise ConfigError(f"{key}: must be > 0, got {text!r}")
    return value


def _chunk(size: int, parts: int, index: int) -> int:
    """torch.chunk's size of chunk ``index`` (DTensor's Shard and FSDP2 both split this way)."""
    step = math.ceil(size / parts)
    return max(0, min(step, size - index * step))


@dataclass(frozen=True)
class StateBytes:
    parameters: int
    gradients: int
    optimizer: int
    accumulation: int  # unsharded float32 gradients FSDP2 holds between micro-batches without gradient sync


@dataclass(frozen=True)
class ParamInfo:
    name: str
    shape: tuple[int, ...]
    element_size: int
    requires_grad: bool
    tp_dim: int | None  # the dimension tensor parallelism splits (None: replicated)


@functools.lru_cache(maxsize=4)
def param_table(model: Transformer) -> tuple[ParamInfo, ...]:
    """Every parameter (a tied one once) with the dimension ``apply_tp`` splits (``tp_shard_dims``)."""
    from pretrain.engines.tensor_parallel import tp_shard_dims

    dims = tp_shard_dims(model)
    return tuple(
        ParamInfo(name, tuple(p.shape), p.element_size(), p.requires_grad, dims[name])
        for name, p in model.named_parameters()
    )


def state_bytes(model: Transformer, layout: ParallelLayout, tp_rank: int = 0, shard_rank: int = 0) -> StateBytes:
    """One rank's sharded state (exact): see the module docstring."""
    return table_state_bytes(param_table(model), layout, tp_rank, shard_rank)


def table_state_bytes(
    table: tuple[ParamInfo, ...], layout: ParallelLayout, tp_rank: int, shard_rank: int
) -> StateBytes:
    params = grads = optim = unsharded = 0
    for p in table:
        local = list(p.shape)
        if p.tp_dim is not None and layout.tp > 1:
            local[p.tp_dim] = _chunk(local[p.tp_dim], layout.tp, tp_rank)
        rest = math.prod(local[1:])
        padded_rows = math.ceil(local[0] / layout.dp_shard_cp)
        rows = _chunk(local[0], layout.dp_shard_cp, shard_rank)
        size = p.element_size
        params += padded_rows * rest * size
        if p.requires_grad:
            grads += padded_rows * rest * size
            optim += 2 * rows * rest * size + 4  # exp_avg, exp_avg_sq, a float32 step (fused AdamW)
            unsharded += math.prod(local) * 4
    return StateBytes(params, grads, optim, unsharded)


def max_state_bytes(model: Transformer, layout: ParallelLayout) -> StateBytes:
    """The largest rank's (shard rank 0 holds the largest unpadded chunks; every TP rank is looked at)."""
    states = [state_bytes(model, layout, t, 0) for t in range(layout.tp)]
    return max(states, key=lambda s: s.parameters + s.gradients + s.optimizer)


# ---- activations --------------------------------------------------------------------------


def _norm_bytes(norm: nn.Module, d: int, a: int, sequence_parallel: bool = False) -> int:
    """Per token: RMSNorm keeps its input, the normalised input, the output and a reciprocal RMS; LayerNorm its
    input and output and a float32 mean and rstd. Under sequence parallelism the output (this rank's tokens) is
    not kept: the projections keep its all-gathered copy (``activation_bytes``)."""
    from torch import nn

    output = 0 if sequence_parallel else d * a
    if isinstance(norm, nn.LayerNorm):
        return d * a + output + 8
    return 2 * d * a + output + a


@dataclass(frozen=True)
class ActivationBytes:
    per_layer: int  # what one layer keeps with no recomputation
    kept: int  # what all layers keep until the backward under the mode
    final: int  # final norm, log-softmax (float32), token ids, rotary tables
    total: int  # the peak: kept + one layer recomputed (under checkpointing) + final


def activation_bytes(
    model: Transformer,
    *,
    micro: int,
    seq_len: int,
    cp: int,
    tp: int,
    mode: str,
    dtype_bytes: int,
    sequence_parallel: bool,
) -> ActivationBytes:
    """One rank's saved activations for a micro-batch of ``micro`` sequences (see docs/planner.md). Under sequence
    parallelism (``tp`` > 1) the residual stream's terms (norms, dropout masks, a checkpointed block's input) count
    1 / tp of the rank's tokens, and the projections save the all-gathered inputs of attention, the MLP and the
    head instead of the norms' outputs."""
    cfg, a = model.cfg, dtype_bytes
    tokens = seq_len // cp  # this rank's tokens of each sequence
    sp = sequence_parallel and tp > 1
    stream = tokens // tp if sp else tokens  # the residual stream's tokens on this rank
    d, head_dim = cfg.d_model, cfg.head_dim
    hq, hkv = cfg.n_heads // tp, cfg.kv_heads // tp
    ffn = cfg.ffn_dim // tp
    layers = []
    for block in model.blocks:
        per_token = (4 if block.mlp.gate is not None else 2) * ffn * a
        if block.attn.q_norm is not None:  # input, normalised input, reciprocal RMS of q and k
            per_token += (2 * (hq + hkv) * head_dim + hq + hkv) * a
        per_stream_token = _norm_bytes(block.norm1, d, a, sp) + _norm_bytes(block.norm2, d, a, sp)
        if sp:  # attention's and the MLP's gathered inputs, saved by their projections
            per_token += 2 * d * a
        if cfg.dropout > 0:
            per_stream_token += 2 * d  # two boolean masks
        core = block.attn.core.saved_activation_bytes(
            q_tokens=tokens, k_tokens=seq_len if cp > 1 else tokens, heads=hq, kv_heads=hkv, dtype_bytes=a
        )
        if cp > 1:  # the CP driver concatenates the two chunks' outputs: the output projection saves that copy
            per_token += hq * head_dim * a
        full_layer = micro * (tokens * per_token + stream * per_stream_token + core)
        if mode == "none":
            kept = full_layer
        elif mode == "full":
            kept = micro * stream * d * a  # the block's input
        else:  # selective: the matmuls' and the attention kernel's outputs are kept, the rest recomputed
            gated = 2 if block.mlp.gate is not None else 1
            mm = (hq + 2 * hkv) * head_dim + 2 * d + gated * ffn + d
            kept = micro * (tokens * (mm + hq * head_dim) * a + tokens * hq * 4)
        layers.append((full_layer, kept))
    final = micro * (stream * _norm_bytes(model.norm_f, d, a, sp) + tokens * (4 * cfg.vocab_size + 16))
    if sp:
        final += micro * tokens * d * a  # the head's gathered input
    if model.rope is not None:
        final += 2 * tokens * head_dim * a
    kept = sum(k for _, k in layers)
    recompute = max(f for f, _ in layers) if mode != "none" else 0
    return ActivationBytes(layers[0][0], kept, final, kept + recompute + final)


# ---- working memory (estimated) ---------------------------------------------------------------


def working_bytes(model: Transformer, layout: ParallelLayout, *, micro: int, seq_len: int, accumulation: int) -> int:
    """FSDP2's gathered bf16 parameters (two blocks in flight, and the root's embeddings and head, which stay
    gathered from the forward to the backward), one block's unsharded gradients (bf16, then float32 for the
    reduce-scatter), the logits' transients (bf16 logits, their float32 copy's gradient) and ``accumulation``: the
    unsharded float32 gradients when micro-batches accumulate (``StateBytes.accumulation``), else 0."""
    blocks: dict[int, int] = {}
    root = 0
    for p in param_table(model):
        numel = math.prod(p.shape) // (layout.tp if p.tp_dim is not None else 1)
        if p.name.startswith("blocks."):
            i = int(p.name.split(".")[1])
            blocks[i] = blocks.get(i, 0) + numel
        else:
            root += numel
    block = max(blocks.values(), default=0)
    out = 2 * (2 * block) + 2 * root + (2 + 4) * block
    out += micro * (seq_len // layout.cp) * model.cfg.vocab_size * (2 + 4)
    return out + accumulation


# ---- the plan ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Estimate:
    layout: ParallelLayout
    ac: str  # activation checkpointing: none | selective | full
    micro: int
    state: StateBytes
    activations: int
    working: int
    capacity: int

    @property
    def total(self) -> int:
        return self.state.parameters + self.state.gradients + self.state.optimizer + self.activations + self.working

    @property
    def margin(self) -> int:
        return self.capacity - self.total

    @property
    def fits(self) -> bool:
        return self.margin >= 0

    def rank_key(self) -> tuple[int, int, int]:
        return (self.layout.model_parallel, AC_MODES.index(self.ac), -self.margin)


def meta_model(cfg: RunConfig) -> Transformer:
    """The run's model on the meta device, its trainable set as the run starts (``train.freeze`` /
    ``train.trainable``: a frozen parameter gets no gradient and no AdamW state). A two-phase run
    (``train.unfreeze_at``) ends up training everything, so it is sized for that phase."""
    from model.transformer import build_model
    from pretrain.freezing import check_patterns, is_trainable

    model = build_model(cfg.model, device="meta")
    check_patterns(model, cfg.train)
    for name, p in model.named_parameters():
        p.requires_grad_(bool(cfg.train.unfreeze_at) or is_trainable(name, cfg.train, 0))
    return model


def candidates(cfg: RunConfig, gpus: int, gpus_per_node: int) -> list[tuple[ParallelLayout, int]]:
    """Every (layout, micro-batch) the config can take on ``gpus`` devices (``tp`` within a node): the layouts that
    pass the run's own checks (``check_layout``, ``check_world``)."""
    from run.parallel import check_layout, check_world

    out = []
    for cp, tp in ParallelLayout.model_parallel_degrees(gpus, max_tp=gpus_per_node):
        train = replace(cfg.train, compile=cfg.train.compile and tp == cp == 1)
        train = replace(train, parallel=replace(cfg.train.parallel, tp=tp, cp=cp))
        try:
            check_layout(train, cfg.model, cfg.data.seq_len)
            layout = check_world(train, gpus)
        except ConfigError:
            continue
        out.append((layout, cfg.train.micro_batch_size or cfg.train.batch_size // layout.dp))
    return out


def plan(cfg: RunConfig, gpus: int, memory: int, *, gpus_per_node: int = 8, reserve: float = 0.1) -> list[Estimate]:
    """Every candidate layout x activation checkpointing mode, estimated (in candidate order)."""
    model = meta_model(cfg)
    dtype_bytes = 4 if cfg.train.precision == "fp32" else 2  # auto and bf16: FSDP2's bf16 compute on GPUs
    capacity = int(memory * (1 - reserve))
    out = []
    for layout, micro in candidates(cfg, gpus, gpus_per_node):
        state = max_state_bytes(model, layout)
        accumulation = state.accumulation if cfg.train.batch_size > micro * layout.dp else 0
        working = working_bytes(model, layout, micro=micro, seq_len=cfg.data.seq_len, accumulation=accumulation)
        for ac in AC_MODES:
            act = activation_bytes(
                model,
                micro=micro,
                seq_len=cfg.data.seq_len,
                cp=layout.cp,
                tp=layout.tp,
                mode=ac,
                dtype_bytes=dtype_bytes,
                sequence_parallel=cfg.train.parallel.sequence_parallel,
            )
            out.append(Estimate(layout, ac, micro, state, act.total, working, capacity))
    return out


def pick(estimates: list[Estimate]) -> Estimate | None:
    fitting = [e for e in estimates if e.fits]
    return min(fitting, key=Estimate.rank_key) if fitting else None


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
    if chosen is None:
        lines.append("no layout fits: raise --gpus, lower train.micro_batch_size or data.seq_len")
    else:
        lay = chosen.layout
        lines.append(
            f"picked {lay.label()} (dp_replicate {lay.dp_replicate}, dp_shard {lay.dp_shard}, cp {lay.cp}, "
            f"tp {lay.tp}), "
            f"activation checkpointing {chosen.ac}, micro-batch {chosen.micro}: {chosen.total / GIB:.2f} GiB of "
            f"{chosen.capacity / GIB:.2f} usable ({chosen.margin / GIB:.2f} GiB margin); the rule: the least model "
            "parallelism (cp x tp), then the least recomputation, then the largest margin"
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
    train.setdefault("fsdp2", {})["replicate"] = lay.dp_replicate
    if lay.model_parallel > 1:
        train["compile"] = False  # not supported with tp / cp > 1 yet (run.parallel.check_layout)
        train.setdefault("parallel", {}).update(tp=lay.tp, cp=lay.cp)  # the config's sequence_parallel stays
    else:
        train.pop("parallel", None)
    return raw


# ---- the command --------------------------------------------------------------------------------


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

        if args.gpus < 1:
            raise ConfigError(f"--gpus: must be >= 1, got {args.gpus}")
        if args.gpus_per_node < 1:
            raise ConfigError(f"--gpus-per-node: must be >= 1, got {args.gpus_per_node}")
        if not 0 <= args.reserve < 1:
            raise ConfigError(f"--reserve: must be in [0, 1), got {args.reserve}")
        memory = parse_bytes(args.gpu_memory)
        cfg = load_run_config(args.config, args.overrides)
        if cfg.train.engine not in ("fsdp2",):
            raise ConfigError(
                f"train.engine: the planner plans fsdp2 layouts; got {cfg.train.engine} (--set train.engine=fsdp2)"
            )
        estimates = plan(cfg, args.gpus, memory, gpus_per_node=args.gpus_per_node, reserve=args.reserve)
        if not estimates:
            raise ConfigError(
                f"--gpus: no layout of {args.gpus} devices suits the config (train.batch_size, data.seq_len, heads)"
            )
        chosen = pick(estimates)
        print(report(estimates, chosen, cfg, args.gpus, memory))
        if args.emit:
            if chosen is None:
                raise ConfigError("--emit: no layout fits, nothing to write")
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
            atomic_write_text(Path(args.emit), "\n".join(header) + "\n" + text)
            print(f"wrote {args.emit}")
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
