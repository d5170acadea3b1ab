"""Focus hard mode, decode on CUDA: a split-KV Triton kernel over the token's groups' pages and the window (stage 1),
merged by log-sum-exp in torch (stage 2, ``decode_pages.merge``): the two-stage form of sglang's decode attention,
with the group tables of ``decode_pages.GroupPages`` as the page table.

Stage 1, a program per (sequence, key/value head) and split. The token's G = Hq / Hkv query heads of that key head
are the rows of one [G, D] tile (GQA: K and V read once for the group). Splits: ``splits`` per group of the token
(the group's far members, cut into equal runs of whole pages), then one for the window ``(p - w, p]`` (contiguous
rows of the cache). A group's program loads its count ``far`` and its pages' positions from device memory and loops
only over those pages, so the rows read are the far members of the token's groups plus the window, never the rest of
the cache; the grid is static (the cache's shape), so the launch is the same at every token and a CUDA graph can
capture it. A page's row is skipped (masked, not loaded) when the key is also in a lower group of the token (read
there). Each program writes its part's output and log-sum-exp (output 0 and -inf for an empty part).

``ROWS_READ``: where a test asks, the kernel adds the key rows it loads to a counter (atomic adds), the
instrumented gather of ``tests/attention/focus/test_decode_paged.py``.

Accumulators in float32 (float64 for float64 inputs, the interpreter tests). ``triton`` is imported lazily; the
kernel is jitted once per interpreter mode (``TRITON_INTERPRET=1`` runs it on CPU tensors). The launch is the custom
op ``focus_triton::decode_partials``: one opaque node of the compiled step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from model.attention.common.triton import acc_dtype, jit_kernels, last_contiguous, padded, precision
from model.attention.common.triton import available as available  # the module's own question too
from model.attention.focus.hard.decode_pages import PAGE, GroupPages

if TYPE_CHECKING:
    import triton.language as tl
else:
    try:
        import triton.language as tl
    except ImportError:  # the product imports without triton; available() is then False
        tl = None

ROWS_READ: list[Tensor] = []  # tests: an int64 [1] counter the kernel adds its loaded key rows to


def kernel_dtypes() -> tuple[torch.dtype, ...]:
    return (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def splits_for(capacity: int) -> int:
    """Splits per group for a cache of ``capacity`` rows: enough programs to fill the GPU at batch 1 with few heads
    (a group's far rows are about capacity / K), each still looping over several pages; a static number (the grid)."""
    return max(1, min(16, capacity // 1024))


# ---------------------------------------------------------------------------------------------------------------------
# kernel (a plain function, jitted by _kernels())


def _partials_kernel(  # type: ignore[no-untyped-def]  # pointers, strides, constexprs: typed by Triton
    q_ptr, k_ptr, v_ptr, bits_ptr, idx_ptr, far_ptr, grp_ptr, bq_ptr, pos_ptr, o_ptr, lse_ptr, cnt_ptr,
    sqb, sqh, skb, skh, skt, svb, svh, svt, sbits, sidx_b, sidx_k,
    scale, window, HKV, G, D, NK, TOP_K, S, NS,
    PAGE: tl.constexpr, BG: tl.constexpr, BD: tl.constexpr, COUNT: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    bh, sp = tl.program_id(0), tl.program_id(1)
    b, hk = (bh // HKV).to(tl.int64), bh % HKV
    g = tl.arange(0, BG)
    d = tl.arange(0, BD)
    d_ok = d < D
    q = tl.load(q_ptr + b * sqb + (hk * G + g)[:, None] * sqh + d[None, :], mask=(g < G)[:, None] & d_ok[None, :],
                other=0.0)  # fmt: skip
    acc_t = tl.float64 if q.dtype == tl.float64 else tl.float32
    p = tl.load(pos_ptr + b)
    is_grp = sp < TOP_K * S
    part = tl.minimum(sp // S, TOP_K - 1)
    c = tl.load(grp_ptr + b * TOP_K + part)
    one = tl.full([], 1, tl.int64)
    lower = tl.where(is_grp, tl.load(bq_ptr + b) & ((one << c) - 1), 0)  # the token's groups below c
    lo = tl.maximum(p - window + 1, 0)
    begin = tl.where(is_grp, 0, lo)  # group: slots of its table; window: positions of the cache
    n_rows = tl.where(is_grp, tl.load(far_ptr + b * NK + c), p + 1 - lo)
    n_splits = tl.where(is_grp, S, 1)
    per = tl.cdiv(tl.cdiv(n_rows, PAGE), n_splits) * PAGE  # whole pages per split
    start = begin + tl.where(is_grp, sp % S, 0) * per
    end = tl.minimum(start + per, begin + n_rows)
    m = tl.full([BG], float("-inf"), acc_t)
    den = tl.zeros([BG], acc_t)
    acc = tl.zeros([BG, BD], acc_t)
    k_base = b * skb + hk * skh
    v_base = b * svb + hk * svh
    in_grp = (tl.zeros([PAGE], tl.int32) + is_grp.to(tl.int32)) != 0  # a vector mask (the interpreter's loads)
    for t0 in range(start, end, PAGE):
        j = t0 + tl.arange(0, PAGE)
        ok = j < end
        row = tl.where(in_grp, tl.load(idx_ptr + b * sidx_b + c * sidx_k + j, mask=ok & in_grp, other=0), j)
        key_bits = tl.load(bits_ptr + b * sbits + row, mask=ok & in_grp, other=0)
        ok = ok & ((key_bits & lower) == 0)
        kv_mask = ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + k_base + row[:, None] * skt + d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PREC).to(acc_t) * scale  # [BG, PAGE]
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        e = tl.exp(s - m_safe[:, None])
        v = tl.load(v_ptr + v_base + row[:, None] * svt + d[None, :], mask=kv_mask, other=0.0)
        den = den * alpha + tl.sum(e, 1)
        acc = acc * alpha[:, None] + tl.dot(e.to(v.dtype), v, input_precision=PREC).to(acc_t)
        m = m_new
        if COUNT:
            tl.atomic_add(cnt_ptr, tl.sum(ok.to(tl.int64)))
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    has = den > 0
    out = acc / tl.where(has, den, 1.0)[:, None]
    lse = tl.where(has, m_safe + tl.log(tl.where(has, den, 1.0)), float("-inf"))
    row_out = (b * HKV * G + hk * G + g) * NS + sp
    tl.store(o_ptr + row_out[:, None] * D + d[None, :], out.to(o_ptr.dtype.element_ty),
             mask=(g < G)[:, None] & d_ok[None, :])  # fmt: skip
    tl.store(lse_ptr + row_out, lse.to(lse_ptr.dtype.element_ty), mask=g < G)


_KERNELS: dict[bool, dict[str, Any]] = {}


def _kernels() -> dict[str, Any]:
    """The kernel, jitted once per interpreter mode."""
    return jit_kernels(globals(), ("_partials_kernel",), _KERNELS)


# ---------------------------------------------------------------------------------------------------------------------
# launch, as a custom op


def _n_splits(top_k: int, splits: int, window: int) -> int:
    return top_k * splits + (1 if window > 0 else 0)


@torch.library.custom_op("focus_triton::decode_partials", mutates_args=())
def _partials_op(
    q: Tensor, k_all: Tensor, v_all: Tensor, bits_all: Tensor, index: Tensor, far: Tensor, groups: Tensor,
    bits_q: Tensor, p: Tensor, scale: float, window: int, splits: int,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """(outputs [B, Hq, NS, D], log-sum-exps [B, Hq, NS]) of the NS splits, in the accumulator dtype."""
    k_all, v_all = last_contiguous(k_all), last_contiguous(v_all)
    q = q.contiguous()
    bits_all, index, far = bits_all.contiguous(), index.contiguous(), far.contiguous()
    groups, bits_q, p = groups.contiguous(), bits_q.reshape(-1).contiguous(), p.reshape(-1).contiguous()
    batch, hq, _, dim = q.shape
    hkv, top_k = k_all.shape[1], groups.shape[1]
    ns = _n_splits(top_k, splits, window)
    acc = acc_dtype(q)
    outs = torch.empty(batch, hq, ns, dim, dtype=acc, device=q.device)
    lses = torch.empty(batch, hq, ns, dtype=acc, device=q.device)
    counter = ROWS_READ[0] if ROWS_READ else outs  # unused unless COUNT
    bd = padded(dim)
    _kernels()["_partials_kernel"][(batch * hkv, ns)](
        q, k_all, v_all, bits_all, index, far, groups, bits_q, p, outs, lses, counter,
        q.stride(0), q.stride(1), *k_all.stride()[:3], *v_all.stride()[:3], bits_all.stride(0),
        index.stride(0), index.stride(1),
        scale, window, hkv, hq // hkv, dim, far.shape[1], top_k, splits, ns,
        PAGE=PAGE, BG=padded(hq // hkv), BD=bd, COUNT=bool(ROWS_READ), PREC=precision(q), num_warps=4 if bd > 64 else 2,
    )  # fmt: skip
    return outs, lses


@_partials_op.register_fake
def _(
    q: Tensor, k_all: Tensor, v_all: Tensor, bits_all: Tensor, index: Tensor, far: Tensor, groups: Tensor,
    bits_q: Tensor, p: Tensor, scale: float, window: int, splits: int,
) -> Any:  # fmt: skip
    ns = _n_splits(groups.shape[1], splits, window)
    batch, hq, _, dim = q.shape
    return q.new_empty(batch, hq, ns, dim, dtype=acc_dtype(q)), q.new_empty(batch, hq, ns, dtype=acc_dtype(q))


def triton_partials(
    q: Tensor, k_all: Tensor, v_all: Tensor, bits_all: Tensor, pages: GroupPages, groups: Tensor, bits_q: Tensor,
    p: Tensor, *, window: int, scale: float, splits: int,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """``decode_pages.torch_partials``'s parts, cut into splits, by the kernel (see the module docstring)."""
    return _partials_op(
        q, k_all, v_all, bits_all, pages.index, pages.far, groups, bits_q, p, float(scale), int(window), int(splits)
    )
