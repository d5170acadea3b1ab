# mypy: disallow-untyped-defs=False
# (Triton kernels: their parameters are pointers, strides and constexprs that Triton types when it compiles them)
"""The prefix Sinkhorn of a whole sequence (``sinkhorn.sinkhorn_prefix`` without a carried state) as one custom op
with an analytic backward (issue 48, item 1): ``focus_sinkhorn::prefix`` and ``focus_sinkhorn::prefix_backward``,
one opaque node each in a compiled graph instead of some 50 forward and 170 backward ATen ops.

Iteration n of the forward maps x_n [B, T, K] (x_0 the scores) to
    c_n = logcumsumexp_t(x_n),  y_n = x_n - c_n,  x_{n+1} = y_n - logsumexp_k(y_n)
and the op returns exp(x_N). The forward saves the per-iteration state (c_n and x_{n+1}, 2 N [B, T, K]), so the
backward is one pass with no scan recomputed. Given dz = dL/dx_{n+1}:
    dy = dz - exp(x_{n+1}) sum_k dz                  (the log-softmax over the groups)
    dc = -dy
    dx_n[s] = dy[s] + sum_{t >= s} dc[t] exp(x_n[s] - c_n[t])     (the logcumsumexp)
and the sum is exp(x_n[s] - c_n[s]) Q[s] with the suffix recurrence Q[s] = dc[s] + exp(c_n[s] - c_n[s+1]) Q[s+1]
(c_n is non-decreasing in t, so every factor is at most 1: no overflow, whatever the scores' range).

Every iteration's dependence on positions is causal in the forward and anti-causal in the backward, so both run as
one sweep over the sequence: the Triton kernels (one program per sequence, tiles of positions; within a tile the
scans are ``tl.associative_scan``s, across tiles each iteration carries its running mass forward / its Q backward).
They compile for sm_80 / sm_90 (checked without a GPU); GPU time is to be measured. They run on CUDA and under
``TRITON_INTERPRET=1`` (the tests); elsewhere (CPU tensors on the GPU paths in the compile tests, no triton) the same
formulas run as torch operations. The float64 reference is ``sinkhorn_prefix``'s autograd.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from model.attention.common.flex import gpu_paths_active
from model.attention.common.triton import available, capability, interpreting, jit_kernels
from model.attention.focus.sinkhorn import scan_last, sinkhorn_prefix

if TYPE_CHECKING:
    import triton.language as tl
else:
    try:
        import triton.language as tl
    except ImportError:  # the product imports without triton; available() is then False
        tl = None

# positions per tile on the GPU: the sweep is serial over tiles x iterations (one program per sequence: the groups'
# log-softmax couples a row's K columns), so wide tiles (each scan log-depth within the tile) to keep the chain short,
# as wide as registers allow: a tile holds (positions x padded groups) elements, BT = elements // KP, at most 512.
# Compiled for sm_80 and sm_90 (ptxas -v, 10 iterations, K 8 and 64): 0 spill bytes with these; the backward at 512 x 8
# in 8 warps spilled 220 B on sm_90 (31 KB at 256 x 64). To tune on a GPU.
BLOCK_T = 512
FWD_TILE = (4096, 8)  # (elements, warps)
BWD_TILE = {9: (2048, 16)}  # per major compute capability; others (sm_80 ...) take BWD_TILE_DEFAULT
BWD_TILE_DEFAULT = (1024, 8)
INTERPRET_BLOCK_T = 16  # under TRITON_INTERPRET (tests): small tiles, several of them per sequence


# ---------------------------------------------------------------------------------------------------------------------
# torch form (CPU tensors outside the interpreter; the formulas the kernels implement)


def _torch_forward(scores: Tensor, iters: int, save: bool) -> tuple[Tensor, Tensor]:
    x = scores
    saved = []
    for _ in range(iters):
        c = scan_last(x, 1)
        x = torch.log_softmax(x - c, dim=-1)
        if save:
            saved += [c, x]
    state = torch.stack(saved) if save else scores.new_empty(0)
    return x.exp(), state


def _torch_backward(grad: Tensor, scores: Tensor, state: Tensor, iters: int) -> Tensor:
    """dL/dscores from dL/dassign, by the module docstring's formulas; the suffix sum as two reverse logcumsumexps
    of the positive and negative parts of dc exp(-c) (the library's own backward of logcumsumexp does the same)."""
    cs, xs = state[0::2], state[1::2]
    dz = grad * xs[-1].exp()
    for n in reversed(range(iters)):
        c, z = cs[n], xs[n]
        x = scores if n == 0 else xs[n - 1]
        dy = dz - z.exp() * dz.sum(-1, keepdim=True)
        dc = -dy
        log_pos = torch.where(dc > 0, dc.clamp_min(torch.finfo(dc.dtype).tiny).log(), float("-inf")) - c
        log_neg = torch.where(dc < 0, (-dc).clamp_min(torch.finfo(dc.dtype).tiny).log(), float("-inf")) - c
        suffix_pos = scan_last(log_pos.flip(1), 1).flip(1)
        suffix_neg = scan_last(log_neg.flip(1), 1).flip(1)
        dz = dy + (x + suffix_pos).exp() - (x + suffix_neg).exp()
    return dz


# ---------------------------------------------------------------------------------------------------------------------
# kernels (plain functions, jitted by _kernels())


def _logaddexp(a, b):
    """log(exp(a) + exp(b)), -inf for two -inf (not NaN)."""
    m = tl.maximum(a, b)
    m = tl.where(m == float("-inf"), 0.0, m)
    return m + tl.log(tl.exp(a - m) + tl.exp(b - m))


def _affine(w_after, b_after, w, b):
    """The suffix recurrence Q[s] = b + w Q[s + 1] composed with the (already combined) positions after s: a
    reverse scan passes the accumulated later elements first (as a forward scan of the flipped tile would)."""
    return w * w_after, b + w * b_after


def _fwd_kernel(s_ptr, a_ptr, st_ptr, T, K, B, ITERS: tl.constexpr, SAVE: tl.constexpr, BT: tl.constexpr,
                KP: tl.constexpr, NP: tl.constexpr):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)
    rows = tl.arange(0, BT)
    cols = tl.arange(0, KP)
    its = tl.arange(0, NP)
    col_ok = cols < K
    base = b * T * K
    plane = B * T * K  # one saved [B, T, K] tensor
    carry = tl.full([NP, KP], float("-inf"), tl.float64 if s_ptr.dtype.element_ty == tl.float64 else tl.float32)
    for t0 in range(0, T, BT):
        t = t0 + rows
        ok = (t < T)[:, None] & col_ok[None, :]
        off = base + t[:, None] * K + cols[None, :]
        x = tl.load(s_ptr + off, mask=ok, other=float("-inf")).to(carry.dtype)
        for n in tl.static_range(ITERS):
            prev = tl.sum(tl.where(its[:, None] == n, carry, 0.0), 0)  # [KP]: the mass of the earlier tiles
            prev = tl.where(col_ok, prev, float("-inf"))
            c = _logaddexp(tl.associative_scan(x, 0, _logaddexp), prev[None, :])
            last = tl.max(tl.where(rows[:, None] == BT - 1, c, float("-inf")), 0)  # rows past T repeat the last one
            carry = tl.where(its[:, None] == n, last[None, :], carry)
            y = tl.where(ok, x - c, float("-inf"))
            m = tl.max(y, 1)
            m = tl.where(m == float("-inf"), 0.0, m)
            lse = m + tl.log(tl.sum(tl.exp(y - m[:, None]), 1))
            x = tl.where(ok, y - lse[:, None], float("-inf"))
            if SAVE:
                tl.store(st_ptr + (2 * n) * plane + off, c, mask=ok)
                tl.store(st_ptr + (2 * n + 1) * plane + off, x, mask=ok)
        tl.store(a_ptr + off, tl.exp(x).to(a_ptr.dtype.element_ty), mask=ok)


def _bwd_kernel(g_ptr, s_ptr, st_ptr, d_ptr, T, K, B, ITERS: tl.constexpr, BT: tl.constexpr, KP: tl.constexpr,
                NP: tl.constexpr):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)
    rows = tl.arange(0, BT)
    cols = tl.arange(0, KP)
    its = tl.arange(0, NP)
    col_ok = cols < K
    base = b * T * K
    plane = B * T * K
    acc_t = tl.float64 if s_ptr.dtype.element_ty == tl.float64 else tl.float32
    carry = tl.zeros([NP, KP], acc_t)  # Q at the first position of the tile after this one, per iteration
    n_tiles = tl.cdiv(T, BT)
    for i in range(0, n_tiles):
        t0 = (n_tiles - 1 - i) * BT
        t = t0 + rows
        ok = (t < T)[:, None] & col_ok[None, :]
        nxt = ((t + 1) < T)[:, None] & col_ok[None, :]
        off = base + t[:, None] * K + cols[None, :]
        z_last = tl.load(st_ptr + (2 * ITERS - 1) * plane + off, mask=ok, other=float("-inf")).to(acc_t)
        dz = tl.where(ok, tl.load(g_ptr + off, mask=ok, other=0.0).to(acc_t) * tl.exp(z_last), 0.0)
        for j in tl.static_range(ITERS):
            n = ITERS - 1 - j
            c = tl.load(st_ptr + (2 * n) * plane + off, mask=ok, other=0.0).to(acc_t)
            c_next = tl.load(st_ptr + (2 * n) * plane + off + K, mask=nxt, other=0.0).to(acc_t)
            z = tl.load(st_ptr + (2 * n + 1) * plane + off, mask=ok, other=float("-inf")).to(acc_t)
            if n == 0:
                x = tl.load(s_ptr + off, mask=ok, other=float("-inf")).to(acc_t)
            else:
                x = tl.load(st_ptr + (2 * n - 1) * plane + off, mask=ok, other=float("-inf")).to(acc_t)
            dy = dz - tl.exp(z) * tl.sum(dz, 1)[:, None]
            dc = tl.where(ok, -dy, 0.0)
            w = tl.where(nxt, tl.exp(c - c_next), 0.0)  # the tile's last row: the next tile's first position
            wa, qa = tl.associative_scan((w, dc), 0, _affine, reverse=True)
            q_next = tl.sum(tl.where(its[:, None] == n, carry, 0.0), 0)
            q = qa + wa * q_next[None, :]
            first = tl.sum(tl.where(rows[:, None] == 0, q, 0.0), 0)
            carry = tl.where(its[:, None] == n, first[None, :], carry)
            dz = tl.where(ok, dy + tl.exp(x - c) * q, 0.0)
        tl.store(d_ptr + off, dz.to(d_ptr.dtype.element_ty), mask=ok)


_HELPERS = ("_logaddexp", "_affine")
_LAUNCHED = ("_fwd_kernel", "_bwd_kernel")
_KERNELS: dict[bool, dict[str, Any]] = {}


def _kernels() -> dict[str, Any]:
    return jit_kernels(globals(), _HELPERS + _LAUNCHED, _KERNELS)


def _triton_runs(x: Tensor) -> bool:
    return available() and (x.is_cuda or (x.device.type == "cpu" and interpreting()))


def _geometry(scores: Tensor, iters: int, tile: tuple[int, int]) -> dict[str, int]:
    """The kernels' constexprs and warps for ``tile`` = (elements per tile, warps)."""
    kp = 1 << max(0, scores.shape[-1] - 1).bit_length()
    elements, warps = tile
    bt = INTERPRET_BLOCK_T if interpreting() else max(16, min(BLOCK_T, elements // kp))
    return dict(ITERS=iters, BT=bt, KP=kp, NP=1 << (iters - 1).bit_length(), num_warps=warps)


def _bwd_tile(device: torch.device) -> tuple[int, int]:
    cap = capability(device)
    return BWD_TILE.get(cap[0], BWD_TILE_DEFAULT) if cap else BWD_TILE_DEFAULT


# ---------------------------------------------------------------------------------------------------------------------
# the custom ops


@torch.library.custom_op("focus_sinkhorn::prefix", mutates_args=())
def _prefix_op(scores: Tensor, iters: int, save: bool) -> tuple[Tensor, Tensor]:
    """(assignments [B, T, K] in scores' dtype, the saved state [2 iters, B, T, K]: c_n, x_{n+1} alternating; empty
    without ``save``)."""
    scores = scores.contiguous()
    if not _triton_runs(scores):
        return _torch_forward(scores, iters, save)
    bsz, t, k = scores.shape
    out = torch.empty_like(scores)
    state = scores.new_empty((2 * iters, bsz, t, k) if save else (0,))
    _kernels()["_fwd_kernel"][(bsz,)](scores, out, state, t, k, bsz, SAVE=save, **_geometry(scores, iters, FWD_TILE))
    return out, state


@_prefix_op.register_fake
def _(scores: Tensor, iters: int, save: bool) -> tuple[Tensor, Tensor]:
    state = scores.new_empty((2 * iters, *scores.shape) if save else (0,))
    return torch.empty_like(scores, memory_format=torch.contiguous_format), state


@torch.library.custom_op("focus_sinkhorn::prefix_backward", mutates_args=())
def _backward_op(grad: Tensor, scores: Tensor, state: Tensor, iters: int) -> Tensor:
    grad, scores = grad.contiguous(), scores.contiguous()
    if not _triton_runs(scores):
        return _torch_backward(grad, scores, state, iters)
    bsz, t, k = scores.shape
    out = torch.empty_like(scores)
    geometry = _geometry(scores, iters, _bwd_tile(scores.device))
    _kernels()["_bwd_kernel"][(bsz,)](grad, scores, state, out, t, k, bsz, **geometry)
    return out


@_backward_op.register_fake
def _(grad: Tensor, scores: Tensor, state: Tensor, iters: int) -> Tensor:
    return torch.empty_like(scores, memory_format=torch.contiguous_format)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    scores, iters, save = inputs
    if not save:
        raise RuntimeError("focus_sinkhorn::prefix: a backward needs the state (save=True)")
    ctx.save_for_backward(scores, output[1])
    ctx.iters = iters


def _backward(ctx: Any, grad: Tensor, grad_state: Tensor | None) -> tuple[Any, ...]:
    scores, state = ctx.saved_tensors
    return _backward_op(grad, scores, state, ctx.iters), None, None


_prefix_op.register_autograd(_backward, setup_context=_setup_context)

PREFIX_OP = torch.ops.focus_sinkhorn.prefix.default  # kept by selective activation checkpointing (attention_ops)


def sinkhorn_prefix_op(scores: Tensor, iters: int) -> Tensor:
    """``sinkhorn_prefix(scores, iters)[0]`` (no carried state) as the custom op; the state is saved only where a
    backward can need it."""
    save = torch.is_grad_enabled() and scores.requires_grad
    return _prefix_op(scores, int(iters), save)[0]


def prefix_assignments(scores: Tensor, iters: int) -> Tensor:
    """``sinkhorn_prefix(scores, iters)[0]`` of a whole sequence. On the GPU paths (CUDA, or CPU tensors inside
    ``gpu_paths_forced``) this module's op (one node in a compiled graph, one Triton sweep over the sequence each way,
    its backward from the saved per-iteration state); elsewhere ``sinkhorn_prefix``'s operations (the CPU's fast
    scan, and the float64 reference)."""
    if gpu_paths_active(scores) and scores.dtype in (torch.float32, torch.float64) and scores.shape[1] > 0:
        return sinkhorn_prefix_op(scores, iters)
    return sinkhorn_prefix(scores, iters)[0]
