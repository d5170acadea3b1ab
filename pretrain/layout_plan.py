"""The layout planner's memory model and choice (``python -m launch.plan`` prints and emits it; ``bench.train_step``
plans its arms with it): for every layout a run config can take on N devices (``dp_replicate x dp_shard x cp x tp``)
and each activation checkpointing mode (none / selective / full), the bytes one device holds at the largest
micro-batch that fits, and the pick. The model is built on the meta device from the config, so every parameter a
variant adds is counted. See docs/planner.md for the model, what is exact and what is estimated.

- Parameters, gradients, optimizer state: EXACT, the arithmetic of the sharded state. Tensor parallelism splits a
  parameter's dimension as ``apply_tp`` does (``tp_shard_dims``: torch.chunk sizes); FSDP2 then splits dim 0 of
  each rank's local tensor over ``dp_shard x cp`` (``torch.chunk``) and stores each shard padded to the first
  chunk's rows (``FSDPParam._init_sharded_param``); a group's sharded gradients are views of one reduce-scatter
  output of the padded sizes. The engine keeps float32 parameters and gradients (bf16 is FSDP2's compute copy);
  AdamW keeps exp_avg and exp_avg_sq like each rank's unpadded shard, and a float32 step per parameter.
- Activations: ESTIMATED from the architecture (per layer: norms, projections, the MLP, and the attention core's
  own ``Attention.saved_activation_bytes`` hook), the bytes autograd saves for the backward.
- Working memory: ESTIMATED (FSDP2's gathered parameters, the LM head's transients, unsharded gradients while
  accumulating micro-batches), plus a reserve of the device for the CUDA context, NCCL and fragmentation.
- ``train.float8``: the parameters, gradients, optimizer state and saved activations are unchanged (torchao keeps
  the high-precision weights and saves each linear's high-precision input, as ``nn.Linear`` does); the tensorwise
  recipe all-gathers the converted weights in float8 (1 byte, not bf16's 2), and every recipe adds the float8 copies
  of the largest linear's input and weight while it computes (``float8_working_bytes``).

The pick: among the layouts that fit, the least model parallelism (cp x tp), then the least recomputation (none,
selective, full), then the largest micro-batch, then the largest margin. For each layout and mode the micro-batch is
the largest that divides the replica's share of ``train.batch_size`` and fits (``micro_batches``).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from core.errors import ConfigError
from run.parallel import ParallelLayout

if TYPE_CHECKING:
    from torch import nn

    from model.transformer import Transformer
    from run.config import RunConfig

AC_MODES = ("none", "selective", "full")
RESERVE = 0.1  # the share of a device kept free by default: CUDA context, NCCL buffers, fragmentation


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
    fused_head: bool = False,
) -> ActivationBytes:
    """One rank's saved activations for a micro-batch of ``micro`` sequences (see docs/planner.md). Under sequence
    parallelism (``tp`` > 1) the residual stream's terms (norms, dropout masks, a checkpointed block's input) count
    1 / tp of the rank's tokens, and the projections save the all-gathered inputs of attention, the MLP and the
    head instead of the norms' outputs. ``fused_head`` (``train.fused_cross_entropy``, no TP): the fused head keeps
    the hidden states' gradient (float32 at most) and a float32 [V, d] weight gradient instead of the float32
    log-softmax over the vocabulary, the targets and the final norm's output (``model.loss``)."""
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
    if fused_head:  # token ids 8; nothing keeps the final norm's output (the head's gradients are computed already)
        head = micro * tokens * (4 * d + 8) + 4 * cfg.vocab_size * d
    else:
        head = micro * tokens * (4 * cfg.vocab_size + 16)
    final = micro * stream * _norm_bytes(model.norm_f, d, a, sp or fused_head) + head
    if sp:
        final += micro * tokens * d * a  # the head's gathered input
    if model.rope is not None:
        final += 2 * tokens * head_dim * a
    kept = sum(k for _, k in layers)
    recompute = max(f for f, _ in layers) if mode != "none" else 0
    return ActivationBytes(layers[0][0], kept, final, kept + recompute + final)


# ---- working memory (estimated) ---------------------------------------------------------------


def working_bytes(
    model: Transformer,
    layout: ParallelLayout,
    *,
    micro: int,
    seq_len: int,
    accumulation: int,
    fused_head: bool = False,
    float8: str = "none",
    float8_filter: tuple[str, ...] = (),
) -> int:
    """FSDP2's gathered bf16 parameters (two blocks in flight, and the root's embeddings and head, which stay
    gathered from the forward to the backward), one block's unsharded gradients (bf16, then float32 for the
    reduce-scatter), the LM head's transients and ``accumulation``: the unsharded float32 gradients when
    micro-batches accumulate (``StateBytes.accumulation``), else 0. The head's transients: the plain head's bf16
    logits and their float32 copy's gradient for every token; the fused head's (``fused_head``) one chunk's
    (``model.loss.default_chunk`` tokens: float32 logits and a bf16 copy, 6 bytes per element) and bf16 copies of
    the hidden states and the head's weight. ``float8`` / ``float8_filter``: ``train.float8``'s, see
    ``float8_working_bytes``."""
    float8_weights = float8_weight_names(model, float8, float8_filter)
    gathered_float8 = float8 == "tensorwise"  # the float8 all-gather (pretrain.engines.float8)
    blocks: dict[int, int] = {}
    gathered: dict[int, int] = {}  # bytes of a block's gathered parameters
    root = 0
    for p in param_table(model):
        numel = math.prod(p.shape) // (layout.tp if p.tp_dim is not None else 1)
        if p.name.startswith("blocks."):
            i = int(p.name.split(".")[1])
            blocks[i] = blocks.get(i, 0) + numel
            gathered[i] = gathered.get(i, 0) + numel * (1 if gathered_float8 and p.name in float8_weights else 2)
        else:
            root += numel
    block = max(blocks.values(), default=0)
    out = 2 * max(gathered.values(), default=0) + 2 * root + (2 + 4) * block
    tokens, vocab, d = micro * (seq_len // layout.cp), model.cfg.vocab_size, model.cfg.d_model
    out += float8_working_bytes(model, layout, float8_weights, tokens)
    if fused_head:
        from model.loss import default_chunk

        out += default_chunk(tokens, vocab) * vocab * (2 + 4) + 2 * (tokens + vocab) * d
    else:
        out += tokens * vocab * (2 + 4)
    return out + accumulation


def float8_weight_names(model: Transformer, float8: str, patterns: tuple[str, ...] | list[str]) -> frozenset[str]:
    """The weights ``train.float8`` converts (``pretrain.engines.float8.eligible``: the same filter), none for
    ``none``."""
    if float8 == "none":
        return frozenset()
    from pretrain.engines.float8 import eligible

    names, _ = eligible(model, list(patterns))
    return frozenset(f"{name}.weight" for name in names)


def float8_working_bytes(model: Transformer, layout: ParallelLayout, weights: frozenset[str], tokens: int) -> int:
    """The transients of one float8 matmul at a time: its input cast to float8 (``tokens`` x in-features, 1 byte;
    the whole sequence's under sequence parallelism, which gathers before the projections) and its weight's float8
    copy (the TP-local shard, 1 byte); the largest of the converted linears. 0 without float8."""
    largest = 0
    for p in param_table(model):
        if p.name in weights:
            rows, cols = p.shape
            local = (rows * cols) // (layout.tp if p.tp_dim is not None else 1)
            cols_local = cols // layout.tp if p.tp_dim == 1 else cols
            largest = max(largest, tokens * cols_local + local)
    return largest


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

    def rank_key(self) -> tuple[int, int, int, int]:
        return (self.layout.model_parallel, AC_MODES.index(self.ac), -self.micro, -self.margin)


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
    """Every (layout, sequences per replica and step) the config can take on ``gpus`` devices (``tp`` within a
    node): the layouts that pass the run's own checks (``check_layout``, ``check_world``; the micro-batch is the
    planner's to choose, so the configured one does not rule a layout out)."""
    from run.parallel import check_layout, check_world

    out = []
    for cp, tp in ParallelLayout.model_parallel_degrees(gpus, max_tp=gpus_per_node):
        train = replace(cfg.train, compile=cfg.train.compile and tp == cp == 1, micro_batch_size=0)
        train = replace(train, parallel=replace(cfg.train.parallel, tp=tp, cp=cp))
        try:
            check_layout(train, cfg.model, cfg.data.seq_len)
            layout = check_world(train, gpus)
        except ConfigError:
            continue
        out.append((layout, cfg.train.batch_size // layout.dp))
    return out


def micro_batches(per_replica: int, largest: int = 0) -> list[int]:
    """The micro-batches that split a replica's ``per_replica`` sequences into whole micro-steps, largest first
    (at most ``largest`` when given, 1 at least)."""
    out = [m for m in range(per_replica, 0, -1) if per_replica % m == 0 and (not largest or m <= largest)]
    return out or [1]


def estimate(
    cfg: RunConfig, model: Transformer, layout: ParallelLayout, *, ac: str, micro: int, capacity: int, accumulate: bool
) -> Estimate:
    """One device's bytes for ``layout`` under checkpointing mode ``ac`` at ``micro`` sequences per micro-batch;
    ``accumulate``: the step's micro-batches accumulate (FSDP2 then holds unsharded gradients between them)."""
    state = max_state_bytes(model, layout)
    fused = cfg.train.fused_cross_entropy and layout.tp == 1  # a TP (DTensor) head takes the plain path
    seq_len = cfg.data.seq_len
    working = working_bytes(
        model,
        layout,
        micro=micro,
        seq_len=seq_len,
        accumulation=state.accumulation if accumulate else 0,
        fused_head=fused,
        float8=cfg.train.float8,
        float8_filter=tuple(cfg.train.float8_filter),
    )
    act = activation_bytes(
        model,
        micro=micro,
        seq_len=seq_len,
        cp=layout.cp,
        tp=layout.tp,
        mode=ac,
        dtype_bytes=4 if cfg.train.precision == "fp32" else 2,  # auto and bf16: FSDP2's bf16 compute on GPUs
        sequence_parallel=cfg.train.parallel.sequence_parallel,
        fused_head=fused,
    )
    return Estimate(layout, ac, micro, state, act.total, working, capacity)


def plan(
    cfg: RunConfig,
    gpus: int,
    memory: int,
    *,
    gpus_per_node: int = 8,
    reserve: float = RESERVE,
    max_micro: int = 0,
    accumulate: bool = True,
) -> list[Estimate]:
    """Every candidate layout x activation checkpointing mode (in candidate order), each at the largest micro-batch
    that fits ``(1 - reserve) x memory`` (``micro_batches``, at most ``max_micro`` when given), or at the smallest
    when none does. ``accumulate=False``: every micro-batch is a whole step (a benchmark's), nothing accumulates."""
    model = meta_model(cfg)
    capacity = int(memory * (1 - reserve))
    out = []
    for layout, per_replica in candidates(cfg, gpus, gpus_per_node):
        for ac in AC_MODES:
            for micro in micro_batches(per_replica, max_micro):
                e = estimate(
                    cfg,
                    model,
                    layout,
                    ac=ac,
                    micro=micro,
                    capacity=capacity,
                    accumulate=accumulate and micro < per_replica,
                )
                if e.fits:
                    break
            out.append(e)
    return out


def pick(estimates: list[Estimate]) -> Estimate | None:
    fitting = [e for e in estimates if e.fits]
    return min(fitting, key=Estimate.rank_key) if fitting else None


def single_device_plan(cfg: RunConfig, memory: int, *, max_micro: int, reserve: float = RESERVE) -> Estimate | None:
    """What one device of ``memory`` bytes trains ``cfg``'s model with when every micro-batch is a whole step (a
    benchmark's): the least recomputation that fits, at the largest micro-batch dividing ``max_micro`` that fits
    ``(1 - reserve) x memory``; None when nothing does. Sized as the fsdp2 engine on one rank (float32 parameters,
    gradients and AdamW state, bf16 compute), which the single engine's autocast matches."""
    parallel = replace(cfg.train.parallel, tp=1, cp=1)
    train = replace(cfg.train, engine="fsdp2", batch_size=max_micro, micro_batch_size=0, parallel=parallel)
    return pick(plan(replace(cfg, train=train), 1, memory, reserve=reserve, accumulate=False))
