"""Focus soft mode's fused CUDA path: flash-attention Triton kernels for the gated score, forward and backward, with
the gate's operands reduced per tile (issue 37, item 5).

The score of ``flex.py`` (papers/focus-sinkhorn-centroid-attention.md, E.4.8 and eq. 4): ``s0 = q.k * scale``; for
pairs at distance ``i - j >= window`` the gate of ``x_ij = a_q[i] . a_k[j]`` applies, additive ``s = s0 + log
sigmoid(x)`` or multiplicative ``s = s0 * sigmoid(x)``; closer pairs keep ``s0``; causal softmax over the keys.
``a_q, a_k [B, T, K']`` are the per-token assignments with lambda folded in (``fold_gate``), shared by every head.

Tiling, as ``model/attention/lazy/triton.py``: queries at positions ``P .. P + Tq - 1`` (``P = Tk - Tq``) over keys
``0 .. Tk - 1``; query and key blocks ``BLOCK`` positions wide, aligned to absolute positions. GQA: query head h
reads key/value head ``h // G``. ``x`` is a ``[BLOCK, K'] x [K', BLOCK]`` tile product (K' padded to 16 for the dot).

- Forward (a program per query block and (batch, head)): online softmax over the key tiles up to the diagonal;
  ``out`` (q's dtype) and the row logsumexp ``lse``.
- Backward. ``D_i = do_i . out_i`` (torch). With ``p = exp(s - lse)`` and ``ds = p * (do . v - D)``: ``ds0 = ds *
  ds/ds0`` (multiplicative: ``sigmoid(x)`` on gated pairs) feeds ``dq``, ``dk`` as in flash attention, and ``dx = ds
  * ds/dx`` (additive ``1 - sigmoid(x)``, multiplicative ``s0 sigmoid(x) (1 - sigmoid(x))``, 0 on near pairs) the
  gate's operands: ``d a_q[i] = sum_j dx_ij a_k[j]`` and ``d a_k[j] = sum_i dx_ij a_q[i]``, tile products. ``dq``
  kernel: a program per query block and (batch, head) accumulates ``dq`` and ``d a_q`` in registers over its key
  tiles and writes each row once (``d a_q`` per head, ``[B, H, Tq, K']``, summed over heads by torch). ``dk, dv``
  kernel: a program per key block and (batch, key/value head) loops over the G query heads of its group and the
  query tiles, accumulating ``dk``, ``dv`` and ``d a_k`` (per key/value head, summed by torch). No atomics:
  FlexAttention's backward of a captured tensor that requires grad adds one atomic per score element per tensor.

Arithmetic: float32 accumulators (float64 for float64 inputs: the interpreter tests); the gate in float32 as the
reference's (its dots ``ieee``), the q.k and p.v dots on the tensor cores for bf16 / fp16 inputs. ``triton`` is
imported lazily and the kernels jitted once per interpreter mode (``TRITON_INTERPRET=1`` runs them on CPU tensors:
the tests). The launches are the custom ops ``focus_triton::soft_forward`` / ``focus_triton::soft_backward``, one
opaque node each in a compiled block.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import Tensor

from model.attention.common.triton import (
    SM80_SMALL_TILES,
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
from model.attention.focus.soft.flex import fold_gate

if TYPE_CHECKING:
    import triton.language as tl
else:
    try:
        import triton.language as tl
    except ImportError:  # the product imports without triton; available() is then False
        tl = None

R = TypeVar("R")


def kernel_dtypes() -> tuple[torch.dtype, ...]:
    return (torch.float32, torch.bfloat16, torch.float16, torch.float64)


# ---------------------------------------------------------------------------------------------------------------------
# kernels (plain functions, jitted by _kernels())


def _tile(q, aq, pos, rows, kpos, d, c, k_ptr, ak_ptr, k_base, ak_base, skt, D, Tk, NK, window, scale,
          ADDITIVE: tl.constexpr, PREC: tl.constexpr):  # fmt: skip
    """One [rows, keys] tile: the gated scores s (-inf off the causal mask, the key range and ``rows``), the plain
    scores s0, sigmoid(x) and the gated pairs (distant and visible)."""
    k_ok = kpos < Tk
    kt = tl.load(k_ptr + k_base + kpos[None, :] * skt + d[:, None], mask=k_ok[None, :] & (d[:, None] < D), other=0.0)
    acc_t = tl.float64 if q.dtype == tl.float64 else tl.float32
    s0 = tl.dot(q, kt, input_precision=PREC).to(acc_t) * scale
    akt = tl.load(ak_ptr + ak_base + kpos[None, :] * NK + c[:, None], mask=k_ok[None, :] & (c[:, None] < NK), other=0.0)
    x = tl.dot(aq, akt, input_precision="ieee").to(acc_t)
    e = tl.exp(-tl.abs(x))
    sig = tl.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))
    vis = (kpos[None, :] <= pos[:, None]) & k_ok[None, :] & rows[:, None]
    gated = vis & ((pos[:, None] - kpos[None, :]) >= window)
    if ADDITIVE:
        s = tl.where(gated, s0 + tl.minimum(x, 0.0) - tl.log(1.0 + e), s0)  # log sigmoid(x)
    else:
        s = tl.where(gated, s0 * sig, s0)
    return tl.where(vis, s, float("-inf")), s0, sig, gated


def _fwd_kernel(
    q_ptr, k_ptr, v_ptr, aq_ptr, ak_ptr, o_ptr, lse_ptr,
    sqb, sqh, sqt, skb, skh, skt, svb, svh, svt,
    scale, window, P, Tq, Tk, HQ, G, D, NK,
    ADDITIVE: tl.constexpr, BLOCK: tl.constexpr, BD: tl.constexpr, KP: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    i_blk, bh = tl.program_id(0), tl.program_id(1)
    b, h = (bh // HQ).to(tl.int64), bh % HQ
    hk = h // G
    qb = P // BLOCK + i_blk
    pos = qb * BLOCK + tl.arange(0, BLOCK)
    row_ok = (pos >= P) & (pos < P + Tq)
    qi = pos - P
    d = tl.arange(0, BD)
    c = tl.arange(0, KP)
    q = tl.load(
        q_ptr + b * sqb + h * sqh + qi[:, None] * sqt + d[None, :], mask=row_ok[:, None] & (d[None, :] < D), other=0.0
    )
    aq = tl.load(aq_ptr + (b * Tq + qi)[:, None] * NK + c[None, :], mask=row_ok[:, None] & (c[None, :] < NK), other=0.0)
    acc_t = tl.float64 if q.dtype == tl.float64 else tl.float32
    k_base = b * skb + hk * skh
    v_base = b * svb + hk * svh
    ak_base = b * Tk * NK
    every = pos >= 0  # the forward masks no row (rows outside the queries see key 0: finite, never stored)
    m = tl.full([BLOCK], float("-inf"), acc_t)
    den = tl.zeros([BLOCK], acc_t)
    o = tl.zeros([BLOCK, BD], acc_t)
    for J in range(0, qb + 1):
        kpos = J * BLOCK + tl.arange(0, BLOCK)
        s, s0, sig, gated = _tile(q, aq, pos, every, kpos, d, c, k_ptr, ak_ptr, k_base, ak_base, skt, D, Tk, NK,
                                  window, scale, ADDITIVE, PREC)  # fmt: skip
        m_new = tl.maximum(m, tl.max(s, 1))
        r = tl.exp(m - m_new)
        e = tl.exp(s - m_new[:, None])
        den = den * r + tl.sum(e, 1)
        m = m_new
        vt = tl.load(v_ptr + v_base + kpos[:, None] * svt + d[None, :], mask=(kpos[:, None] < Tk) & (d[None, :] < D))
        o = o * r[:, None] + tl.dot(e.to(vt.dtype), vt, input_precision=PREC).to(acc_t)
    row = (b * HQ + h) * Tq + qi
    tl.store(o_ptr + row[:, None] * D + d[None, :], (o / den[:, None]).to(o_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (d[None, :] < D))  # fmt: skip
    tl.store(lse_ptr + row, (m + tl.log(den)).to(lse_ptr.dtype.element_ty), mask=row_ok)


def _grads_tile(q, aq, do, lse, delta, pos, row_ok, kpos, d, c, k_ptr, v_ptr, ak_ptr, k_base, v_base, ak_base, skt,
                svt, D, Tk, NK, window, scale, ADDITIVE: tl.constexpr, PREC: tl.constexpr):  # fmt: skip
    """[rows, keys] p, d s0 (what reaches q.k * scale) and dx (what reaches the gate's argument) of one tile."""
    s, s0, sig, gated = _tile(q, aq, pos, row_ok, kpos, d, c, k_ptr, ak_ptr, k_base, ak_base, skt, D, Tk, NK, window,
                              scale, ADDITIVE, PREC)  # fmt: skip
    p = tl.exp(s - lse[:, None])  # 0 off the mask (rows outside the queries included)
    vt = tl.load(v_ptr + v_base + kpos[None, :] * svt + d[:, None], mask=(kpos[None, :] < Tk) & (d[:, None] < D))
    dp = tl.dot(do, vt, input_precision=PREC).to(s0.dtype)
    ds = p * (dp - delta[:, None])
    if ADDITIVE:
        ds0 = ds
        dx = tl.where(gated, ds * (1.0 - sig), 0.0)
    else:
        ds0 = tl.where(gated, ds * sig, ds)
        dx = tl.where(gated, ds * s0 * sig * (1.0 - sig), 0.0)
    return p, ds0, dx


def _load_rows(q_ptr, aq_ptr, do_ptr, lse_ptr, delta_ptr, b, h, qb, P, Tq, HQ, D, NK, sqb, sqh, sqt, d, c,
               BLOCK: tl.constexpr):  # fmt: skip
    """One query block's q, a_q, do, lse and D (rows outside the queries read zeros and are masked)."""
    pos = qb * BLOCK + tl.arange(0, BLOCK)
    row_ok = (pos >= P) & (pos < P + Tq)
    qi = pos - P
    mask = row_ok[:, None] & (d[None, :] < D)
    q = tl.load(q_ptr + b * sqb + h * sqh + qi[:, None] * sqt + d[None, :], mask=mask, other=0.0)
    aq = tl.load(aq_ptr + (b * Tq + qi)[:, None] * NK + c[None, :], mask=row_ok[:, None] & (c[None, :] < NK), other=0.0)
    row = (b * HQ + h) * Tq + qi
    do = tl.load(do_ptr + row[:, None] * D + d[None, :], mask=mask, other=0.0).to(q.dtype)
    acc_t = tl.float64 if q.dtype == tl.float64 else tl.float32
    lse = tl.load(lse_ptr + row, mask=row_ok, other=0.0).to(acc_t)
    delta = tl.load(delta_ptr + row, mask=row_ok, other=0.0).to(acc_t)
    return pos, row_ok, q, aq, do, lse, delta


def _dq_kernel(
    q_ptr, k_ptr, v_ptr, aq_ptr, ak_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, daq_ptr,
    sqb, sqh, sqt, skb, skh, skt, svb, svh, svt,
    scale, window, P, Tq, Tk, HQ, G, D, NK,
    ADDITIVE: tl.constexpr, BLOCK: tl.constexpr, BD: tl.constexpr, KP: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    i_blk, bh = tl.program_id(0), tl.program_id(1)
    b, h = (bh // HQ).to(tl.int64), bh % HQ
    hk = h // G
    qb = P // BLOCK + i_blk
    d = tl.arange(0, BD)
    c = tl.arange(0, KP)
    pos, row_ok, q, aq, do, lse, delta = _load_rows(
        q_ptr, aq_ptr, do_ptr, lse_ptr, delta_ptr, b, h, qb, P, Tq, HQ, D, NK, sqb, sqh, sqt, d, c, BLOCK
    )
    k_base = b * skb + hk * skh
    v_base = b * svb + hk * svh
    ak_base = b * Tk * NK
    dq = tl.zeros([BLOCK, BD], lse.dtype)
    daq = tl.zeros([BLOCK, KP], lse.dtype)
    for J in range(0, qb + 1):
        kpos = J * BLOCK + tl.arange(0, BLOCK)
        p, ds0, dx = _grads_tile(q, aq, do, lse, delta, pos, row_ok, kpos, d, c, k_ptr, v_ptr, ak_ptr, k_base, v_base,
                                 ak_base, skt, svt, D, Tk, NK, window, scale, ADDITIVE, PREC)  # fmt: skip
        k_ok = kpos < Tk
        k = tl.load(k_ptr + k_base + kpos[:, None] * skt + d[None, :], mask=k_ok[:, None] & (d[None, :] < D))
        dq += tl.dot(ds0.to(k.dtype), k, input_precision=PREC).to(dq.dtype)
        ak = tl.load(ak_ptr + ak_base + kpos[:, None] * NK + c[None, :], mask=k_ok[:, None] & (c[None, :] < NK),
                     other=0.0)  # fmt: skip
        daq += tl.dot(dx.to(ak.dtype), ak, input_precision="ieee").to(daq.dtype)
    row = (b * HQ + h) * Tq + pos - P
    tl.store(dq_ptr + row[:, None] * D + d[None, :], (dq * scale).to(dq_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (d[None, :] < D))  # fmt: skip
    tl.store(daq_ptr + row[:, None] * NK + c[None, :], daq.to(daq_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (c[None, :] < NK))  # fmt: skip


def _dkv_kernel(
    q_ptr, k_ptr, v_ptr, aq_ptr, ak_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, dak_ptr,
    sqb, sqh, sqt, skb, skh, skt, svb, svh, svt,
    scale, window, P, Tq, Tk, HQ, G, D, NK,
    ADDITIVE: tl.constexpr, BLOCK: tl.constexpr, BD: tl.constexpr, KP: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    J, bhk = tl.program_id(0), tl.program_id(1)
    HK = HQ // G
    b, hk = (bhk // HK).to(tl.int64), bhk % HK
    kpos = J * BLOCK + tl.arange(0, BLOCK)
    d = tl.arange(0, BD)
    c = tl.arange(0, KP)
    k_ok = kpos < Tk
    kmask = k_ok[:, None] & (d[None, :] < D)
    k_base = b * skb + hk * skh
    v_base = b * svb + hk * svh
    ak_base = b * Tk * NK
    acc_t = tl.float64 if q_ptr.dtype.element_ty == tl.float64 else tl.float32
    dk = tl.zeros([BLOCK, BD], acc_t)
    dv = tl.zeros([BLOCK, BD], acc_t)
    dak = tl.zeros([BLOCK, KP], acc_t)
    i_start = tl.maximum(J, P // BLOCK)
    i_end = tl.cdiv(P + Tq, BLOCK)
    for g in range(0, G):
        h = hk * G + g
        for qb in range(i_start, i_end):
            pos, row_ok, q, aq, do, lse, delta = _load_rows(
                q_ptr, aq_ptr, do_ptr, lse_ptr, delta_ptr, b, h, qb, P, Tq, HQ, D, NK, sqb, sqh, sqt, d, c, BLOCK
            )
            p, ds0, dx = _grads_tile(q, aq, do, lse, delta, pos, row_ok, kpos, d, c, k_ptr, v_ptr, ak_ptr, k_base,
                                     v_base, ak_base, skt, svt, D, Tk, NK, window, scale, ADDITIVE, PREC)  # fmt: skip
            dv += tl.dot(tl.trans(p).to(do.dtype), do, input_precision=PREC).to(acc_t)
            dk += tl.dot(tl.trans(ds0).to(q.dtype), q, input_precision=PREC).to(acc_t)
            dak += tl.dot(tl.trans(dx).to(aq.dtype), aq, input_precision="ieee").to(acc_t)
    row = (b * HK + hk) * Tk + kpos
    tl.store(dk_ptr + row[:, None] * D + d[None, :], (dk * scale).to(dk_ptr.dtype.element_ty), mask=kmask)
    tl.store(dv_ptr + row[:, None] * D + d[None, :], dv.to(dv_ptr.dtype.element_ty), mask=kmask)
    tl.store(dak_ptr + row[:, None] * NK + c[None, :], dak.to(dak_ptr.dtype.element_ty),
             mask=k_ok[:, None] & (c[None, :] < NK))  # fmt: skip


_KERNELS: dict[bool, dict[str, Any]] = {}
_HELPERS = ("_tile", "_grads_tile", "_load_rows")
_LAUNCHED = ("_fwd_kernel", "_dq_kernel", "_dkv_kernel")


def _kernels() -> dict[str, Any]:
    """The kernels, jitted once per interpreter mode."""
    return jit_kernels(globals(), _HELPERS + _LAUNCHED, _KERNELS)


def tile_configs(kernel: str, capability: tuple[int, int] | None, bd: int, dtype: torch.dtype) -> list[TileConfig]:
    """Launch candidates of ``kernel`` (one of ``_LAUNCHED``) on ``capability`` (None: the interpreter), best first.
    The kernels take one BLOCK for query and key tiles (block_m == block_n); 32-position tiles on sm_80, where
    64-position ones spill (docs/triton-targets.md)."""
    return family_tiles(capability, bd, dtype, SM80_SMALL_TILES)


def _launch(name: str, q: Tensor, bd: int, block: int, launch: Callable[[TileConfig], R]) -> R:
    """``launch`` with the selected tile configuration (``block`` > 0: that tile size, the tests)."""
    configs = tile_configs(name, capability(q.device), bd, q.dtype)
    if block:
        configs = list(dict.fromkeys(dataclasses.replace(c, block_m=block, block_n=block) for c in configs))
    return launch_tiles(f"focus_soft.{name}", q.device, bd, q.dtype, configs, launch)


# ---------------------------------------------------------------------------------------------------------------------
# launches, as custom ops


def _geometry(q: Tensor, k: Tensor, a_q: Tensor, block: int) -> tuple[int, int, int, int, int, int]:
    """(P, query blocks, key blocks, padded head dim, padded K', GQA group)."""
    tq, dim = q.shape[2], q.shape[3]
    tk = k.shape[2]
    p = tk - tq
    n_rows = -(-(p + tq) // block) - p // block  # query blocks, aligned to positions
    bd = padded(dim)
    kp = padded(a_q.shape[-1])
    return p, n_rows, -(-tk // block), bd, kp, q.shape[1] // k.shape[1]


@torch.library.custom_op("focus_triton::soft_forward", mutates_args=())
def _forward_op(
    q: Tensor, k: Tensor, v: Tensor, a_q: Tensor, a_k: Tensor, scale: float, window: int, additive: bool, block: int
) -> tuple[Tensor, Tensor]:
    """(out [B, H, Tq, D] in q's dtype, lse [B, H, Tq] in the accumulator dtype)."""
    q, k, v = (last_contiguous(x) for x in (q, k, v))
    a_q, a_k = a_q.contiguous(), a_k.contiguous()
    batch, hq, tq, dim = q.shape
    out = torch.empty(batch, hq, tq, dim, dtype=q.dtype, device=q.device)
    lse = torch.empty(batch, hq, tq, dtype=acc_dtype(q), device=q.device)

    def launch(tiles: TileConfig) -> None:
        p, n_rows, _, bd, kp, group = _geometry(q, k, a_q, tiles.block_m)
        _kernels()["_fwd_kernel"][(n_rows, batch * hq)](
            q, k, v, a_q, a_k, out, lse, *strides(q, k, v),
            scale, window, p, tq, k.shape[2], hq, group, dim, a_q.shape[-1],
            ADDITIVE=additive, BLOCK=tiles.block_m, BD=bd, KP=kp, PREC=precision(q), **tiles.options(),
        )  # fmt: skip

    _launch("_fwd_kernel", q, padded(dim), block, launch)
    return out, lse


@_forward_op.register_fake
def _(
    q: Tensor, k: Tensor, v: Tensor, a_q: Tensor, a_k: Tensor, scale: float, window: int, additive: bool, block: int
) -> Any:
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty(q.shape[:3], dtype=acc_dtype(q))


@torch.library.custom_op("focus_triton::soft_backward", mutates_args=())
def _backward_op(
    grad: Tensor, q: Tensor, k: Tensor, v: Tensor, a_q: Tensor, a_k: Tensor, out: Tensor, lse: Tensor,
    scale: float, window: int, additive: bool, block: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """dq, dk, dv (accumulator dtype), d a_q [B, Tq, K'], d a_k [B, Tk, K'] (a_q's dtype)."""
    q, k, v = (last_contiguous(x) for x in (q, k, v))
    a_q, a_k = a_q.contiguous(), a_k.contiguous()
    batch, hq, tq, dim = q.shape
    hk, tk, nk = k.shape[1], k.shape[2], a_q.shape[-1]
    p, _, _, bd, kp, group = _geometry(q, k, a_q, 1)
    acc = acc_dtype(q)
    do = grad.contiguous()
    delta = (do.to(acc) * out.to(acc)).sum(-1)
    dq = torch.empty(q.shape, dtype=acc, device=q.device)
    dk = torch.empty(k.shape, dtype=acc, device=q.device)
    dv = torch.empty(v.shape, dtype=acc, device=q.device)
    daq = torch.empty(batch, hq, tq, nk, dtype=acc, device=q.device)  # per query head
    dak = torch.empty(batch, hk, tk, nk, dtype=acc, device=q.device)  # per key/value head
    common = (*strides(q, k, v), scale, window, p, tq, tk, hq, group, dim, nk)
    kernels = _kernels()

    def meta(tiles: TileConfig) -> dict[str, Any]:
        return dict(ADDITIVE=additive, BLOCK=tiles.block_m, BD=bd, KP=kp, PREC=precision(q), **tiles.options())

    def launch_dq(tiles: TileConfig) -> None:
        n_rows = _geometry(q, k, a_q, tiles.block_m)[1]
        kernels["_dq_kernel"][(n_rows, batch * hq)](q, k, v, a_q, a_k, do, lse, delta, dq, daq, *common, **meta(tiles))

    def launch_dkv(tiles: TileConfig) -> None:
        n_keys = _geometry(q, k, a_q, tiles.block_m)[2]
        kernels["_dkv_kernel"][(n_keys, batch * hk)](
            q, k, v, a_q, a_k, do, lse, delta, dk, dv, dak, *common, **meta(tiles)
        )

    _launch("_dq_kernel", q, bd, block, launch_dq)
    _launch("_dkv_kernel", q, bd, block, launch_dkv)
    return dq, dk, dv, daq.sum(1).to(a_q.dtype), dak.sum(1).to(a_k.dtype)


@_backward_op.register_fake
def _(
    grad: Tensor, q: Tensor, k: Tensor, v: Tensor, a_q: Tensor, a_k: Tensor, out: Tensor, lse: Tensor,
    scale: float, window: int, additive: bool, block: int,
) -> Any:  # fmt: skip
    acc = acc_dtype(q)
    return (q.new_empty(q.shape, dtype=acc), q.new_empty(k.shape, dtype=acc), q.new_empty(v.shape, dtype=acc),
            a_q.new_empty(a_q.shape), a_k.new_empty(a_k.shape))  # fmt: skip


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    q, k, v, a_q, a_k, scale, window, additive, block = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, a_q, a_k, out, lse)
    ctx.meta = (scale, window, additive, block)


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
) -> Tensor:
    """Soft-gated causal attention of q [B, H, Tq, D] at positions ``Tk - Tq .. Tk - 1`` over k, v [B, Hkv, Tk, D]
    at ``0 .. Tk - 1`` (H a multiple of Hkv); g_q [B, Tq, K], g_k [B, Tk, K] assignments, lam [1] the gate strength.
    ``[B, H, Tq, D]`` in q's dtype; values and gradients those of ``flex_soft_attention`` and the dense reference.
    ``block``: a fixed tile size (the tests); by default each kernel's tiles come from ``tile_configs``."""
    additive = gate == "additive"
    a_q, a_k = fold_gate(g_q, g_k, lam, torch.promote_types(q.dtype, torch.float32), additive)
    out, _ = _forward_op(q, k, v, a_q, a_k, float(scale), int(window), additive, int(block or 0))
    return out
