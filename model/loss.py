"""Fused LM head + cross-entropy over chunks of tokens: the summed token loss of ``hidden @ weight.T`` without ever
holding the [N, V] logits (nor their float32 upcast) for the whole batch.

``chunked_linear_cross_entropy(hidden [N, d], weight [V, d], targets [N])`` walks the N tokens ``chunk`` at a time.
Each chunk's logits are computed in the compute dtype (autocast's where it is on, bf16 on CUDA), their logsumexp and
softmax in float32 (float64 stays float64), and the chunk's gradients w.r.t. ``hidden`` and ``weight`` are computed
right away, in the forward; backward only scales them by the incoming gradient (a scalar: the loss is a sum).

Why gradients in the forward rather than saving ``hidden`` and recomputing each chunk's logits in backward: the head
costs 2NVd FLOPs for the logits and 4NVd for the two gradient matmuls; recomputation adds the logits' 2NVd again
(8NVd instead of 6NVd, a third more head FLOPs; at V = 128256 the head is a large share of a ~1B model's FLOPs),
while computing them in the forward costs memory only: a float32 [V, d] weight-gradient buffer and an [N, d]
hidden-gradient one held from forward to backward, both far smaller than the [N, V] logits the plain path keeps
(and the weight's .grad of that size exists after backward anyway). The catch: a forward with gradients enabled
does the backward's matmuls even if no backward follows, so a forward without gradients (evaluation) computes the
loss only, and an input that needs no gradient (a frozen head) gets none computed.

Numerics against the plain path (``F.cross_entropy(logits.float(), ...)`` on autocast logits): the same logits in
the compute dtype, the same float32 softmax, the same compute-dtype gradient of the logits fed to the same two
matmuls; the weight gradient is summed over chunks in float32 (the plain path rounds the whole sum once), so the two
agree to the compute dtype's rounding, and exactly up to summation order in float32 / float64.

The caller (``Transformer.forward``) uses it only where the head is a plain ``nn.Linear`` called without hooks on an
ordinary tensor: a tensor-parallel (DTensor, column-parallel) head or a DeepSpeed ZeRO-3 partitioned one keeps the
plain path, as do ``return_logits=True`` forwards (evaluation, generation)."""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch
from torch import Tensor

IGNORE_INDEX = -100  # targets that count nothing (F.cross_entropy's default; eval.perplexity masks with it)

# each chunk's [chunk, V] logits hold at most this many elements (1 GiB as float32; a chunk's transient buffers are
# about 6 bytes per element under bf16: its float32 logits, softmax in place, and a bf16 copy of them or of its grad):
# at V = 32000 a chunk is 8192 tokens, at V = 128256 2048. Not smaller: every chunk adds its [V, d] weight gradient
# into the float32 accumulator (~12 V d bytes of memory traffic: 4 V d for the matmul's bf16 result written and read,
# 8 V d for the float32 read and write), a fixed cost per chunk against the chunk's 6 C V d FLOPs; at C = 2048 on an
# H100 (~240 FLOPs per byte) that is roughly a quarter of the head's matmul time, estimated, not measured
CHUNK_ELEMENTS = 2**28


def default_chunk(n_tokens: int, vocab: int) -> int:
    """Tokens per chunk: the largest power of two whose logits fit ``CHUNK_ELEMENTS`` (at least 256), at most N."""
    per = max(256, 2 ** int(math.log2(max(1, CHUNK_ELEMENTS // max(1, vocab)))))
    return max(1, min(n_tokens, per))


def _accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)  # bf16 / fp16 -> float32; float64 stays


def _chunk(
    h: Tensor,
    w: Tensor,
    t: Tensor,
    ignore_index: int,
    grad_hidden: Tensor | None,
    grad_weight: Tensor | None,
) -> Tensor:
    """One chunk: its summed loss; its gradients written into ``grad_hidden`` (this chunk's rows) and added into
    ``grad_weight`` where given. A function of its own so that its [C, V] buffers are freed before the next chunk's."""
    acc = _accumulate_dtype(h.dtype)
    z = (h @ w.T).to(acc)  # [C, V]: the logits in the compute dtype, then float32 (the same tensor if already)
    valid = t != ignore_index
    safe = torch.where(valid, t, torch.zeros_like(t))[:, None]
    target_logit = z.gather(1, safe).squeeze(1)
    # logsumexp and softmax in place over z: no second [C, V] float32 buffer (torch.logsumexp would allocate one)
    top = z.amax(dim=-1, keepdim=True)
    total = z.sub_(top).exp_().sum(dim=-1, keepdim=True)
    lse = (total.log() + top).squeeze(1)
    loss = torch.where(valid, lse - target_logit, torch.zeros_like(lse)).sum()
    if grad_hidden is None and grad_weight is None:
        return loss
    # d loss / d logits = softmax - one_hot(target), zero on ignored rows; then in the compute dtype
    weights = valid.to(acc)[:, None]
    z.div_(total).scatter_add_(1, safe, -weights).mul_(weights)
    g = z.to(h.dtype)
    del z  # the float32 softmax, when g is a copy
    if grad_hidden is not None:
        grad_hidden.copy_(g @ w)
    if grad_weight is not None:
        if grad_weight.dtype == g.dtype:
            grad_weight.addmm_(g.T, h)
        else:
            grad_weight += g.T @ h  # the chunk's sum in the compute dtype, accumulated in float32
    return loss


def _chunks(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    ignore_index: int,
    chunk: int,
    compute_dtype: torch.dtype,
    need_hidden: bool,
    need_weight: bool,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """(summed loss, d loss / d hidden or None, d loss / d weight or None), chunk by chunk."""
    h_all = hidden.to(compute_dtype)
    w = weight.to(compute_dtype)
    loss = torch.zeros((), dtype=_accumulate_dtype(compute_dtype), device=hidden.device)
    grad_hidden = torch.empty_like(hidden) if need_hidden else None
    grad_weight = None
    if need_weight:  # float32 (or wider): the chunks' contributions add up there
        grad_weight = torch.zeros(weight.shape, dtype=_accumulate_dtype(weight.dtype), device=weight.device)
    for start in range(0, hidden.shape[0], chunk):
        rows = slice(start, start + chunk)
        rows_grad = grad_hidden[rows] if grad_hidden is not None else None
        loss = loss + _chunk(h_all[rows], w, targets[rows], ignore_index, rows_grad, grad_weight)
    if grad_weight is not None:
        grad_weight = grad_weight.to(weight.dtype)
    return loss, grad_hidden, grad_weight


def _no_autocast(device_type: str) -> contextlib.AbstractContextManager[Any]:
    """Autocast off inside: the dtypes are chosen explicitly above (and autocast would recast the float32 softmax)."""
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type=device_type, enabled=False)
    return contextlib.nullcontext()


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        targets: Tensor,
        ignore_index: int,
        chunk: int,
        compute_dtype: torch.dtype,
    ) -> Tensor:
        need_hidden, need_weight = bool(ctx.needs_input_grad[0]), bool(ctx.needs_input_grad[1])
        with _no_autocast(hidden.device.type):
            loss, grad_hidden, grad_weight = _chunks(
                hidden, weight, targets, ignore_index, chunk, compute_dtype, need_hidden, need_weight
            )
        ctx.save_for_backward(grad_hidden, grad_weight)
        return loss

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, ...]:
        grad_hidden, grad_weight = ctx.saved_tensors
        # scaled in place: the buffers are this function's own; a second backward through a retained graph finds
        # them modified and autograd raises rather than scaling twice. grad_output is a 0-dim tensor: a bf16 buffer
        # stays bf16, multiplied in float32 and rounded once
        if grad_hidden is not None:
            grad_hidden = grad_hidden.mul_(grad_output)
        if grad_weight is not None:
            grad_weight = grad_weight.mul_(grad_output)
        return grad_hidden, grad_weight, None, None, None, None


def autocast_compute_dtype(hidden: Tensor, weight: Tensor) -> torch.dtype:
    """The dtype ``F.linear(hidden, weight)`` computes in here: autocast's where it is on for the device, else the
    inputs' common dtype."""
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type) and hidden.is_floating_point():
        return torch.get_autocast_dtype(device_type)
    return torch.promote_types(hidden.dtype, weight.dtype)


def chunked_linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    ignore_index: int = IGNORE_INDEX,
    chunk: int | None = None,
    compute_dtype: torch.dtype | None = None,
) -> Tensor:
    """Summed cross-entropy of the logits ``hidden @ weight.T`` ([N, d] x [V, d] -> [N, V]) against ``targets`` [N]
    (``ignore_index`` rows count nothing), ``chunk`` tokens at a time (None: ``default_chunk``). Equal to
    ``F.cross_entropy(F.linear(hidden, weight).float(), targets, ignore_index=..., reduction="sum")``; see the module
    docstring for the dtypes (``compute_dtype`` None: autocast's, else the inputs')."""
    if hidden.dim() != 2 or weight.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(
            f"chunked_linear_cross_entropy: hidden [N, d], weight [V, d], targets [N]; got {tuple(hidden.shape)}, "
            f"{tuple(weight.shape)}, {tuple(targets.shape)}"
        )
    dtype = compute_dtype or autocast_compute_dtype(hidden, weight)
    size = chunk if chunk is not None else default_chunk(hidden.shape[0], weight.shape[0])
    if size < 1:
        raise ValueError(f"chunked_linear_cross_entropy: chunk must be >= 1, got {size}")
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _LinearCrossEntropy.apply(hidden, weight, targets, ignore_index, size, dtype)
    with _no_autocast(hidden.device.type):
        return _chunks(hidden, weight, targets, ignore_index, size, dtype, False, False)[0]
