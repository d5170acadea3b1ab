"""Focus soft mode's fused CUDA path: flash-attention Triton kernels for the gated score, forward and backward, with
the gate's operands reduced per tile (issue 37, item 5).

The score of ``flex.py`` (papers/focus-sinkhorn-centroid-attention.md, E.4.8 and eq. 4): ``s0 = q.k * scale``; for
pairs at distance ``i - j >= window`` the gate of ``x_ij = a_q[i] . a_k[j]`` applies, additive ``s = s0 + log
sigmoid(x)`` or multiplicative ``s = s0 * sigmoid(x)``; closer pairs keep ``s0``; causal softmax over the keys.
``a_q, a_k [B, T, K']`` are the per-token assignments with lambda folded in (``fold_gate``), shared by every head.

Tiling: queries at positions ``P .. P + Tq - 1`` (``P = Tk - Tq``) over keys ``0 .. Tk - 1``; query blocks
``BLOCK_M`` and key blocks ``BLOCK_N`` positions wide, aligned to absolute positions, per kernel and target from
``tile_configs`` (issue 47). GQA: query head h reads key/value head ``h // G``. The gate's argument ``x = a_q . a_k``
is K' unrolled scalar FMAs per score element over the exact K' (a constexpr; no padding, no fp32 ``tl.dot`` on the
CUDA cores), from ``a_q``, ``a_k`` passed as ``[B, K', T]`` so that each column is one coalesced vector load.

- Forward (a program per query block and (batch, head)): online softmax over the key tiles up to the diagonal;
  ``out`` (q's dtype) and the row logsumexp ``lse``.
- Backward. ``D_i = do_i . out_i`` (torch). With ``p = exp(s - lse)`` and ``ds = p * (do . v - D)``: ``ds0 = ds *
  ds/ds0`` (multiplicative: ``sigmoid(x)`` on gated pairs) feeds ``dq``, ``dk`` as in flash attention, and ``dx = ds
  * ds/dx`` (additive ``1 - sigmoid(x)``, multiplicative ``s0 sigmoid(x) (1 - sigmoid(x))``, 0 on near pairs) the
  gate's operands: ``d a_q[i, c] = sum_j dx_ij a_k[j, c]`` and ``d a_k[j, c] = sum_i dx_ij a_q[i, c]``, K' row sums
  per tile. ``dq`` kernel: a program per query block and (batch, head) accumulates ``dq`` and ``d a_q`` in
  registers over its key tiles and writes each row once (``d a_q`` per head, ``[B, H, K', Tq]``, summed over heads
  by torch). ``dk, dv`` kernel: a program per key block and (batch, key/value head) computes the transposed tiles
  (keys as rows, so ``d a_k``'s sums are row sums within a warp) over the G query heads of its group and the query
  tiles, accumulating ``dk``, ``dv`` and ``d a_k`` (per key/value head, summed by torch). Each kernel recomputes a
  tile once: the scores, the gate and its sigmoids feed p, ds and dx together (``_grads``). No atomics:
  FlexAttention's backward of a captured tensor that requires grad adds one atomic per score element per tensor.

Arithmetic: float32 accumulators (float64 for float64 inputs: the interpreter tests); the gate in float32 (FMAs);
the q.k and p.v dots on the tensor cores for bf16 / fp16 inputs (``ieee`` dots for float32 inputs). Per gated score
element: one exp (``t = exp(-|x|)``), one reciprocal ``1 / (1 + t)`` (sigma and 1 - sigma) and, additive, one log
(``log(1 + t)``, the hardware ``lg2`` on the GPU), then the softmax's exp. ``triton`` is imported lazily and the
kernels jitted once per interpreter mode (``TRITON_INTERPRET=1`` runs them on CPU tensors: the tests). The launches
are the custom ops ``focus_triton::soft_forward`` / ``focus_triton::soft_backward``, one opaque node each in a
compiled block; each kernel launches with the first of its configurations the device has the resources for.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from model.attention.common.triton import (
    TileConfig,
    acc_dtype,
    capability,
    family_tiles,
    interpreting,
    jit_kernels,
    last_contiguous,
    launch_tiles,
    padded,
    precision,
    sm100_rows,
    strides,
)
from model.attention.common.triton import available as available  # the module's own question too
from model.attention.focus.soft.flex import fold_gate

if TYPE_CHECKING:
    import triton.language as tl
    from triton.language.extra import libdevice
else:
    try:
        import triton.language as tl
        from triton.language.extra import libdevice
    except ImportError:  # the product imports without triton; available() is then False
        tl = libdevice = None


def kernel_dtypes() -> tuple[torch.dtype, ...]:
    return (torch.float32, torch.bfloat16, torch.float16, torch.float64)


# ---------------------------------------------------------------------------------------------------------------------
# kernels (plain functions, jitted by _kernels())


def _columns(ptr, idx, ok, T, NK: tl.constexpr):
    """The NK columns of one block's assignments (a ``[K', T]`` array at ``ptr``), each a vector over ``idx``: one
    coalesced load per column, no padding of K'."""
    cols = ()
    for c in tl.static_range(NK):
        cols = cols + (tl.load(ptr + c * T + idx, mask=ok, other=0.0),)  # type: ignore[assignment]
    return cols


def _gate(rows, cols, NK: tl.constexpr):
    """``x = sum_c rows[c] cols[c]^T``: the gate's argument on a tile, NK scalar FMAs per element over the exact K'."""
    x = rows[0][:, None] * cols[0][None, :]
    for c in tl.static_range(1, NK):
        x += rows[c][:, None] * cols[c][None, :]
    return x


def _sigmoids(x):
    """(t, 1 / (1 + t)) with ``t = exp(-|x|)``: sigma(x) = where(x >= 0, 1, t) / (1 + t), 1 - sigma(x) = where(x >= 0,
    t, 1) / (1 + t), log sigma(x) = min(x, 0) - log(1 + t) (``_log_sigmoid``): one exp, one reciprocal and (additive)
    one log per element, each stable for any x."""
    t = tl.exp(-tl.abs(x))
    return t, 1.0 / (1.0 + t)


def _log_sigmoid(x, t, FAST: tl.constexpr):
    """log sigma(x) from ``t = exp(-|x|)``. FAST (float32 on a GPU): the hardware log2 (``lg2.approx``, one MUFU op,
    absolute error about 2e-7 on 1 + t in (1, 2]) instead of libdevice's polynomial log (some 11 FFMA per element);
    the interpreter has no libdevice, and float64 keeps the exact log."""
    if FAST:
        return tl.minimum(x, 0.0) - libdevice.fast_logf(1.0 + t)
    else:
        return tl.minimum(x, 0.0) - tl.log(1.0 + t)


def _fwd_kernel(
    q_ptr, k_ptr, v_ptr, aq_ptr, ak_ptr, o_ptr, lse_ptr,
    sqb, sqh, sqt, skb, skh, skt, svb, svh, svt,
    scale, window, P, Tq, Tk, HQ, G, D,
    NK: tl.constexpr, ADDITIVE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BD: tl.constexpr,
    PREC: tl.constexpr, FAST: tl.constexpr,
):  # fmt: skip
    i_blk, bh = tl.program_id(0), tl.program_id(1)
    b, h = (bh // HQ).to(tl.int64), bh % HQ
    hk = h // G
    qb = P // BLOCK_M + i_blk
    pos = qb * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = (pos >= P) & (pos < P + Tq)
    qi = pos - P
    d = tl.arange(0, BD)
    q = tl.load(
        q_ptr + b * sqb + h * sqh + qi[:, None] * sqt + d[None, :], mask=row_ok[:, None] & (d[None, :] < D), other=0.0
    )
    aq = _columns(aq_ptr + b * NK * Tq, qi, row_ok, Tq, NK)
    acc_t = tl.float64 if q.dtype == tl.float64 else tl.float32
    k_base = b * skb + hk * skh
    v_base = b * svb + hk * svh
    ak_base = b * NK * Tk
    # rows outside the queries see key 0 (finite, never stored): the forward masks no row
    m = tl.full([BLOCK_M], float("-inf"), acc_t)
    den = tl.zeros([BLOCK_M], acc_t)
    o = tl.zeros([BLOCK_M, BD], acc_t)
    for J in range(0, tl.cdiv(tl.minimum((qb + 1) * BLOCK_M, Tk), BLOCK_N)):
        kpos = J * BLOCK_N + tl.arange(0, BLOCK_N)
        k_ok = kpos < Tk
        kt = tl.load(k_ptr + k_base + kpos[None, :] * skt + d[:, None], mask=k_ok[None, :] & (d[:, None] < D),
                     other=0.0)  # fmt: skip
        s0 = tl.dot(q, kt, input_precision=PREC).to(acc_t) * scale
        x = _gate(aq, _columns(ak_ptr + ak_base, kpos, k_ok, Tk, NK), NK)
        t, r = _sigmoids(x)
        gated = (pos[:, None] - kpos[None, :]) >= window
        if ADDITIVE:
            s = tl.where(gated, s0 + _log_sigmoid(x, t, FAST), s0)
        else:
            s = tl.where(gated, s0 * tl.where(x >= 0, 1.0, t) * r, s0)
        s = tl.where(kpos[None, :] <= pos[:, None], s, float("-inf"))  # keys past Tk: past every row
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)
        e = tl.exp(s - m_new[:, None])
        den = den * alpha + tl.sum(e, 1)
        m = m_new
        vt = tl.load(v_ptr + v_base + kpos[:, None] * svt + d[None, :], mask=k_ok[:, None] & (d[None, :] < D),
                     other=0.0)  # fmt: skip
        o = o * alpha[:, None] + tl.dot(e.to(vt.dtype), vt, input_precision=PREC).to(acc_t)
    row = (b * HQ + h) * Tq + qi
    tl.store(o_ptr + row[:, None] * D + d[None, :], (o / den[:, None]).to(o_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (d[None, :] < D))  # fmt: skip
    tl.store(lse_ptr + row, (m + tl.log(den)).to(lse_ptr.dtype.element_ty), mask=row_ok)


def _grads(s0, x, dp, lse, delta, vis, gated, ADDITIVE: tl.constexpr, FAST: tl.constexpr):
    """p, d s0 (what reaches q.k * scale) and dx (what reaches the gate's argument) of one tile, from its plain
    scores ``s0``, the gate's argument ``x`` and ``dp = do . v``; ``lse`` and ``delta`` broadcast to the tile."""
    t, r = _sigmoids(x)
    if ADDITIVE:
        s = tl.where(gated, s0 + _log_sigmoid(x, t, FAST), s0)
        p = tl.where(vis, tl.exp(s - lse), 0.0)
        ds = p * (dp - delta)
        ds0 = ds
        dx = tl.where(gated, ds * tl.where(x >= 0, t, 1.0) * r, 0.0)  # 1 - sigma(x)
    else:
        sig = tl.where(x >= 0, 1.0, t) * r
        p = tl.where(vis, tl.exp(tl.where(gated, s0 * sig, s0) - lse), 0.0)
        ds = p * (dp - delta)
        ds0 = tl.where(gated, ds * sig, ds)
        dx = tl.where(gated, ds * s0 * sig * (tl.where(x >= 0, t, 1.0) * r), 0.0)
    return p, ds0, dx


def _dq_kernel(
    q_ptr, k_ptr, v_ptr, aq_ptr, ak_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, daq_ptr,
    sqb, sqh, sqt, skb, skh, skt, svb, svh, svt,
    scale, window, P, Tq, Tk, HQ, G, D,
    NK: tl.constexpr, ADDITIVE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BD: tl.constexpr,
    PREC: tl.constexpr, FAST: tl.constexpr,
):  # fmt: skip
    """A program per query block and (batch, head): dq and d a_q (per head, [B, H, K', Tq]) accumulated over the
    key tiles up to the diagonal, each row written once."""
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
    row = (b * HQ + h) * Tq + qi
    do = tl.load(do_ptr + row[:, None] * D + d[None, :], mask=mask, other=0.0)
    acc_t = tl.float64 if q.dtype == tl.float64 else tl.float32
    lse = tl.load(lse_ptr + row, mask=row_ok, other=0.0).to(acc_t)
    delta = tl.load(delta_ptr + row, mask=row_ok, other=0.0).to(acc_t)
    aq = _columns(aq_ptr + b * NK * Tq, qi, row_ok, Tq, NK)
    k_base = b * skb + hk * skh
    v_base = b * svb + hk * svh
    ak_base = b * NK * Tk
    dq = tl.zeros([BLOCK_M, BD], acc_t)
    daq = ()
    for _c in tl.static_range(NK):
        daq = daq + (tl.zeros([BLOCK_M], acc_t),)  # type: ignore[assignment]
    for J in range(0, tl.cdiv(tl.minimum((qb + 1) * BLOCK_M, Tk), BLOCK_N)):
        kpos = J * BLOCK_N + tl.arange(0, BLOCK_N)
        k_ok = kpos < Tk
        kmask = k_ok[:, None] & (d[None, :] < D)
        k = tl.load(k_ptr + k_base + kpos[:, None] * skt + d[None, :], mask=kmask, other=0.0)
        v = tl.load(v_ptr + v_base + kpos[:, None] * svt + d[None, :], mask=kmask, other=0.0)
        s0 = tl.dot(q, tl.trans(k), input_precision=PREC).to(acc_t) * scale
        dp = tl.dot(do, tl.trans(v), input_precision=PREC).to(acc_t)
        ak = _columns(ak_ptr + ak_base, kpos, k_ok, Tk, NK)
        x = _gate(aq, ak, NK)
        vis = kpos[None, :] <= pos[:, None]  # keys past Tk are past every query; rows outside: never stored
        gated = (pos[:, None] - kpos[None, :]) >= window  # p = 0 where not visible: so are ds and dx
        p, ds0, dx = _grads(s0, x, dp, lse[:, None], delta[:, None], vis, gated, ADDITIVE, FAST)
        dq += tl.dot(ds0.to(k.dtype), k, input_precision=PREC).to(acc_t)
        new = ()
        for c in tl.static_range(NK):  # d a_q[i, c] += sum_j dx_ij a_k[j, c]: row sums, no padded product
            new = new + (daq[c] + tl.sum(dx * ak[c][None, :], 1),)  # type: ignore[assignment]
        daq = new
    tl.store(dq_ptr + row[:, None] * D + d[None, :], (dq * scale).to(dq_ptr.dtype.element_ty), mask=mask)
    drow = ((b * HQ + h) * NK) * Tq + qi
    for c in tl.static_range(NK):
        tl.store(daq_ptr + drow + c * Tq, daq[c].to(daq_ptr.dtype.element_ty), mask=row_ok)


def _dkv_kernel(
    q_ptr, k_ptr, v_ptr, aq_ptr, ak_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, dak_ptr,
    sqb, sqh, sqt, skb, skh, skt, svb, svh, svt,
    scale, window, P, Tq, Tk, HQ, G, D,
    NK: tl.constexpr, ADDITIVE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BD: tl.constexpr,
    PREC: tl.constexpr, FAST: tl.constexpr,
):  # fmt: skip
    """A program per key block and (batch, key/value head): the transposed tiles ``[keys, queries]`` (keys are the
    rows, so d a_k's sums over the queries are row sums) over the G query heads of the group and the query tiles from
    the diagonal on; dk, dv and d a_k (per key/value head, [B, Hkv, K', Tk]) written once."""
    J, bhk = tl.program_id(0), tl.program_id(1)
    HK = HQ // G
    b, hk = (bhk // HK).to(tl.int64), bhk % HK
    kpos = J * BLOCK_N + tl.arange(0, BLOCK_N)
    d = tl.arange(0, BD)
    k_ok = kpos < Tk
    kmask = k_ok[:, None] & (d[None, :] < D)
    k = tl.load(k_ptr + b * skb + hk * skh + kpos[:, None] * skt + d[None, :], mask=kmask, other=0.0)
    v = tl.load(v_ptr + b * svb + hk * svh + kpos[:, None] * svt + d[None, :], mask=kmask, other=0.0)
    ak = _columns(ak_ptr + b * NK * Tk, kpos, k_ok, Tk, NK)
    acc_t = tl.float64 if k.dtype == tl.float64 else tl.float32
    dk = tl.zeros([BLOCK_N, BD], acc_t)
    dv = tl.zeros([BLOCK_N, BD], acc_t)
    dak = ()
    for _c in tl.static_range(NK):
        dak = dak + (tl.zeros([BLOCK_N], acc_t),)  # type: ignore[assignment]
    i_start = tl.maximum((J * BLOCK_N) // BLOCK_M, P // BLOCK_M)
    i_end = tl.cdiv(P + Tq, BLOCK_M)
    aq_base = b * NK * Tq
    n_q = i_end - i_start
    for it in range(0, G * n_q):  # the G heads' query tiles as one loop (one level of loop state)
        h = hk * G + it // n_q
        qb = i_start + it % n_q
        pos = qb * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = (pos >= P) & (pos < P + Tq)
        qi = pos - P
        row = (b * HQ + h) * Tq + qi
        qmask = row_ok[:, None] & (d[None, :] < D)
        q = tl.load(q_ptr + b * sqb + h * sqh + qi[:, None] * sqt + d[None, :], mask=qmask, other=0.0)
        do = tl.load(do_ptr + row[:, None] * D + d[None, :], mask=qmask, other=0.0)
        # rows outside the queries: lse = inf makes their p, ds and dx 0 (no row mask on the tile)
        lse = tl.load(lse_ptr + row, mask=row_ok, other=float("inf")).to(acc_t)
        delta = tl.load(delta_ptr + row, mask=row_ok, other=0.0).to(acc_t)
        s0 = tl.dot(k, tl.trans(q), input_precision=PREC).to(acc_t) * scale  # [keys, queries]
        dp = tl.dot(v, tl.trans(do), input_precision=PREC).to(acc_t)
        aq = _columns(aq_ptr + aq_base, qi, row_ok, Tq, NK)
        x = _gate(ak, aq, NK)
        vis = kpos[:, None] <= pos[None, :]
        gated = (pos[None, :] - kpos[:, None]) >= window
        p, ds0, dx = _grads(s0, x, dp, lse[None, :], delta[None, :], vis, gated, ADDITIVE, FAST)
        dv += tl.dot(p.to(k.dtype), do, input_precision=PREC).to(acc_t)
        dk += tl.dot(ds0.to(k.dtype), q, input_precision=PREC).to(acc_t)
        new = ()
        for c in tl.static_range(NK):  # d a_k[j, c] += sum_i dx_ji a_q[i, c]
            new = new + (dak[c] + tl.sum(dx * aq[c][None, :], 1),)  # type: ignore[assignment]
        dak = new
    row = (b * HK + hk) * Tk + kpos
    tl.store(dk_ptr + row[:, None] * D + d[None, :], (dk * scale).to(dk_ptr.dtype.element_ty), mask=kmask)
    tl.store(dv_ptr + row[:, None] * D + d[None, :], dv.to(dv_ptr.dtype.element_ty), mask=kmask)
    drow = ((b * HK + hk) * NK) * Tk + kpos
    for c in tl.static_range(NK):
        tl.store(dak_ptr + drow + c * Tk, dak[c].to(dak_ptr.dtype.element_ty), mask=k_ok)


_KERNELS: dict[bool, dict[str, Any]] = {}
_HELPERS = ("_columns", "_gate", "_sigmoids", "_log_sigmoid", "_grads")
_LAUNCHED = ("_fwd_kernel", "_dq_kernel", "_dkv_kernel")


def _kernels() -> dict[str, Any]:
    """The kernels, jitted once per interpreter mode."""
    return jit_kernels(globals(), _HELPERS + _LAUNCHED, _KERNELS)


# ---------------------------------------------------------------------------------------------------------------------
# tile configurations


# kernel -> candidates (block_m query rows, block_n keys, warps, stages) per target family, from the compile sweeps of
# docs/focus.md ("Triton tiles"; the defaults of every target in docs/triton-targets.md): the first of each compiles
# without spills at head dims 64 and 128, MHA and GQA, both gates, bf16 and fp16; the later ones are smaller. 128-row
# query tiles in the forward and dq kernels; dq and dk/dv take 16-position steps (the gate's K' columns and the score
# tiles stay in registers beside the [rows, D] float32 accumulators: dk and dv are two of them). sm_86-89 take
# sm_80's (99 KB per block: compiled for sm_86), sm_100+ sm_90's then sm_86's (``sm100_rows``).
_SMALLER: dict[str, tuple[TileConfig, ...]] = {
    "_fwd_kernel": (TileConfig(64, 32, 4, 1), TileConfig(32, 16, 4, 1)),
    "_dq_kernel": (TileConfig(64, 16, 4, 1), TileConfig(32, 16, 4, 1)),
    "_dkv_kernel": (TileConfig(16, 32, 4, 1), TileConfig(16, 16, 4, 1)),
}
_SM90_ROW = {
    "_fwd_kernel": (TileConfig(128, 64, 8, 2), *_SMALLER["_fwd_kernel"]),
    "_dq_kernel": (TileConfig(128, 16, 8, 2), *_SMALLER["_dq_kernel"]),
    "_dkv_kernel": (TileConfig(16, 128, 8, 1), TileConfig(16, 64, 8, 2), *_SMALLER["_dkv_kernel"]),
}
_SM80_ROW = {
    "_fwd_kernel": (TileConfig(128, 64, 8, 2), *_SMALLER["_fwd_kernel"]),
    "_dq_kernel": (TileConfig(128, 16, 8, 2), *_SMALLER["_dq_kernel"]),
    "_dkv_kernel": (TileConfig(16, 32, 4, 2), *_SMALLER["_dkv_kernel"]),
}
_SM90 = {64: _SM90_ROW, 128: _SM90_ROW}
_SM80 = {64: _SM80_ROW, 128: _SM80_ROW}
_TILES = {"sm_80": _SM80, "sm_86-89": _SM80, "sm_90": _SM90, "sm_100+": sm100_rows(_SM90, _SM80)}


def tile_configs(kernel: str, capability: tuple[int, int] | None, bd: int, dtype: torch.dtype) -> list[TileConfig]:
    """The candidates of ``kernel`` (one of ``_LAUNCHED``) on a device of ``capability`` (None: the interpreter) at
    padded head dim ``bd``, in preference order ([] where none is sized: the caller falls back); the launcher takes
    the first that fits. float32 inputs (fp32 tiles and dots on the CUDA cores) take the smaller ones."""
    return family_tiles(_TILES, _SMALLER, kernel, capability, bd, dtype)


def _fast(q: Tensor) -> bool:
    """The hardware log (``_log_sigmoid``): compiled kernels with float32 accumulators."""
    return q.dtype != torch.float64 and not interpreting()


def _candidates(kernel: str, q: Tensor, bd: int, tiles: list[int]) -> list[TileConfig]:
    """``tiles`` = [block_m, block_n] forces the tile (tests: several shapes) with the candidates' warps and stages,
    else ``tile_configs`` for q's device."""
    configs = tile_configs(kernel, capability(q.device), bd, q.dtype)
    if tiles:
        configs = list(dict.fromkeys(dataclasses.replace(c, block_m=tiles[0], block_n=tiles[1]) for c in configs))
    return configs


def _launch(name: str, q: Tensor, bd: int, tiles: list[int], grid: Callable[[TileConfig], tuple[int, int]],
            *args: Any, **meta: Any) -> None:  # fmt: skip
    """Launch ``name`` with the first candidate the device has the resources for (``common.launch_tiles``)."""
    configs = _candidates(name, q, bd, tiles)
    if not configs:  # soft_triton_supports said so first (the variant falls back)
        raise RuntimeError(f"focus soft triton: no tile configuration for {name} at head dim {bd} on {q.device}")
    kernel = _kernels()[name]

    def launch(c: TileConfig) -> None:
        kernel[grid(c)](*args, **meta, BLOCK_M=c.block_m, BLOCK_N=c.block_n, **c.options())

    launch_tiles(f"focus_soft.{name}", q.device, bd, q.dtype, configs, launch)


# ---------------------------------------------------------------------------------------------------------------------
# launches, as custom ops


def _query_blocks(p: int, tq: int, block_m: int) -> int:
    """Query blocks of ``block_m`` positions (aligned to absolute positions) covering ``p .. p + tq - 1``."""
    return -(-(p + tq) // block_m) - p // block_m


def _transposed(a: Tensor) -> Tensor:
    """[B, T, K'] -> [B, K', T] contiguous: each of the K' columns one coalesced vector load in the kernels."""
    return a.transpose(1, 2).contiguous()


@torch.library.custom_op("focus_triton::soft_forward", mutates_args=())
def _forward_op(
    q: Tensor, k: Tensor, v: Tensor, a_q: Tensor, a_k: Tensor, scale: float, window: int, additive: bool,
    tiles: list[int],
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """(out [B, H, Tq, D] in q's dtype, lse [B, H, Tq] in the accumulator dtype)."""
    q, k, v = (last_contiguous(x) for x in (q, k, v))
    batch, hq, tq, dim = q.shape
    tk, nk = k.shape[2], a_q.shape[-1]
    p, bd = tk - tq, padded(dim)
    out = torch.empty(batch, hq, tq, dim, dtype=q.dtype, device=q.device)
    lse = torch.empty(batch, hq, tq, dtype=acc_dtype(q), device=q.device)
    _launch(
        "_fwd_kernel", q, bd, tiles, lambda c: (_query_blocks(p, tq, c.block_m), batch * hq),
        q, k, v, _transposed(a_q), _transposed(a_k), out, lse, *strides(q, k, v),
        scale, window, p, tq, tk, hq, hq // k.shape[1], dim,
        NK=nk, ADDITIVE=additive, BD=bd, PREC=precision(q), FAST=_fast(q),
    )  # fmt: skip
    return out, lse


@_forward_op.register_fake
def _(
    q: Tensor, k: Tensor, v: Tensor, a_q: Tensor, a_k: Tensor, scale: float, window: int, additive: bool,
    tiles: list[int],
) -> Any:  # fmt: skip
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty(q.shape[:3], dtype=acc_dtype(q))


@torch.library.custom_op("focus_triton::soft_backward", mutates_args=())
def _backward_op(
    grad: Tensor, q: Tensor, k: Tensor, v: Tensor, a_q: Tensor, a_k: Tensor, out: Tensor, lse: Tensor,
    scale: float, window: int, additive: bool, tiles: list[int],
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """dq, dk, dv (accumulator dtype), d a_q [B, Tq, K'], d a_k [B, Tk, K'] (a_q's dtype)."""
    q, k, v = (last_contiguous(x) for x in (q, k, v))
    batch, hq, tq, dim = q.shape
    hk, tk, nk = k.shape[1], k.shape[2], a_q.shape[-1]
    p, bd = tk - tq, padded(dim)
    acc = acc_dtype(q)
    do = grad.contiguous()
    delta = (do.to(acc) * out.to(acc)).sum(-1)
    dq = torch.empty(q.shape, dtype=acc, device=q.device)
    dk = torch.empty(k.shape, dtype=acc, device=q.device)
    dv = torch.empty(v.shape, dtype=acc, device=q.device)
    daq = torch.empty(batch, hq, nk, tq, dtype=acc, device=q.device)  # per query head
    dak = torch.empty(batch, hk, nk, tk, dtype=acc, device=q.device)  # per key/value head
    a_qt, a_kt = _transposed(a_q), _transposed(a_k)
    common = (*strides(q, k, v), scale, window, p, tq, tk, hq, hq // hk, dim)
    meta = dict(NK=nk, ADDITIVE=additive, BD=bd, PREC=precision(q), FAST=_fast(q))
    _launch("_dq_kernel", q, bd, tiles, lambda c: (_query_blocks(p, tq, c.block_m), batch * hq),
            q, k, v, a_qt, a_kt, do, lse, delta, dq, daq, *common, **meta)  # fmt: skip
    _launch("_dkv_kernel", q, bd, tiles, lambda c: (-(-tk // c.block_n), batch * hk),
            q, k, v, a_qt, a_kt, do, lse, delta, dk, dv, dak, *common, **meta)  # fmt: skip
    return dq, dk, dv, daq.sum(1).transpose(1, 2).to(a_q.dtype), dak.sum(1).transpose(1, 2).to(a_k.dtype)


@_backward_op.register_fake
def _(
    grad: Tensor, q: Tensor, k: Tensor, v: Tensor, a_q: Tensor, a_k: Tensor, out: Tensor, lse: Tensor,
    scale: float, window: int, additive: bool, tiles: list[int],
) -> Any:  # fmt: skip
    acc = acc_dtype(q)
    return (q.new_empty(q.shape, dtype=acc), q.new_empty(k.shape, dtype=acc), q.new_empty(v.shape, dtype=acc),
            a_q.new_empty(a_q.shape), a_k.new_empty(a_k.shape))  # fmt: skip


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    q, k, v, a_q, a_k, scale, window, additive, tiles = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, a_q, a_k, out, lse)
    ctx.meta = (scale, window, additive, tiles)


def _backward(ctx: Any, grad: Tensor, grad_lse: Tensor | None) -> tuple[Any, ...]:
    q, k, v, a_q, a_k, out, lse = ctx.saved_tensors
    dq, dk, dv, daq, dak = _backward_op(grad, q, k, v, a_q, a_k, out, lse, *ctx.meta)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), daq, dak, None, None, None, None


_forward_op.register_autograd(_backward, setup_context=_setup_context)


def triton_soft_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g_q: Tensor,
    g_k: Tensor,
    lam: Tensor,
    *,
    window: int,
    scale: float,
    gate: str,
    block: int | None = None,
    tiles: tuple[int, int] | None = None,
) -> Tensor:
    """Soft-gated causal attention of q [B, H, Tq, D] at positions ``Tk - Tq .. Tk - 1`` over k, v [B, Hkv, Tk, D]
    at ``0 .. Tk - 1`` (H a multiple of Hkv); g_q [B, Tq, K], g_k [B, Tk, K] assignments, lam [1] the gate strength.
    ``[B, H, Tq, D]`` in q's dtype; values and gradients those of ``flex_soft_attention`` and the dense reference.
    ``tiles = (block_m, block_n)`` (or ``block`` for both) forces one tile shape on every kernel (tests); by default
    each kernel takes the first of its ``tile_configs`` that fits the device."""
    additive = gate == "additive"
    a_q, a_k = fold_gate(g_q, g_k, lam, torch.promote_types(q.dtype, torch.float32), additive)
    forced = list(tiles) if tiles else [block, block] if block else []
    out, _ = _forward_op(q, k, v, a_q, a_k, float(scale), int(window), additive, [int(t) for t in forced])
    return out
