"""Lazy attention's fused CUDA path: Triton kernels for Elastic-Softmax, forward and backward (issues 38, 47).

Queries at positions ``P .. P + Tq - 1`` (``P = Tk - Tq`` as ``fast`` receives them: training has P = 0, context
parallelism and chunked prefill P > 0) attend keys ``0 .. Tk - 1``; ``s = q.k * scale - b_h[clamp(i - j, 0, last)]``,
``p = softmax_j(s)``, ``w_ij = relu(p_ij - c_i)`` with ``c_i = tau_h / (i + 1)``, ``out_i = sum_j w_ij v_j``.

Tiling. A tile is ``BLOCK_M`` query rows by ``BLOCK_N`` keys (they may differ; each kernel gets its own
``TileConfig`` from ``tile_configs``). Blocks are aligned to absolute positions (query block I holds positions
``I * BLOCK_M ..``; rows before P or past the last query are masked), so tile (I, J) sees the distances
``I * BLOCK_M - J * BLOCK_N + a - b``: at most ``BLOCK_M + BLOCK_N - 1`` distinct ones. The bias is read as that
vector (``W`` = the next power of two, one load per distance) and expanded to the tile in registers
(``tl.gather``). GQA: query head h reads key/value head ``h // G``.

Tile products (``tl.dot``) per tile, the budget of issue 47 (``TILE_PRODUCTS``, pinned by a test on the source):

- Forward, one program per query block and (batch, head). ``tau_h > 0``: pass 1 is the online logsumexp of the
  biased scores (QK only); pass 2 recomputes the tile, ``w = relu(exp(s - lse) - c)``, ``o += w @ v`` and, only
  when a gradient is needed, ``a += 1[w > 0] @ v``: 3 products, 4 in training. ``tau_h <= 0``: the relu never
  fires (``p - c > 0`` on every visible key), so one pass: online softmax ``e @ v`` and, for ``tau_h < 0``, the
  running ``1[visible] @ v``; ``out = softmax_out - c * a``: 2-3 products. The first query (position 0) sees one key:
  its p is exactly 1 (as the reference: at tau = 1 that weight sits on the threshold, weight and gradient 0).
  Saved for the backward: ``lse`` (float32) and ``u = sum_j p_ij 1[w_ij > 0] v_j = out + c * a`` in q's dtype
  (for ``tau_h <= 0``, u is the softmax output itself); ``out`` is returned in q's dtype.
- Backward. With ``m = 1[w > 0]`` and ``dp_ij = do_i . v_j``: ``ds = p * (m * dp - D)``, ``D_i = sum_j p m dp =
  do_i . u_i``, ``dc_i = -sum_j m dp`` (so ``dtau_h = -sum_{b, i} sum_j m_ij dp_ij / (i + 1)``), ``d bias`` the
  negated sums of ``ds`` along each distance.
  ``dq`` kernel (a program per query block): ``D_i`` from the rows of dO and u (written for dkv), then per tile
  QK, ``dp = do @ v^T``, ``dq += ds @ k``: 3 products; the row sums ``sum_j m dp`` give d tau, written once per
  program (a scalar). ``dk, dv`` kernel (a program per key block and (batch, key/value head), looping over the G
  query heads of its group): QK^T, ``dp^T``, ``dv += w^T @ do``, ``dk += ds^T @ q``: 4 products, written once.
  d bias is folded into it: the diagonal sums of each ``ds`` tile (a circular skew by ``tl.gather`` and two column
  sums, no product; ``BLOCK_N <= BLOCK_M``) run along the key block's contiguous distance range; each tile writes the
  ``BLOCK_M`` sums that no later tile of the program touches, the last writes the rest. Partials: ``BLOCK_M``
  floats per tile (``[B * H, sum_J (n_tiles_J * BLOCK_M + W - BLOCK_M)]``, about ``B * H * T^2 / (2 * BLOCK_N)``),
  folded onto the table by distance in torch. No atomics anywhere.
  Backward total: 7 products per tile.

Why the forward needs a fourth product in training (issue 47 asked for fwd <= 3 and bwd <= 7). Every ``ds``
needs the row constant ``D_i = do_i . u_i``. u_i weighs v_j by ``p_ij m_ij``; out_i by ``p_ij m_ij - c_i m_ij``:
two different combinations of the rows of V, and ``a_i = sum_j m_ij v_j`` is not recoverable from out_i, lse_i
(m depends on the final lse, so pass 1 cannot build it either). Without u from the forward, D_i is a full-row
reduction of backward quantities (``sum_j p m dp``, available in the dq sweep), while both backward kernels need it
*before* forming any ds: the dq kernel can then only split ``dq_i = sum_j p m dp k_j - D_i sum_j p_ij k_j`` (a fourth
product ``p @ K``), and the dk/dv kernel (a key block sees a row only partially) must wait for it. So fwd 3 + bwd 7
is not reached by this decomposition: it is fwd 4 + bwd 7 in training (fwd 3 without a gradient; 2-3 for
``tau <= 0`` heads) or fwd 3 + bwd 8; this module takes the first (the same 11 per training step, and the
inference forward keeps 3). d tau needs no product: it is the row sums of ``m * dp`` that the dq kernel has.

Arithmetic: float32 accumulators (float64 for float64 inputs: the interpreter tests), ``ieee`` dots for float32 and
float64 inputs (bf16 / fp16 inputs use the tensor cores as they are); dO, out and u stay in q's dtype. ``triton`` is
imported lazily: this module imports without it (``available()`` says whether the path can run); the kernels are
``triton.jit``-ed on first use, once per interpreter mode (``TRITON_INTERPRET=1`` runs them on CPU tensors: the
tests). The launches are the custom ops ``lazy_triton::forward`` / ``lazy_triton::backward`` so a compiled block
traces them as one opaque node.
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
    sm100_rows,
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

# tile products (tl.dot) per tile in each kernel's loop bodies: (loop, products); tests count them in the source
TILE_PRODUCTS = {
    "_fwd_kernel": {"one pass (tau <= 0)": 3, "pass 1 (tau > 0)": 1, "pass 2 (tau > 0)": 3},
    "_dq_kernel": {"tiles": 3},
    "_dkv_kernel": {"tiles": 4},
}


R = TypeVar("R")


# ---------------------------------------------------------------------------------------------------------------------
# kernels (plain functions, jitted by _kernels())


def _bias_vector(bias_ptr, h_bias, off, last, BLOCK_N: tl.constexpr, W: tl.constexpr):
    """The bias of the tile's distances ``off - BLOCK_N + 1 + k`` (k < W; clamped to the table), one load each."""
    k = tl.arange(0, W)
    return tl.load(bias_ptr + h_bias + tl.minimum(tl.maximum(off - (BLOCK_N - 1) + k, 0), last))


def _expand(vec, rows, cols, ROWS: tl.constexpr, COLS: tl.constexpr):
    """The [ROWS, COLS] tile whose entry (r, c) is ``vec[rows[r] + cols[c]]`` (the pair's distance index), expanded
    in registers from the W distinct values (a flat gather: the compiler stages the vector, not a broadcast tile)."""
    index = tl.reshape(rows[:, None] + cols[None, :], [ROWS * COLS])
    return tl.reshape(tl.gather(vec, index, 0), [ROWS, COLS])


def _scores(q, k_ptr, bias_ptr, kpos, pos, d, k_base, skt, D, Tk, h_bias, off, last, scale,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, W: tl.constexpr, PREC: tl.constexpr):  # fmt: skip
    """[BLOCK_M, BLOCK_N] biased scores of a tile (-inf off the causal and key-range mask), the mask, and k^T."""
    k_ok = kpos < Tk
    kt = tl.load(k_ptr + k_base + kpos[None, :] * skt + d[:, None], mask=k_ok[None, :] & (d[:, None] < D), other=0.0)
    s = tl.dot(q, kt, input_precision=PREC).to(q.dtype if q.dtype == tl.float64 else tl.float32) * scale
    bvec = _bias_vector(bias_ptr, h_bias, off, last, BLOCK_N, W).to(s.dtype)
    a = tl.arange(0, BLOCK_M)
    b = (BLOCK_N - 1) - tl.arange(0, BLOCK_N)
    s = s - _expand(bvec, a, b, BLOCK_M, BLOCK_N)
    vis = (kpos[None, :] <= pos[:, None]) & k_ok[None, :]
    return tl.where(vis, s, float("-inf")), vis, kt


def _probs(s, lse, pos, c, vis):
    """p = exp(s - lse) (exactly 1 for the first query), the kept mask and w = relu(p - c) on the visible keys."""
    p = tl.exp(s - lse[:, None])
    p = tl.where(pos[:, None] == 0, 1.0, p)
    w = p - c[:, None]
    keep = vis & (w > 0)
    return p, keep, tl.where(keep, w, 0.0)


def _n_key_blocks(qb, Tk, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Key blocks a query block sees: up to its last row's position, within the keys."""
    return tl.minimum(((qb + 1) * BLOCK_M - 1) // BLOCK_N + 1, tl.cdiv(Tk, BLOCK_N))


def _fwd_kernel(
    q_ptr, k_ptr, v_ptr, bias_ptr, tau_ptr, o_ptr, lse_ptr, u_ptr,
    sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sbias,
    scale, P, Tq, Tk, last, HQ, G, D,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BD: tl.constexpr, W: tl.constexpr, PREC: tl.constexpr,
    NEED_U: tl.constexpr,
):  # fmt: skip
    i_blk, bh = tl.program_id(0), tl.program_id(1)
    b, h = (bh // HQ).to(tl.int64), bh % HQ
    hk = h // G
    qb = P // BLOCK_M + i_blk
    pos = qb * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = (pos >= P) & (pos < P + Tq)
    d = tl.arange(0, BD)
    qi = pos - P
    q = tl.load(
        q_ptr + b * sqb + h * sqh + qi[:, None] * sqt + d[None, :], mask=row_ok[:, None] & (d[None, :] < D), other=0.0
    )
    acc_t = tl.float64 if q.dtype == tl.float64 else tl.float32
    k_base = b * skb + hk * skh
    v_base = b * svb + hk * svh
    h_bias = h * sbias
    tau = tl.load(tau_ptr + h).to(acc_t)
    c = tau / (pos + 1).to(acc_t)
    m = tl.full([BLOCK_M], float("-inf"), acc_t)
    den = tl.zeros([BLOCK_M], acc_t)
    o = tl.zeros([BLOCK_M, BD], acc_t)
    a = tl.zeros([BLOCK_M, BD], acc_t)
    n_j = _n_key_blocks(qb, Tk, BLOCK_M, BLOCK_N)
    if tau <= 0:  # the relu never fires: softmax attention + |c| * sum_j v_j, in one pass
        for J in range(0, n_j):
            kpos = J * BLOCK_N + tl.arange(0, BLOCK_N)
            off = qb * BLOCK_M - J * BLOCK_N
            s, vis, kt = _scores(q, k_ptr, bias_ptr, kpos, pos, d, k_base, skt, D, Tk, h_bias, off, last, scale,
                                 BLOCK_M, BLOCK_N, W, PREC)  # fmt: skip
            m_new = tl.maximum(m, tl.max(s, 1))
            r = tl.exp(m - m_new)
            e = tl.exp(s - m_new[:, None])
            den = den * r + tl.sum(e, 1)
            m = m_new
            vt = tl.load(
                v_ptr + v_base + kpos[:, None] * svt + d[None, :], mask=(kpos[:, None] < Tk) & (d[None, :] < D)
            )
            o = o * r[:, None] + tl.dot(e.to(vt.dtype), vt, input_precision=PREC).to(acc_t)
            if tau < 0:  # tau = 0: c = 0, nothing to add
                a += tl.dot(vis.to(vt.dtype), vt, input_precision=PREC).to(acc_t)
        lse = m + tl.log(den)
        u = o / den[:, None]  # = sum_j p_ij v_j: every visible weight is kept
        o = u - c[:, None] * a
    else:  # pass 1: the row logsumexp; pass 2: relu(p - c) @ v
        for J in range(0, n_j):
            kpos = J * BLOCK_N + tl.arange(0, BLOCK_N)
            off = qb * BLOCK_M - J * BLOCK_N
            s, vis, kt = _scores(q, k_ptr, bias_ptr, kpos, pos, d, k_base, skt, D, Tk, h_bias, off, last, scale,
                                 BLOCK_M, BLOCK_N, W, PREC)  # fmt: skip
            m_new = tl.maximum(m, tl.max(s, 1))
            den = den * tl.exp(m - m_new) + tl.sum(tl.exp(s - m_new[:, None]), 1)
            m = m_new
        lse = m + tl.log(den)
        for J in range(0, n_j):
            kpos = J * BLOCK_N + tl.arange(0, BLOCK_N)
            off = qb * BLOCK_M - J * BLOCK_N
            s, vis, kt = _scores(q, k_ptr, bias_ptr, kpos, pos, d, k_base, skt, D, Tk, h_bias, off, last, scale,
                                 BLOCK_M, BLOCK_N, W, PREC)  # fmt: skip
            p, keep, w = _probs(s, lse, pos, c, vis)
            vt = tl.load(
                v_ptr + v_base + kpos[:, None] * svt + d[None, :], mask=(kpos[:, None] < Tk) & (d[None, :] < D)
            )
            o += tl.dot(w.to(vt.dtype), vt, input_precision=PREC).to(acc_t)
            if NEED_U:  # what the backward's D_i needs: sum_j 1[w > 0] v_j
                a += tl.dot(keep.to(vt.dtype), vt, input_precision=PREC).to(acc_t)
        u = o + c[:, None] * a
    row = (b * HQ + h) * Tq + qi
    out_mask = row_ok[:, None] & (d[None, :] < D)
    tl.store(o_ptr + row[:, None] * D + d[None, :], o.to(o_ptr.dtype.element_ty), mask=out_mask)
    tl.store(lse_ptr + row, lse.to(lse_ptr.dtype.element_ty), mask=row_ok)
    if NEED_U:
        tl.store(u_ptr + row[:, None] * D + d[None, :], u.to(u_ptr.dtype.element_ty), mask=out_mask)


def _dq_kernel(
    q_ptr, k_ptr, v_ptr, bias_ptr, tau_ptr, do_ptr, u_ptr, lse_ptr, delta_ptr, dq_ptr, dtau_ptr,
    sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sbias,
    scale, P, Tq, Tk, last, HQ, G, D,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BD: tl.constexpr, W: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    i_blk, bh = tl.program_id(0), tl.program_id(1)
    b, h = (bh // HQ).to(tl.int64), bh % HQ
    hk = h // G
    qb = P // BLOCK_M + i_blk
    d = tl.arange(0, BD)
    pos = qb * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = (pos >= P) & (pos < P + Tq)
    qi = pos - P
    mask = row_ok[:, None] & (d[None, :] < D)
    q = tl.load(q_ptr + b * sqb + h * sqh + qi[:, None] * sqt + d[None, :], mask=mask, other=0.0)
    acc_t = tl.float64 if q.dtype == tl.float64 else tl.float32
    row = (b * HQ + h) * Tq + qi
    do = tl.load(do_ptr + row[:, None] * D + d[None, :], mask=mask, other=0.0)
    u = tl.load(u_ptr + row[:, None] * D + d[None, :], mask=mask, other=0.0)
    delta = tl.sum(do.to(acc_t) * u.to(acc_t), 1)  # D_i = do_i . u_i = sum_j p m dp
    tl.store(delta_ptr + row, delta.to(delta_ptr.dtype.element_ty), mask=row_ok)
    lse = tl.load(lse_ptr + row, mask=row_ok, other=0.0).to(acc_t)
    c = tl.load(tau_ptr + h).to(acc_t) / (pos + 1).to(acc_t)
    k_base = b * skb + hk * skh
    v_base = b * svb + hk * svh
    dq = tl.zeros([BLOCK_M, BD], acc_t)
    g = tl.zeros([BLOCK_M], acc_t)  # sum_j m dp = -dc_i
    for J in range(0, _n_key_blocks(qb, Tk, BLOCK_M, BLOCK_N)):
        kpos = J * BLOCK_N + tl.arange(0, BLOCK_N)
        off = qb * BLOCK_M - J * BLOCK_N
        s, vis, kt = _scores(q, k_ptr, bias_ptr, kpos, pos, d, k_base, skt, D, Tk, h * sbias, off, last, scale,
                             BLOCK_M, BLOCK_N, W, PREC)  # fmt: skip
        p, keep, w = _probs(s, lse, pos, c, vis)
        vt = tl.load(v_ptr + v_base + kpos[None, :] * svt + d[:, None], mask=(kpos[None, :] < Tk) & (d[:, None] < D))
        dp = tl.where(keep, tl.dot(do, vt, input_precision=PREC).to(acc_t), 0.0)
        g += tl.sum(dp, 1)
        ds = tl.where(vis, p * (dp - delta[:, None]), 0.0)
        dq += tl.dot(ds.to(kt.dtype), tl.trans(kt), input_precision=PREC).to(acc_t)
    tl.store(dq_ptr + row[:, None] * D + d[None, :], (dq * scale).to(dq_ptr.dtype.element_ty), mask=mask)
    # d tau_h = -sum_i g_i / n_i: this program's share, one scalar
    share = tl.sum(tl.where(row_ok, g / (pos + 1).to(acc_t), 0.0), 0)
    tl.store(dtau_ptr + bh.to(tl.int64) * tl.num_programs(0) + i_blk, share.to(dtau_ptr.dtype.element_ty))


def _dkv_kernel(
    q_ptr, k_ptr, v_ptr, bias_ptr, tau_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, part_ptr, part_base_ptr,
    sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sbias,
    scale, P, Tq, Tk, last, HQ, G, D, part_len,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BD: tl.constexpr, W: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    j_blk, bhk = tl.program_id(0), tl.program_id(1)
    HK = HQ // G
    b, hk = (bhk // HK).to(tl.int64), bhk % HK
    J = j_blk
    kpos = J * BLOCK_N + tl.arange(0, BLOCK_N)
    d = tl.arange(0, BD)
    k_ok = kpos < Tk
    kmask = k_ok[:, None] & (d[None, :] < D)
    k = tl.load(k_ptr + b * skb + hk * skh + kpos[:, None] * skt + d[None, :], mask=kmask, other=0.0)
    v = tl.load(v_ptr + b * svb + hk * svh + kpos[:, None] * svt + d[None, :], mask=kmask, other=0.0)
    acc_t = tl.float64 if k.dtype == tl.float64 else tl.float32
    dk = tl.zeros([BLOCK_N, BD], acc_t)
    dv = tl.zeros([BLOCK_N, BD], acc_t)
    i_start = tl.maximum((J * BLOCK_N) // BLOCK_M, P // BLOCK_M)
    i_end = tl.cdiv(P + Tq, BLOCK_M)
    # d bias: the tile's entry (key r, query c) lies on diagonal index k = c - r + BLOCK_N - 1 (< W); ``diag`` holds
    # the running sums along this key block's distances, from part_base[J] (the first tile's lowest distance) on.
    # The sums come from a circular skew: column j of ``tile[r, (j + r) % BLOCK_M]`` holds diagonal j + BLOCK_N - 1
    # where j + r < BLOCK_M, else j + BLOCK_N - 1 - BLOCK_M (block_n <= block_m: one wrap at most); a flat gather
    # stages the tile once.
    r_idx = tl.arange(0, BLOCK_N)
    jj = tl.arange(0, BLOCK_M)
    wraps = (jj[None, :] + r_idx[:, None]) >= BLOCK_M
    circ = tl.reshape(r_idx[:, None] * BLOCK_M + (jj[None, :] + r_idx[:, None]) % BLOCK_M, [BLOCK_N * BLOCK_M])
    kk = tl.arange(0, W)
    at_straight = kk - (BLOCK_N - 1)  # column j holding diagonal k without a wrap
    at_wrapped = kk - (BLOCK_N - 1) + BLOCK_M
    straight_ok = (at_straight >= 0) & (at_straight < BLOCK_M)
    wrapped_ok = at_wrapped < BLOCK_M
    at_straight = tl.minimum(tl.maximum(at_straight, 0), BLOCK_M - 1)
    at_wrapped = tl.minimum(at_wrapped, BLOCK_M - 1)
    shift = tl.minimum(kk + BLOCK_M, W - 1)
    part_at = tl.load(part_base_ptr + J)
    c_idx = jj + (BLOCK_N - 1)
    for g in range(0, G):
        h = hk * G + g
        tau = tl.load(tau_ptr + h).to(acc_t)
        diag = tl.zeros([W], acc_t)
        part_row = part_ptr + (b * HQ + h) * part_len + part_at
        for qb in range(i_start, i_end):
            pos = qb * BLOCK_M + tl.arange(0, BLOCK_M)
            row_ok = (pos >= P) & (pos < P + Tq)
            qi = pos - P
            qt = tl.load(q_ptr + b * sqb + h * sqh + qi[None, :] * sqt + d[:, None],
                         mask=row_ok[None, :] & (d[:, None] < D), other=0.0)  # fmt: skip
            row = (b * HQ + h) * Tq + qi
            do = tl.load(do_ptr + row[:, None] * D + d[None, :], mask=row_ok[:, None] & (d[None, :] < D), other=0.0)
            lse = tl.load(lse_ptr + row, mask=row_ok, other=0.0).to(acc_t)
            delta = tl.load(delta_ptr + row, mask=row_ok, other=0.0).to(acc_t)
            c = tau / (pos + 1).to(acc_t)
            off = qb * BLOCK_M - J * BLOCK_N
            bvec = _bias_vector(bias_ptr, h * sbias, off, last, BLOCK_N, W).to(acc_t)
            st = tl.dot(k, qt, input_precision=PREC).to(acc_t) * scale - _expand(bvec, -r_idx, c_idx, BLOCK_N, BLOCK_M)
            vis = (kpos[:, None] <= pos[None, :]) & k_ok[:, None] & row_ok[None, :]
            # p is 0 off the mask (and exactly 1 for the first query's one key), so w and ds are too
            pt = tl.where(vis & (pos[None, :] == 0), 1.0, tl.exp(tl.where(vis, st, float("-inf")) - lse[None, :]))
            wt = tl.where(vis, tl.maximum(pt - c[None, :], 0.0), 0.0)
            dv += tl.dot(wt.to(do.dtype), do, input_precision=PREC).to(acc_t)
            dpt = tl.where(wt > 0, tl.dot(v, tl.trans(do), input_precision=PREC).to(acc_t), 0.0)
            dst = pt * (dpt - delta[None, :])
            dk += tl.dot(dst.to(qt.dtype), tl.trans(qt), input_precision=PREC).to(acc_t)
            skewed = tl.reshape(tl.gather(tl.reshape(dst, [BLOCK_N * BLOCK_M]), circ, 0), [BLOCK_N, BLOCK_M])
            straight = tl.sum(tl.where(wraps, 0.0, skewed), 0)
            wrapped = tl.sum(tl.where(wraps, skewed, 0.0), 0)
            diag += tl.where(straight_ok, tl.gather(straight, at_straight, 0), 0.0)
            diag += tl.where(wrapped_ok, tl.gather(wrapped, at_wrapped, 0), 0.0)
            # the first BLOCK_M sums are final (the next tile starts BLOCK_M distances further): write, shift
            tl.store(part_row + (qb - i_start) * BLOCK_M + kk, diag.to(part_ptr.dtype.element_ty), mask=kk < BLOCK_M)
            diag = tl.where(kk + BLOCK_M < W, tl.gather(diag, shift, 0), 0.0)
        tl.store(part_row + (i_end - i_start) * BLOCK_M + kk, diag.to(part_ptr.dtype.element_ty), mask=kk < W - BLOCK_M)
    row = (b * HK + hk) * Tk + kpos
    tl.store(dk_ptr + row[:, None] * D + d[None, :], (dk * scale).to(dk_ptr.dtype.element_ty), mask=kmask)
    tl.store(dv_ptr + row[:, None] * D + d[None, :], dv.to(dv_ptr.dtype.element_ty), mask=kmask)


_KERNELS: dict[bool, dict[str, Any]] = {}
_HELPERS = ("_bias_vector", "_expand", "_scores", "_probs", "_n_key_blocks")
_LAUNCHED = ("_fwd_kernel", "_dq_kernel", "_dkv_kernel")


def _kernels() -> dict[str, Any]:
    """The kernels, jitted once per interpreter mode."""
    return jit_kernels(globals(), _HELPERS + _LAUNCHED, _KERNELS)


# ---------------------------------------------------------------------------------------------------------------------
# launch parameters


# padded head dim -> kernel -> candidates, best first, per target family: the first has 0 spill bytes (compiled for
# sm_90, sm_80 and sm_86 without a GPU: tests/attention/test_triton_targets.py; the defaults of every target in
# docs/triton-targets.md, the sweep in docs/benchmarks.md "Lazy Triton kernels"); the second asks for less shared
# memory. sm_86-89 take sm_80's rows but one (every candidate fits their 99 KB per block, compiled for sm_86);
# sm_100+ sm_90's, then sm_86's (``sm100_rows``).
_SM90: dict[int, dict[str, tuple[TileConfig, ...]]] = {
    128: {
        "_fwd_kernel": (TileConfig(128, 32, 8, 2), TileConfig(64, 32, 4, 2)),
        "_dq_kernel": (TileConfig(128, 64, 8, 2), TileConfig(128, 32, 8, 2)),
        "_dkv_kernel": (TileConfig(64, 32, 8, 2), TileConfig(32, 32, 4, 2)),
    },
    64: {
        "_fwd_kernel": (TileConfig(128, 64, 8, 2), TileConfig(128, 32, 8, 2)),
        "_dq_kernel": (TileConfig(128, 64, 8, 2), TileConfig(128, 32, 8, 2)),
        "_dkv_kernel": (TileConfig(64, 64, 8, 1), TileConfig(64, 32, 8, 2)),  # 2 stages: 236 B spilled with GQA
    },
}
_SM80: dict[int, dict[str, tuple[TileConfig, ...]]] = {
    128: {
        "_fwd_kernel": (TileConfig(128, 32, 8, 2), TileConfig(64, 32, 4, 2)),
        "_dq_kernel": (TileConfig(128, 32, 8, 2), TileConfig(64, 32, 4, 2)),
        "_dkv_kernel": (TileConfig(64, 32, 8, 2), TileConfig(32, 32, 4, 2)),
    },
    64: {
        "_fwd_kernel": (TileConfig(128, 64, 8, 2), TileConfig(128, 32, 8, 2)),
        "_dq_kernel": (TileConfig(128, 64, 8, 2), TileConfig(128, 32, 8, 2)),
        "_dkv_kernel": (TileConfig(64, 32, 8, 2), TileConfig(64, 32, 4, 2)),
    },
}
# sm_86's ptxas spills 12 B in dq's 128 x 32 tiles at head dim 128 (sm_80's: 0); 128 x 16 keeps 128 rows and 2 stages
# at 0 (78,848 B), 64 x 32 with 8 warps asks for less (53,760 B; 0)
_SM86 = {bd: {**row, "_dq_kernel": (TileConfig(128, 16, 8, 2), TileConfig(64, 32, 8, 2))} if bd == 128 else row
         for bd, row in _SM80.items()}  # fmt: skip
_TILES = {"sm_80": _SM80, "sm_86-89": _SM86, "sm_90": _SM90, "sm_100+": sm100_rows(_SM90, _SM86)}
# float32 / float64 inputs: every kernel at 32 x 32 fits 70 KB at head dim 128 (they spill: a correctness path, not
# a fast one)
_WIDE_TILES = TileConfig(32, 32, 4, 2)
_WIDE = {kernel: (_WIDE_TILES,) for kernel in _LAUNCHED}


def tile_configs(kernel: str, capability: tuple[int, int] | None, bd: int, dtype: torch.dtype) -> list[TileConfig]:
    """Launch candidates of ``kernel`` (one of ``_LAUNCHED``) on ``capability`` (None: the interpreter), best first;
    [] where none is sized (the caller falls back). The dk/dv kernel takes ``block_n <= block_m``."""
    return family_tiles(_TILES, _WIDE, kernel, capability, bd, dtype)


def _candidates(kernel: str, q: Tensor, bd: int, block_m: int, block_n: int) -> list[TileConfig]:
    """The launch candidates of ``kernel`` for ``q``'s device, or ``block_m`` x ``block_n`` tiles (> 0: the tests)
    with the candidates' warps and stages."""
    configs = tile_configs(kernel, capability(q.device), bd, q.dtype)
    if block_m > 0:
        configs = [dataclasses.replace(t, block_m=block_m, block_n=block_n or block_m) for t in configs]
    if kernel == "_dkv_kernel":  # its d bias skew wraps once at most
        configs = [dataclasses.replace(t, block_n=min(t.block_n, t.block_m)) for t in configs]
    return list(dict.fromkeys(configs))


def _launch(kernel: str, q: Tensor, bd: int, block_m: int, block_n: int, launch: Callable[[TileConfig], R]) -> R:
    """``launch`` with the first candidate the device has the resources for (``common.launch_tiles``)."""
    configs = _candidates(kernel, q, bd, block_m, block_n)
    if not configs:  # triton_supports said so first (the variant falls back)
        raise RuntimeError(f"lazy_triton: no tile configuration for {kernel} at head dim {bd} on {q.device}")
    return launch_tiles(f"lazy.{kernel}", q.device, bd, q.dtype, configs, launch)


def _width(tiles: TileConfig) -> int:
    """W: the distinct distances of a tile (block_m + block_n - 1), to a power of two."""
    return padded(tiles.block_m + tiles.block_n - 1)


# ---------------------------------------------------------------------------------------------------------------------
# launches, as custom ops


@torch.library.custom_op("lazy_triton::forward", mutates_args=())
def _forward_op(
    q: Tensor, k: Tensor, v: Tensor, bias: Tensor, tau: Tensor, scale: float, last: int, block_m: int, block_n: int,
    need_u: bool,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """(out, lse, u): out and u ``[B, H, Tq, D]`` in q's dtype (u empty without ``need_u``), lse ``[B, H, Tq]`` in the
    accumulator dtype."""
    q, k, v, bias = (last_contiguous(x) for x in (q, k, v, bias))
    batch, hq, tq, dim = q.shape
    p, bd, group = k.shape[2] - tq, padded(dim), hq // k.shape[1]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    u = torch.empty(q.shape if need_u else (0,), dtype=q.dtype, device=q.device)
    lse = torch.empty(batch, hq, tq, dtype=acc_dtype(q), device=q.device)

    def launch(tiles: TileConfig) -> None:
        _kernels()["_fwd_kernel"][(_n_blocks(p, tq, tiles.block_m), batch * hq)](
            q, k, v, bias, tau, out, lse, u if need_u else out, *strides(q, k, v), bias.stride(0),
            scale, p, tq, k.shape[2], last, hq, group, dim,
            BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BD=bd, W=_width(tiles), PREC=precision(q), NEED_U=need_u,
            **tiles.options(),
        )  # fmt: skip

    _launch("_fwd_kernel", q, bd, block_m, block_n, launch)
    return out, lse, u


@_forward_op.register_fake
def _(
    q: Tensor, k: Tensor, v: Tensor, bias: Tensor, tau: Tensor, scale: float, last: int, block_m: int, block_n: int,
    need_u: bool,
) -> Any:  # fmt: skip
    u = q.new_empty(q.shape if need_u else (0,))
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=acc_dtype(q)), u


def _n_blocks(p: int, tq: int, block: int) -> int:
    """Query blocks, aligned to positions, holding the queries ``p .. p + tq - 1``."""
    return -(-(p + tq) // block) - p // block


@torch.library.custom_op("lazy_triton::backward", mutates_args=())
def _backward_op(
    grad: Tensor, q: Tensor, k: Tensor, v: Tensor, bias: Tensor, tau: Tensor, lse: Tensor, u: Tensor,
    scale: float, last: int, block_m: int, block_n: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """dq, dk, dv (in their inputs' dtypes), d bias, d tau (in the accumulator dtype)."""
    q, k, v, bias = (last_contiguous(x) for x in (q, k, v, bias))
    batch, hq, tq, dim = q.shape
    hk, tk = k.shape[1], k.shape[2]
    p, bd, group = tk - tq, padded(dim), hq // hk
    acc = acc_dtype(q)
    do = grad.to(q.dtype).contiguous()  # in q's dtype, as the kernels read it
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=q.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=q.device)
    delta = torch.empty(batch, hq, tq, dtype=acc, device=q.device)
    common = (*strides(q, k, v), bias.stride(0), scale, p, tq, tk, last, hq, group, dim)
    kernels = _kernels()

    u = u.contiguous()

    def launch_dq(t: TileConfig) -> Tensor:
        n_rows = _n_blocks(p, tq, t.block_m)
        dtau_part = torch.empty(batch * hq, n_rows, dtype=acc, device=q.device)
        kernels["_dq_kernel"][(n_rows, batch * hq)](
            q, k, v, bias, tau, do, u, lse, delta, dq, dtau_part, *common,
            BLOCK_M=t.block_m, BLOCK_N=t.block_n, BD=bd, W=_width(t), PREC=precision(q), **t.options(),
        )  # fmt: skip
        return -dtau_part.sum(1).reshape(batch, hq).sum(0)

    dtau = _launch("_dq_kernel", q, bd, block_m, block_n, launch_dq)

    def launch_dkv(t: TileConfig) -> tuple[Tensor, Tensor]:
        w = _width(t)
        starts, bases, lengths = _bias_rows(p, tq, tk, t.block_m, t.block_n, w)
        total = sum(lengths)
        partials = torch.empty(batch * hq, total, dtype=acc, device=q.device)
        kernels["_dkv_kernel"][(len(starts), batch * hk)](
            q, k, v, bias, tau, do, lse, delta, dk, dv, partials, torch.tensor(starts, device=q.device), *common,
            total, BLOCK_M=t.block_m, BLOCK_N=t.block_n, BD=bd, W=w, PREC=precision(q), **t.options(),
        )  # fmt: skip
        return partials.reshape(batch, hq, total).sum(0), _bias_index(starts, bases, lengths, last, q.device)

    partials, index = _launch("_dkv_kernel", q, bd, block_m, block_n, launch_dkv)
    dbias = torch.zeros(bias.shape, dtype=acc, device=q.device)
    dbias.index_add_(1, index, -partials)
    return dq, dk, dv, dbias, dtau


@_backward_op.register_fake
def _(
    grad: Tensor, q: Tensor, k: Tensor, v: Tensor, bias: Tensor, tau: Tensor, lse: Tensor, u: Tensor,
    scale: float, last: int, block_m: int, block_n: int,
) -> Any:  # fmt: skip
    acc = acc_dtype(q)
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), q.new_empty(bias.shape, dtype=acc),
            q.new_empty(tau.shape, dtype=acc))  # fmt: skip


def _bias_rows(p: int, tq: int, tk: int, block_m: int, block_n: int, w: int) -> tuple[list[int], list[int], list[int]]:
    """The d bias partials of each key block J (a row per (batch, head) holds them one after another): where J's run
    starts, the distance of its first entry, its length. J's tiles are query blocks ``i_start .. i_end - 1``; its run
    covers the distances ``i_start * block_m - (J + 1) * block_n + 1`` on, ``block_m`` per tile plus the last tile's
    ``w - block_m``."""
    i_end = -(-(p + tq) // block_m)
    starts, bases, lengths, at = [], [], [], 0
    for j in range(-(-tk // block_n)):
        i_start = max(j * block_n // block_m, p // block_m)
        starts.append(at)
        bases.append(i_start * block_m - (j + 1) * block_n + 1)
        lengths.append((i_end - i_start) * block_m + w - block_m)
        at += lengths[-1]
    return starts, bases, lengths


def _bias_index(starts: list[int], bases: list[int], lengths: list[int], last: int, device: torch.device) -> Tensor:
    """The table index of each partials entry: its distance, clamped to [0, last] (entries in the future hold 0)."""
    n = torch.tensor(lengths, device=device)
    total = sum(lengths)
    shift = torch.tensor([b - s for b, s in zip(bases, starts)], device=device)
    return (torch.arange(total, device=device) + shift.repeat_interleave(n, output_size=total)).clamp(0, last)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor, Tensor]) -> None:
    q, k, v, bias, tau, scale, last, block_m, block_n, _ = inputs
    _, lse, u = output
    ctx.save_for_backward(q, k, v, bias, tau, lse, u)
    ctx.meta = (scale, last, block_m, block_n)


def _backward(ctx: Any, grad: Tensor, grad_lse: Tensor | None, grad_u: Tensor | None) -> tuple[Any, ...]:
    q, k, v, bias, tau, lse, u = ctx.saved_tensors
    if u.numel() == 0:
        raise RuntimeError("lazy_triton: the forward ran without need_u; it cannot be differentiated")
    dq, dk, dv, dbias, dtau = _backward_op(grad, q, k, v, bias, tau, lse, u, *ctx.meta)
    return dq, dk, dv, dbias.to(bias.dtype), dtau.to(tau.dtype), None, None, None, None, None


_forward_op.register_autograd(_backward, setup_context=_setup_context)


def elastic_triton(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    distance_bias: Tensor,
    tau: Tensor,
    scale: float,
    last: int,
    block: int | tuple[int, int] | None = None,
) -> Tensor:
    """sum_j relu(softmax_j(s_ij) - tau_h / (i + 1)) v_j, s = q.k * scale - bias[h, clamp(i - j, 0, last)], for
    queries ``q [B, H, Tq, D]`` at positions ``Tk - Tq .. Tk - 1`` over keys ``k, v [B, H_kv, Tk, D]`` at ``0 ..
    Tk - 1`` (H a multiple of H_kv). ``[B, H, Tq, D]`` in q's dtype. ``block``: fixed tiles, ``n`` or ``(block_m,
    block_n)`` (the tests); by default each kernel's tiles come from ``tile_configs`` for the device."""
    block_m, block_n = (block, block) if isinstance(block, int) else (block or (0, 0))
    need_u = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v, distance_bias, tau))
    out, _, _ = _forward_op(q, k, v, distance_bias, tau, float(scale), int(last), int(block_m), int(block_n), need_u)
    return out
