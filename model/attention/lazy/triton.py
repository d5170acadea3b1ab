"""Lazy attention's fused CUDA path: Triton kernels for Elastic-Softmax, forward and backward (issue 38).

Queries at positions ``P .. P + Tq - 1`` (``P = Tk - Tq`` as ``fast`` receives them: training has P = 0, context
parallelism and chunked prefill P > 0) attend keys ``0 .. Tk - 1``; ``s = q.k * scale - b_h[clamp(i - j, 0, last)]``,
``p = softmax_j(s)``, ``a_ij = relu(p_ij - c_i)`` with ``c_i = tau_h / (i + 1)``, ``out_i = sum_j a_ij v_j``.

Tiling. Query and key blocks are ``BLOCK`` positions wide and aligned to absolute positions (query block I holds
positions ``I * BLOCK ..``; the rows before P or past the last query are masked), so every tile (I, J) lies on the
block diagonal ``e = I - J`` and its distances are ``e * BLOCK + a - b``. GQA: query head h reads key/value head
``h // G``.

- Forward (one program per query block and (batch, head)): pass 1 is the online logsumexp ``lse`` of the biased
  scores; pass 2 recomputes each tile, ``w = relu(exp(s - lse) - c)``, ``o += w @ v`` and ``a += 1[w > 0] @ v`` (what
  the backward needs). Where ``tau_h < 0`` the relu never fires (``p - c > 0`` on every visible key), the output is
  softmax attention plus ``|c_i| * sum_j v_j``, and the program takes one pass (online softmax and the running sum of
  v) instead of two. The first query (position 0) sees one key: its p is exactly 1 (as the reference: at tau = 1 that
  weight sits on the threshold, weight and gradient 0).
- Backward. Per row (torch, O(T * D)): ``D_i = do_i . (o_i + c_i a_i)`` (= sum over the support of p * da) and
  ``g_i = do_i . a_i``, so ``dtau_h = -sum_{b, i} g_i / n_i``. With ``m = 1[w > 0]``: ``ds = p * (m * (do . v) - D)``.
  ``dq`` kernel: a program per query block (``dq = scale * ds @ k``). ``dk, dv`` kernel: a program per key block and
  (batch, key/value head), looping over the G query heads of its group (``dv = w^T @ do``, ``dk = scale * ds^T @ q``),
  written once. ``d bias`` kernel: a program per (block diagonal e, query head), looping over the batch and the tiles
  of its diagonal, sums their ``ds`` tiles elementwise (same distances at the same place in every tile of a diagonal)
  and writes its ``[BLOCK, BLOCK]`` sum once: a partials buffer ``[H, n_diagonals, BLOCK, BLOCK]`` (H * T * BLOCK
  floats), which torch folds onto the table by distance (``index_add`` of ``-partials``, clamped to ``last``). No
  atomics anywhere.

Arithmetic: float32 accumulators (float64 for float64 inputs: the interpreter tests), ``ieee`` dots for float32 and
float64 inputs (bf16 / fp16 inputs use the tensor cores as they are). ``triton`` is imported lazily: this module
imports without it (``available()`` says whether the path can run); the kernels are ``triton.jit``-ed on first use,
once per interpreter mode (``TRITON_INTERPRET=1`` runs them on CPU tensors: the tests). The launches are the custom
ops ``lazy_triton::forward`` / ``lazy_triton::backward`` so a compiled block traces them as one opaque node.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import Tensor

from model.attention.common.triton import (
    TileConfig,
    acc_dtype,
    capability,
    family_tiles,
    jit_kernels,
    last_contiguous,
    launch_tiles,
    padded,
    precision,
    strides,
)
from model.attention.common.triton import available as available  # the module's own question too

if TYPE_CHECKING:
    import triton.language as tl
else:
    try:
        import triton.language as tl
    except ImportError:  # the product imports without triton; available() is then False
        tl = None

R = TypeVar("R")


# ---------------------------------------------------------------------------------------------------------------------
# kernels (plain functions, jitted by _kernels())


def _scores(q, k_ptr, bias_ptr, kpos, pos, d, k_base, skt, D, Tk, h_bias, last, scale, PREC: tl.constexpr):
    """[rows, keys] biased scores of one tile, -inf off the causal (and key-range) mask; and that mask."""
    k_ok = kpos < Tk
    kt = tl.load(k_ptr + k_base + kpos[None, :] * skt + d[:, None], mask=k_ok[None, :] & (d[:, None] < D), other=0.0)
    s = tl.dot(q, kt, input_precision=PREC).to(q.dtype if q.dtype == tl.float64 else tl.float32) * scale
    dist = tl.minimum(tl.maximum(pos[:, None] - kpos[None, :], 0), last)
    s = s - tl.load(bias_ptr + h_bias + dist).to(s.dtype)
    vis = (kpos[None, :] <= pos[:, None]) & k_ok[None, :]
    return tl.where(vis, s, float("-inf")), vis


def _probs(s, lse, pos, c, vis):
    """p = exp(s - lse) (exactly 1 for the first query), the kept mask and w = relu(p - c) on the visible keys."""
    p = tl.exp(s - lse[:, None])
    p = tl.where(pos[:, None] == 0, 1.0, p)
    w = p - c[:, None]
    keep = vis & (w > 0)
    return p, keep, tl.where(keep, w, 0.0)


def _fwd_kernel(
    q_ptr, k_ptr, v_ptr, bias_ptr, tau_ptr, o_ptr, lse_ptr, a_ptr,
    sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sbias,
    scale, P, Tq, Tk, last, HQ, G, D,
    BLOCK: tl.constexpr, BD: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    i_blk, bh = tl.program_id(0), tl.program_id(1)
    b, h = (bh // HQ).to(tl.int64), bh % HQ
    hk = h // G
    qb = P // BLOCK + i_blk
    pos = qb * BLOCK + tl.arange(0, BLOCK)
    row_ok = (pos >= P) & (pos < P + Tq)
    d = tl.arange(0, BD)
    qi = pos - P
    q = tl.load(
        q_ptr + b * sqb + h * sqh + qi[:, None] * sqt + d[None, :], mask=row_ok[:, None] & (d[None, :] < D), other=0.0
    )
    acc_t = tl.float64 if q.dtype == tl.float64 else tl.float32
    k_base = b * skb + hk * skh
    v_base = b * svb + hk * svh
    tau = tl.load(tau_ptr + h).to(acc_t)
    c = tau / (pos + 1).to(acc_t)
    m = tl.full([BLOCK], float("-inf"), acc_t)
    den = tl.zeros([BLOCK], acc_t)
    o = tl.zeros([BLOCK, BD], acc_t)
    a = tl.zeros([BLOCK, BD], acc_t)
    lse = tl.zeros([BLOCK], acc_t)
    if tau < 0:  # the relu never fires: softmax attention + |c| * sum_j v_j, in one pass
        for J in range(0, qb + 1):
            kpos = J * BLOCK + tl.arange(0, BLOCK)
            s, vis = _scores(q, k_ptr, bias_ptr, kpos, pos, d, k_base, skt, D, Tk, h * sbias, last, scale, PREC)
            m_new = tl.maximum(m, tl.max(s, 1))
            r = tl.exp(m - m_new)
            e = tl.exp(s - m_new[:, None])
            den = den * r + tl.sum(e, 1)
            m = m_new
            vt = tl.load(
                v_ptr + v_base + kpos[:, None] * svt + d[None, :], mask=(kpos[:, None] < Tk) & (d[None, :] < D)
            )
            o = o * r[:, None] + tl.dot(e.to(vt.dtype), vt, input_precision=PREC).to(acc_t)
            a += tl.dot(vis.to(vt.dtype), vt, input_precision=PREC).to(acc_t)
        lse = m + tl.log(den)
        o = o / den[:, None] - c[:, None] * a
    else:  # pass 1: the row logsumexp; pass 2: relu(p - c) @ v
        for J in range(0, qb + 1):
            kpos = J * BLOCK + tl.arange(0, BLOCK)
            s, vis = _scores(q, k_ptr, bias_ptr, kpos, pos, d, k_base, skt, D, Tk, h * sbias, last, scale, PREC)
            m_new = tl.maximum(m, tl.max(s, 1))
            den = den * tl.exp(m - m_new) + tl.sum(tl.exp(s - m_new[:, None]), 1)
            m = m_new
        lse = m + tl.log(den)
        for J in range(0, qb + 1):
            kpos = J * BLOCK + tl.arange(0, BLOCK)
            s, vis = _scores(q, k_ptr, bias_ptr, kpos, pos, d, k_base, skt, D, Tk, h * sbias, last, scale, PREC)
            p, keep, w = _probs(s, lse, pos, c, vis)
            vt = tl.load(
                v_ptr + v_base + kpos[:, None] * svt + d[None, :], mask=(kpos[:, None] < Tk) & (d[None, :] < D)
            )
            o += tl.dot(w.to(vt.dtype), vt, input_precision=PREC).to(acc_t)
            a += tl.dot(keep.to(vt.dtype), vt, input_precision=PREC).to(acc_t)
    row = (b * HQ + h) * Tq + qi
    out_mask = row_ok[:, None] & (d[None, :] < D)
    tl.store(o_ptr + row[:, None] * D + d[None, :], o.to(o_ptr.dtype.element_ty), mask=out_mask)
    tl.store(a_ptr + row[:, None] * D + d[None, :], a.to(a_ptr.dtype.element_ty), mask=out_mask)
    tl.store(lse_ptr + row, lse.to(lse_ptr.dtype.element_ty), mask=row_ok)


def _ds_tile(q, do, lse, delta, c, pos, kpos, d, k_ptr, v_ptr, bias_ptr, k_base, v_base, skt, svt, D, Tk, h_bias,
             last, scale, PREC: tl.constexpr):  # fmt: skip
    """[rows, keys] ds = p * (1[w > 0] * (do . v) - D) of one tile, w = relu(p - c), and the tile's keys."""
    s, vis = _scores(q, k_ptr, bias_ptr, kpos, pos, d, k_base, skt, D, Tk, h_bias, last, scale, PREC)
    p, keep, w = _probs(s, lse, pos, c, vis)
    vt = tl.load(v_ptr + v_base + kpos[None, :] * svt + d[:, None], mask=(kpos[None, :] < Tk) & (d[:, None] < D))
    dp = tl.dot(do, vt, input_precision=PREC).to(s.dtype)
    ds = tl.where(vis, p * (tl.where(keep, dp, 0.0) - delta[:, None]), 0.0)
    return ds, w


def _load_rows(q_ptr, do_ptr, lse_ptr, delta_ptr, tau_ptr, b, h, qb, P, Tq, HQ, D, sqb, sqh, sqt, d,
               BLOCK: tl.constexpr):  # fmt: skip
    """One query block's q, do, lse, D and c (rows outside the queries read zeros and are masked by the caller)."""
    pos = qb * BLOCK + tl.arange(0, BLOCK)
    row_ok = (pos >= P) & (pos < P + Tq)
    qi = pos - P
    mask = row_ok[:, None] & (d[None, :] < D)
    q = tl.load(q_ptr + b * sqb + h * sqh + qi[:, None] * sqt + d[None, :], mask=mask, other=0.0)
    row = (b * HQ + h) * Tq + qi
    do = tl.load(do_ptr + row[:, None] * D + d[None, :], mask=mask, other=0.0).to(q.dtype)
    acc_t = tl.float64 if q.dtype == tl.float64 else tl.float32
    lse = tl.load(lse_ptr + row, mask=row_ok, other=0.0).to(acc_t)
    delta = tl.load(delta_ptr + row, mask=row_ok, other=0.0).to(acc_t)
    c = tl.load(tau_ptr + h).to(acc_t) / (pos + 1).to(acc_t)
    return pos, row_ok, q, do, lse, delta, c


def _dq_kernel(
    q_ptr, k_ptr, v_ptr, bias_ptr, tau_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr,
    sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sbias,
    scale, P, Tq, Tk, last, HQ, G, D,
    BLOCK: tl.constexpr, BD: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    i_blk, bh = tl.program_id(0), tl.program_id(1)
    b, h = (bh // HQ).to(tl.int64), bh % HQ
    hk = h // G
    qb = P // BLOCK + i_blk
    d = tl.arange(0, BD)
    pos, row_ok, q, do, lse, delta, c = _load_rows(
        q_ptr, do_ptr, lse_ptr, delta_ptr, tau_ptr, b, h, qb, P, Tq, HQ, D, sqb, sqh, sqt, d, BLOCK
    )
    k_base = b * skb + hk * skh
    v_base = b * svb + hk * svh
    dq = tl.zeros([BLOCK, BD], lse.dtype)
    for J in range(0, qb + 1):
        kpos = J * BLOCK + tl.arange(0, BLOCK)
        ds, w = _ds_tile(q, do, lse, delta, c, pos, kpos, d, k_ptr, v_ptr, bias_ptr, k_base, v_base, skt, svt, D, Tk,
                         h * sbias, last, scale, PREC)  # fmt: skip
        k = tl.load(k_ptr + k_base + kpos[:, None] * skt + d[None, :], mask=(kpos[:, None] < Tk) & (d[None, :] < D))
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PREC).to(dq.dtype)
    qi = pos - P
    row = (b * HQ + h) * Tq + qi
    tl.store(dq_ptr + row[:, None] * D + d[None, :], (dq * scale).to(dq_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (d[None, :] < D))  # fmt: skip


def _dkv_kernel(
    q_ptr, k_ptr, v_ptr, bias_ptr, tau_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr,
    sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sbias,
    scale, P, Tq, Tk, last, HQ, G, D,
    BLOCK: tl.constexpr, BD: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    j_blk, bhk = tl.program_id(0), tl.program_id(1)
    HK = HQ // G
    b, hk = (bhk // HK).to(tl.int64), bhk % HK
    J = j_blk
    kpos = J * BLOCK + tl.arange(0, BLOCK)
    d = tl.arange(0, BD)
    k_ok = kpos < Tk
    kmask = k_ok[:, None] & (d[None, :] < D)
    k_base = b * skb + hk * skh
    v_base = b * svb + hk * svh
    k = tl.load(k_ptr + k_base + kpos[:, None] * skt + d[None, :], mask=kmask, other=0.0)
    acc_t = tl.float64 if k.dtype == tl.float64 else tl.float32
    dk = tl.zeros([BLOCK, BD], acc_t)
    dv = tl.zeros([BLOCK, BD], acc_t)
    i_start = tl.maximum(J, P // BLOCK)
    i_end = tl.cdiv(P + Tq, BLOCK)
    for g in range(0, G):
        h = hk * G + g
        for qb in range(i_start, i_end):
            pos, row_ok, q, do, lse, delta, c = _load_rows(
                q_ptr, do_ptr, lse_ptr, delta_ptr, tau_ptr, b, h, qb, P, Tq, HQ, D, sqb, sqh, sqt, d, BLOCK
            )
            ds, w = _ds_tile(q, do, lse, delta, c, pos, kpos, d, k_ptr, v_ptr, bias_ptr, k_base, v_base, skt, svt, D,
                             Tk, h * sbias, last, scale, PREC)  # fmt: skip
            ds = tl.where(row_ok[:, None], ds, 0.0)
            w = tl.where(row_ok[:, None], w, 0.0)
            dv += tl.dot(tl.trans(w).to(do.dtype), do, input_precision=PREC).to(acc_t)
            dk += tl.dot(tl.trans(ds).to(q.dtype), q, input_precision=PREC).to(acc_t)
    row = (b * HK + hk) * Tk + kpos
    tl.store(dk_ptr + row[:, None] * D + d[None, :], (dk * scale).to(dk_ptr.dtype.element_ty), mask=kmask)
    tl.store(dv_ptr + row[:, None] * D + d[None, :], dv.to(dv_ptr.dtype.element_ty), mask=kmask)


def _dbias_kernel(
    q_ptr, k_ptr, v_ptr, bias_ptr, tau_ptr, do_ptr, lse_ptr, delta_ptr, part_ptr,
    sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sbias,
    scale, P, Tq, Tk, last, HQ, G, D, B,
    BLOCK: tl.constexpr, BD: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    e, h = tl.program_id(0), tl.program_id(1)
    n_diag = tl.num_programs(0)
    hk = h // G
    d = tl.arange(0, BD)
    acc_t = tl.float64 if q_ptr.dtype.element_ty == tl.float64 else tl.float32
    z = tl.zeros([BLOCK, BLOCK], acc_t)  # the diagonal's ds tiles, summed: entry (a, b) is distance e * BLOCK + a - b
    i_start = tl.maximum(e, P // BLOCK)
    i_end = tl.cdiv(P + Tq, BLOCK)
    for b32 in range(0, B):
        b = tl.cast(b32, tl.int64)
        k_base = b * skb + hk * skh
        v_base = b * svb + hk * svh
        for qb in range(i_start, i_end):
            pos, row_ok, q, do, lse, delta, c = _load_rows(
                q_ptr, do_ptr, lse_ptr, delta_ptr, tau_ptr, b, h, qb, P, Tq, HQ, D, sqb, sqh, sqt, d, BLOCK
            )
            kpos = (qb - e) * BLOCK + tl.arange(0, BLOCK)
            ds, w = _ds_tile(q, do, lse, delta, c, pos, kpos, d, k_ptr, v_ptr, bias_ptr, k_base, v_base, skt, svt, D,
                             Tk, h * sbias, last, scale, PREC)  # fmt: skip
            z += tl.where(row_ok[:, None], ds, 0.0)
    r = tl.arange(0, BLOCK)
    base = (h.to(tl.int64) * n_diag + e) * BLOCK * BLOCK
    tl.store(part_ptr + base + r[:, None] * BLOCK + r[None, :], z.to(part_ptr.dtype.element_ty))


_KERNELS: dict[bool, dict[str, Any]] = {}
_HELPERS = ("_scores", "_probs", "_ds_tile", "_load_rows")
_LAUNCHED = ("_fwd_kernel", "_dq_kernel", "_dkv_kernel", "_dbias_kernel")


def _kernels() -> dict[str, Any]:
    """The kernels, jitted once per interpreter mode."""
    return jit_kernels(globals(), _HELPERS + _LAUNCHED, _KERNELS)


def tile_configs(kernel: str, capability: tuple[int, int] | None, bd: int, dtype: torch.dtype) -> list[TileConfig]:
    """Launch candidates of ``kernel`` (one of ``_LAUNCHED``) on ``capability`` (None: the interpreter), best first.
    The kernels take one BLOCK for query and key tiles (block_m == block_n)."""
    return family_tiles(capability, bd, dtype)


def _launch(name: str, q: Tensor, bd: int, block: int, launch: Callable[[TileConfig], R]) -> R:
    """``launch`` with the selected tile configuration (``block`` > 0: that tile size, the tests)."""
    configs = tile_configs(name, capability(q.device), bd, q.dtype)
    if block:
        configs = list(dict.fromkeys(dataclasses.replace(c, block_m=block, block_n=block) for c in configs))
    return launch_tiles(f"lazy.{name}", q.device, bd, q.dtype, configs, launch)


# ---------------------------------------------------------------------------------------------------------------------
# launches, as custom ops


def _geometry(q: Tensor, k: Tensor, block: int) -> tuple[int, int, int, int, int]:
    batch, hq, tq, dim = q.shape
    tk = k.shape[2]
    p = tk - tq
    n_rows = -(-(p + tq) // block) - p // block  # query blocks, aligned to positions
    return p, n_rows, -(-tk // block), padded(dim), hq // k.shape[1]


@torch.library.custom_op("lazy_triton::forward", mutates_args=())
def _forward_op(
    q: Tensor, k: Tensor, v: Tensor, bias: Tensor, tau: Tensor, scale: float, last: int, block: int
) -> tuple[Tensor, Tensor, Tensor]:
    """(out, lse, a) in the accumulator dtype; out and a are [B, H, Tq, D], lse [B, H, Tq]."""
    q, k, v, bias = (last_contiguous(x) for x in (q, k, v, bias))
    batch, hq, tq, dim = q.shape
    acc = acc_dtype(q)
    out = torch.empty(batch, hq, tq, dim, dtype=acc, device=q.device)
    a = torch.empty_like(out)
    lse = torch.empty(batch, hq, tq, dtype=acc, device=q.device)
    bd = padded(dim)

    def launch(tiles: TileConfig) -> None:
        p, n_rows, _, _, group = _geometry(q, k, tiles.block_m)
        _kernels()["_fwd_kernel"][(n_rows, batch * hq)](
            q, k, v, bias, tau, out, lse, a, *strides(q, k, v), bias.stride(0),
            scale, p, tq, k.shape[2], last, hq, group, dim,
            BLOCK=tiles.block_m, BD=bd, PREC=precision(q), **tiles.options(),
        )  # fmt: skip

    _launch("_fwd_kernel", q, bd, block, launch)
    return out, lse, a


@_forward_op.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, bias: Tensor, tau: Tensor, scale: float, last: int, block: int) -> Any:
    out = q.new_empty(q.shape, dtype=acc_dtype(q))
    return out, q.new_empty(q.shape[:3], dtype=out.dtype), torch.empty_like(out)


@torch.library.custom_op("lazy_triton::backward", mutates_args=())
def _backward_op(
    grad: Tensor, q: Tensor, k: Tensor, v: Tensor, bias: Tensor, tau: Tensor, out: Tensor, lse: Tensor, a: Tensor,
    scale: float, last: int, block: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """dq, dk, dv, d bias, d tau."""
    q, k, v, bias = (last_contiguous(x) for x in (q, k, v, bias))
    batch, hq, tq, dim = q.shape
    p, bd, group = k.shape[2] - tq, padded(dim), hq // k.shape[1]
    acc = acc_dtype(q)
    do = grad.to(acc).contiguous()
    n = torch.arange(p + 1, p + tq + 1, device=q.device, dtype=acc)
    c = tau.to(acc)[None, :, None] / n
    delta = (do * (out + c[..., None] * a)).sum(-1)  # D_i = sum over the support of p * da
    dtau = -((do * a).sum(-1) / n).sum((0, 2))  # dc_i = -do_i . a_i, dtau_h = sum_i dc_i / n_i
    dq = torch.empty(q.shape, dtype=acc, device=q.device)
    dk = torch.empty(k.shape, dtype=acc, device=q.device)
    dv = torch.empty(v.shape, dtype=acc, device=q.device)
    common = (*strides(q, k, v), bias.stride(0), scale, p, tq, k.shape[2], last, hq, group, dim)
    kernels = _kernels()

    def meta(tiles: TileConfig) -> dict[str, Any]:
        return dict(BLOCK=tiles.block_m, BD=bd, PREC=precision(q), **tiles.options())

    def launch_dq(tiles: TileConfig) -> None:
        n_rows = _geometry(q, k, tiles.block_m)[1]
        kernels["_dq_kernel"][(n_rows, batch * hq)](q, k, v, bias, tau, do, lse, delta, dq, *common, **meta(tiles))

    def launch_dkv(tiles: TileConfig) -> None:
        n_keys = _geometry(q, k, tiles.block_m)[2]
        kernels["_dkv_kernel"][(n_keys, batch * k.shape[1])](
            q, k, v, bias, tau, do, lse, delta, dk, dv, *common, **meta(tiles)
        )

    def launch_dbias(tiles: TileConfig) -> tuple[Tensor, int, int]:
        block = tiles.block_m
        n_diag = -(-(p + tq) // block)  # block diagonals e = I - J with a visible pair
        partials = torch.empty(hq, n_diag, block, block, dtype=acc, device=q.device)
        kernels["_dbias_kernel"][(n_diag, hq)](
            q, k, v, bias, tau, do, lse, delta, partials, *common, batch, **meta(tiles)
        )
        return partials, n_diag, block

    _launch("_dq_kernel", q, bd, block, launch_dq)
    _launch("_dkv_kernel", q, bd, block, launch_dkv)
    partials, n_diag, tile = _launch("_dbias_kernel", q, bd, block, launch_dbias)
    dbias = torch.zeros(bias.shape, dtype=acc, device=q.device)
    dbias.index_add_(1, _distances(n_diag, tile, last, q.device), -partials.reshape(hq, -1))
    return dq, dk, dv, dbias, dtau


@_backward_op.register_fake
def _(
    grad: Tensor, q: Tensor, k: Tensor, v: Tensor, bias: Tensor, tau: Tensor, out: Tensor, lse: Tensor, a: Tensor,
    scale: float, last: int, block: int,
) -> Any:  # fmt: skip
    acc = acc_dtype(q)
    return (q.new_empty(q.shape, dtype=acc), q.new_empty(k.shape, dtype=acc), q.new_empty(v.shape, dtype=acc),
            q.new_empty(bias.shape, dtype=acc), q.new_empty(tau.shape, dtype=acc))  # fmt: skip


def _distances(n_diag: int, block: int, last: int, device: torch.device) -> Tensor:
    """The table index of each partials entry (e, a, b): distance e * block + a - b, clamped to [0, last] (entries
    in the future hold 0)."""
    r = torch.arange(block, device=device)
    e = torch.arange(n_diag, device=device)
    return (e[:, None, None] * block + r[None, :, None] - r[None, None, :]).clamp(0, last).reshape(-1)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor, Tensor]) -> None:
    q, k, v, bias, tau, scale, last, block = inputs
    out, lse, a = output
    ctx.save_for_backward(q, k, v, bias, tau, out, lse, a)
    ctx.meta = (scale, last, block)


def _backward(ctx: Any, grad: Tensor, grad_lse: Tensor | None, grad_a: Tensor | None) -> tuple[Any, ...]:
    q, k, v, bias, tau, out, lse, a = ctx.saved_tensors
    dq, dk, dv, dbias, dtau = _backward_op(grad, q, k, v, bias, tau, out, lse, a, *ctx.meta)
    return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dbias.to(bias.dtype), dtau.to(tau.dtype), None, None,
            None)  # fmt: skip


_forward_op.register_autograd(_backward, setup_context=_setup_context)


def elastic_triton(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    distance_bias: Tensor,
    tau: Tensor,
    scale: float,
    last: int,
    block: int | None = None,
) -> Tensor:
    """sum_j relu(softmax_j(s_ij) - tau_h / (i + 1)) v_j, s = q.k * scale - bias[h, clamp(i - j, 0, last)], for
    queries ``q [B, H, Tq, D]`` at positions ``Tk - Tq .. Tk - 1`` over keys ``k, v [B, H_kv, Tk, D]`` at ``0 ..
    Tk - 1`` (H a multiple of H_kv). ``[B, H, Tq, D]`` in q's dtype. ``block``: a fixed tile size (the tests);
    by default each kernel's tiles come from ``tile_configs`` for the device."""
    out, _, _ = _forward_op(q, k, v, distance_bias, tau, float(scale), int(last), int(block or 0))
    return out.to(q.dtype)
