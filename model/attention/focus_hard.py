"""Focus hard mode, exact and fast (paper appendix E.4), for any top_k.

The hard mask: query i attends key j iff j <= i and (i - j < window or their group memberships intersect). Its pairs
split into disjoint parts; each part is one attention call returning (output, logsumexp), and the parts merge exactly
by logsumexp. The dense masked reference stays in ``focus.py``; ``group_sparse.hard_attention`` is the batched dense
decomposition kept for devices without these kernels.

CPU, ``cpu_hard_attention``: every part is a call of the fused CPU flash kernel
(``aten._scaled_dot_product_flash_attention_for_cpu``, which returns the logsumexp).
- Group c, per sequence: c's members in position order (picking them in order is the stable sort by group). For a
  sequence from position 0 (training, prefill) the kernel's own causal mask on the sorted members is causal masking on
  original positions, so a group is one unmasked call over about top_k * T / K tokens. With top_k > 1 a pair sharing
  several groups is counted once, in its lowest shared group: group c drops pairs that also share a lower group, with
  an additive mask built per chunk of queries (O(chunk x members), never O(T^2)). Chunked prefill onto a cache does
  the same with causal masking on positions.
- The cross-group local band (i - j < window, no shared group): query blocks of ``window`` rows against the
  2 * ``window`` keys before them, as strided views of q, k and v (no copies) in chunks of blocks, masked.
- Backward: the kernel's backward of each part, given the merged output O and logsumexp L of the whole row
  (P_ij = exp(s_ij - L_i) and D_i = dO_i . O_i are then the full row's), so the parts' gradients add up exactly.
Memory: the output, one group's gathered q/k/v and one mask chunk: O(T * D + T / K * D + chunk), not O(T^2).

Decode, ``decode_hard_attention``: the new token reads the window (every pair inside it is allowed) and, farther
back, only the members of its own groups, from per-group index lists kept with the KV cache (``GroupLists``); with
top_k > 1 a key found in several of the query's groups is taken once. Per-token cost is about w + top_k * T / K keys.

GPU, ``flex_hard_attention``: the same two parts as two FlexAttention calls. Group part: tokens sorted by group into
one sequence of top_k * T slots (a token in k groups has k slots), mask ``same group & causal(original positions) &
lowest shared group``, block mask built from the group counts (each query block's key blocks are the span of its
groups' causal ranges; blocks wholly inside one group and causally complete are full). Band part: original order,
mask ``causal & i - j < window & no shared group``, a sliding-window block mask that depends only on the shape and is
cached and shared by every layer. Neither block mask is ever expanded to tokens.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from model.attention.flex import cached_block_mask, flex_attention_fn

_FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
MASK_ELEMENTS = 1 << 20  # entries of one additive mask chunk (4 MiB in float32)
GROUP_CHUNK = 2048  # a group with more members runs as query chunks of this size (peak memory)
STACK_SLACK = 1.25  # top_k = 1: one call for all groups while padding them to the largest adds <= 25% rows
STACK_ROWS = 4096  # ... and while the stacked rows are few (it gathers q, k, v whole: memory grows with them)
BAND_ELEMENTS = 1 << 19  # mask entries per band chunk (2 MiB in float32: keeps the peak memory near the output's)
CLASS_LEVELS = (1024, 128)  # query chunk sizes of the class split's staircase (see HardPlan._class_parts)
CLASS_LIMIT = 4  # class split while the distinct memberships per sequence are at most CLASS_LIMIT * K
NEG_INF = float("-inf")


def cpu_kernel_dtypes() -> tuple[torch.dtype, ...]:
    return (torch.float32, torch.float64, torch.bfloat16, torch.float16)


# ---- selectors: which rows of a [B, H, T, ...] tensor one kernel call reads ------------------------------------
def take_rows(x: Tensor, b: int, idx: Tensor) -> Tensor:
    """``x[b][:, idx]`` ([H, n, ...]) as row copies. A KV-cache view (the first rows of a longer buffer) is re-viewed
    over its whole buffer, which is contiguous, so ``index_select`` copies rows; on the view itself it would first
    copy the whole view, and advanced indexing copies element by element (both several times slower)."""
    xb = x[b]
    if not xb.is_contiguous() and xb.dim() == 3 and xb.stride(2) == 1 and xb.stride(1) == xb.shape[2]:
        rows, rem = divmod(xb.stride(0), xb.stride(1))
        end = (xb.storage_offset() + xb.shape[0] * xb.stride(0)) * xb.element_size()
        if rem == 0 and end <= xb.untyped_storage().nbytes():
            xb = xb.as_strided((xb.shape[0], rows, xb.shape[2]), xb.stride())
    return xb.index_select(1, idx) if xb.is_contiguous() else xb[:, idx]


class _Rows:
    """Rows ``idx`` of sequence ``b``: one problem, [1, H, L, ...] (a gathered copy)."""

    def __init__(self, b: int, idx: Tensor):
        self.b, self.idx = b, idx

    def take(self, x: Tensor) -> Tensor:
        return take_rows(x, self.b, self.idx).unsqueeze(0)

    def put(self, dst: Tensor, val: Tensor) -> None:
        dst[self.b].index_copy_(1, self.idx, val[0].to(dst.dtype))

    def add(self, dst: Tensor, val: Tensor) -> None:
        dst[self.b].index_add_(1, self.idx, val[0].to(dst.dtype))


class _Stacked:
    """N position-ordered row lists of sequence ``b``, each padded at its end to L rows, gathered in one go as N
    problems [N, H, L, ...]. Padded slots repeat row 0; they follow every real row of their list, so under the
    kernel's causal mask no real query sees them; they are never written back, and the backward gives them zero
    probability (``_Part.pad``)."""

    def __init__(self, b: int, idx: Tensor, real: Tensor):
        self.b, self.idx = b, idx  # [N, L] token rows
        self.real = torch.nonzero(real.flatten()).squeeze(1)  # slots holding real rows
        self.rows = idx.flatten()[self.real]

    def take(self, x: Tensor) -> Tensor:
        n, length = self.idx.shape
        return take_rows(x, self.b, self.idx.flatten()).unflatten(1, (n, length)).transpose(0, 1)

    def _real(self, val: Tensor) -> Tensor:
        flat = val.transpose(0, 1).flatten(1, 2)  # [H, N * L, ...]
        return flat.index_select(1, self.real)

    def put(self, dst: Tensor, val: Tensor) -> None:
        dst[self.b].index_copy_(1, self.rows, self._real(val).to(dst.dtype))

    def add(self, dst: Tensor, val: Tensor) -> None:
        dst[self.b].index_add_(1, self.rows, self._real(val).to(dst.dtype))


class _Gathered:
    """Rows ``idx`` of sequence ``b`` gathered once per source tensor, shared by the parts that read slices of them
    (``part``); gradients into them accumulate in a gathered buffer that ``flush`` scatters back."""

    def __init__(self, b: int, idx: Tensor):
        self.b, self.idx = b, idx
        self._rows: dict[int, Tensor] = {}
        self._grads: dict[int, tuple[Tensor, Tensor]] = {}

    def rows(self, x: Tensor) -> Tensor:
        if id(x) not in self._rows:
            self._rows[id(x)] = take_rows(x, self.b, self.idx).unsqueeze(0)
        return self._rows[id(x)]

    def grad(self, dst: Tensor) -> Tensor:
        if id(dst) not in self._grads:
            shape = (1, dst.shape[1], self.idx.numel(), *dst.shape[3:])
            self._grads[id(dst)] = (dst, torch.zeros(shape, dtype=dst.dtype, device=dst.device))
        return self._grads[id(dst)][1]

    def part(self, lo: int, hi: int) -> _Slice:
        return _Slice(self, lo, hi)

    def flush(self) -> None:
        for dst, buf in self._grads.values():
            dst[self.b].index_add_(1, self.idx, buf[0])
        self._grads.clear()
        self._rows.clear()


class _Slice:
    """Rows [lo, hi) of a ``_Gathered`` set (keys only: reads come from the shared gather)."""

    def __init__(self, base: _Gathered, lo: int, hi: int):
        self.base, self.lo, self.hi = base, lo, hi

    def take(self, x: Tensor) -> Tensor:
        return self.base.rows(x)[:, :, self.lo : self.hi]

    def add(self, dst: Tensor, val: Tensor) -> None:
        self.base.grad(dst)[:, :, self.lo : self.hi] += val.to(dst.dtype)


class _Range:
    """Rows [lo, hi) of sequence ``b``: one problem, [1, H, hi - lo, ...] (a view)."""

    def __init__(self, b: int, lo: int, hi: int):
        self.b, self.lo, self.hi = b, lo, hi

    def take(self, x: Tensor) -> Tensor:
        return x[self.b : self.b + 1, :, self.lo : self.hi]

    def put(self, dst: Tensor, val: Tensor) -> None:
        self.take(dst).copy_(val)

    def add(self, dst: Tensor, val: Tensor) -> None:
        self.take(dst).add_(val.to(dst.dtype))


class _Blocks:
    """``n`` consecutive blocks of ``w`` rows from ``start`` of sequence ``b``: n problems, [n, H, w, ...] (a view)."""

    def __init__(self, b: int, start: int, n: int, w: int):
        self.b, self.start, self.n, self.w = b, start, n, w

    def take(self, x: Tensor) -> Tensor:
        return x[self.b, :, self.start : self.start + self.n * self.w].unflatten(1, (self.n, self.w)).transpose(0, 1)

    def put(self, dst: Tensor, val: Tensor) -> None:
        self.take(dst).copy_(val)

    def add(self, dst: Tensor, val: Tensor) -> None:
        self.take(dst).add_(val.to(dst.dtype))


class _Windows:
    """``n`` windows of ``size`` rows starting at ``start + j step`` (j < n) of sequence ``b``: [n, H, size, D], an
    overlapping view. ``size`` is a multiple of ``step``; gradients add as size / step non-overlapping block views."""

    def __init__(self, b: int, start: int, n: int, step: int, size: int):
        self.b, self.start, self.n, self.step, self.size = b, start, n, step, size

    def take(self, x: Tensor) -> Tensor:
        span = x[self.b, :, self.start : self.start + (self.n - 1) * self.step + self.size]
        return span.unfold(1, self.size, self.step).permute(1, 0, 3, 2)

    def add(self, dst: Tensor, val: Tensor) -> None:
        for i in range(0, self.size, self.step):
            _Blocks(self.b, self.start + i, self.n, self.step).add(dst, val[:, :, i : i + self.step])


@dataclass
class _Part:
    q: Any  # selector of query rows
    k: Any  # selector of key / value rows
    causal: bool  # the kernel's own (top-left) causal mask; exact when query rows == key rows, in order
    mask: Tensor | None = None  # additive, broadcastable to [N, H, Lq, Lk]
    nonempty: Tensor | None = None  # [N, 1, Lq]: rows with at least one allowed key (None: all)
    exclusive: bool = False  # the only part of these rows so far (written, not merged)
    pad: Tensor | None = None  # [N, 1, Lq]: padded query slots (no gradient flows through them)


def _additive(allowed: Tensor, dtype: torch.dtype) -> Tensor:
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    return torch.where(allowed, zero, torch.full_like(zero, NEG_INF))


def _narrow(bits: Tensor, n_groups: int) -> Tensor:
    """Bitmasks in the narrowest integer type that holds them (the masks' bitwise work is memory-bound)."""
    for dtype, limit in ((torch.int8, 7), (torch.int16, 15), (torch.int32, 31)):
        if n_groups <= limit:
            return bits.to(dtype)
    return bits


# ---- the plan: the disjoint parts of one call ------------------------------------------------------------------
class HardPlan:
    """The parts of the hard mask for queries at positions [start, start + Tq) over keys [0, start + Tq)."""

    def __init__(
        self,
        bits_q: Tensor,
        bits_k: Tensor,
        *,
        start: int,
        window: int,
        n_groups: int,
        top_k: int,
        split: str = "auto",
    ):
        self.bits_q, self.bits_k = bits_q, bits_k
        self.start, self.window, self.n_groups, self.top_k = start, window, n_groups, top_k
        self.tq, self.tk = bits_q.shape[1], bits_k.shape[1]
        if self.start + self.tq != self.tk:
            raise ValueError(f"queries at [{start}, {start + self.tq}) must end the {self.tk} keys")
        # top_k > 1: split by query class unless there are so many classes that gathering keys per class costs more
        # than the lowest-shared-group split's de-duplication masks
        self.split = split
        if split == "auto":
            n_classes = max(int(torch.unique(row).numel()) for row in bits_q) if bits_q.numel() else 0
            self.split = "class" if n_classes <= CLASS_LIMIT * n_groups else "group"
        self.bits_q, self.bits_k = _narrow(bits_q, n_groups), _narrow(bits_k, n_groups)

    def parts(self, dtype: torch.dtype) -> Iterator[_Part]:
        for b in range(self.bits_q.shape[0]):
            if self.split == "class" and (self.top_k > 1 or self.start > 0):
                yield from self._class_parts(b, dtype)
            else:
                yield from self._group_parts(b, dtype)
        for b in range(self.bits_q.shape[0]):
            yield from self._band_parts(b, dtype)

    def _class_parts(self, b: int, dtype: torch.dtype) -> Iterator[_Part]:
        """The queries of one membership class X attend, causally and at any distance, every key that shares a group
        with X. A query has one class, so these parts are disjoint with no de-duplication masks.

        Keys are gathered once per class (position order). Queries go in chunks of CLASS_LEVELS[0]; a chunk reads
        the keys before its first query unmasked, and the rest (the staircase up to its last query) is split the
        same way into chunks of the next level, down to a causal-masked strip of the last level's size. Big chunks
        keep the kernel efficient; small last-level chunks keep the masked strips short."""
        bq, bk = self.bits_q[b], self.bits_k[b]
        for x in torch.unique(bq).tolist():
            iq = torch.nonzero(bq == x).squeeze(1)
            ik = torch.nonzero(bk & x).squeeze(1)  # position order
            q_pos = iq + self.start
            starts = torch.searchsorted(ik, q_pos).tolist()  # keys before each query
            ends = torch.searchsorted(ik, q_pos, right=True).tolist()  # keys at or before each query
            yield from self._staircase(b, iq, ik, q_pos, _Gathered(b, ik), starts, ends, 0, iq.numel(), 0, 0, dtype)

    def _staircase(self, b, iq, ik, q_pos, keys, starts, ends, lo, hi, k_lo, level, dtype) -> Iterator[_Part]:
        """Queries [lo, hi) of a class over keys from ``k_lo`` on (the keys before ``k_lo`` are done)."""
        size = CLASS_LEVELS[level]
        for a in range(lo, hi, size):
            e = min(a + size, hi)
            rows, n_pre = _Rows(b, iq[a:e]), max(k_lo, starts[a])
            if n_pre > k_lo:
                yield _Part(rows, keys.part(k_lo, n_pre), causal=False)
            if level + 1 < len(CLASS_LEVELS) and e - a > CLASS_LEVELS[level + 1]:
                yield from self._staircase(b, iq, ik, q_pos, keys, starts, ends, a, e, n_pre, level + 1, dtype)
                continue
            n_end = ends[e - 1]
            allowed = ik[None, n_pre:n_end] <= q_pos[a:e, None]
            yield _Part(
                rows,
                keys.part(n_pre, n_end),
                causal=False,
                mask=_additive(allowed, dtype)[None, None],
                nonempty=allowed.any(-1)[None, None],
            )

    def _group_parts(self, b: int, dtype: torch.dtype) -> Iterator[_Part]:
        aligned = self.start == 0  # queries == keys: sorted order is causal order for both
        bq, bk = self.bits_q[b], self.bits_k[b]
        if aligned and self.top_k == 1:
            stacked = self._stacked_groups(b)
            if stacked is not None:
                yield stacked
                return
        for c in range(self.n_groups):
            ik = torch.nonzero((bk >> c) & 1).squeeze(1)  # c's members, in position order
            if ik.numel() == 0:
                continue
            iq = ik if aligned else torch.nonzero((bq >> c) & 1).squeeze(1)
            if iq.numel() == 0:
                continue
            dedup = self.top_k > 1 and c > 0
            if dedup:  # pairs also sharing a group below c were counted there
                lower = (1 << c) - 1
                lk, lq = bk[ik] & lower, bq[iq] & lower
                dedup = bool(lk.any()) and bool(lq.any())
            exclusive = self.top_k == 1
            if aligned and not dedup and ik.numel() > GROUP_CHUNK:  # big group: bound the gathered queries and output
                keys = _Gathered(b, ik)
                for a in range(0, ik.numel(), GROUP_CHUNK):
                    e = min(a + GROUP_CHUNK, ik.numel())
                    rows = _Rows(b, ik[a:e])
                    yield _Part(rows, keys.part(a, e), causal=True, exclusive=exclusive)  # the diagonal block
                    if a > 0:
                        yield _Part(rows, keys.part(0, a), causal=False)  # every earlier member: unmasked
                continue
            if aligned and not dedup:
                yield _Part(_Rows(b, iq), _Rows(b, ik), causal=True, exclusive=exclusive)
                continue
            q_pos = iq + self.start
            rows = max(16, MASK_ELEMENTS // ik.numel())
            for a in range(0, iq.numel(), rows):
                e = min(a + rows, iq.numel())
                n_keys = e if aligned else int(torch.searchsorted(ik, q_pos[e - 1], right=True))
                if n_keys == 0:
                    continue
                keys = ik[:n_keys]
                allowed = keys[None, :] <= q_pos[a:e, None]
                if dedup:
                    allowed &= (lq[a:e, None] & lk[None, :n_keys]) == 0
                yield _Part(
                    _Rows(b, iq[a:e]),
                    _Rows(b, keys),
                    causal=False,
                    mask=_additive(allowed, dtype)[None, None],
                    nonempty=allowed.any(-1)[None, None],
                    exclusive=exclusive,
                )

    def _stacked_groups(self, b: int) -> _Part | None:
        """top_k = 1 from position 0 with balanced groups: every group in one kernel call, each padded at its end
        to the largest group's size (None when that padding would exceed STACK_SLACK of the tokens, or the stack
        STACK_ROWS rows: short sequences, where per-call overheads weigh most)."""
        groups = self.bits_k[b].long().bitwise_and(-self.bits_k[b].long()).log2().long()  # the one set bit
        counts = torch.bincount(groups, minlength=self.n_groups)
        length = int(counts.max())
        if self.n_groups * length > STACK_SLACK * self.tk or self.n_groups * length > STACK_ROWS:
            return None
        order = torch.sort(groups, stable=True).indices  # members of group 0, then 1, ... in position order
        starts = torch.cumsum(counts, 0) - counts
        slot = torch.arange(length, device=groups.device)
        real = slot[None, :] < counts[:, None]  # [K, L]
        idx = torch.where(real, order[(starts[:, None] + slot[None, :]).clamp(max=self.tk - 1)], 0)
        sel = _Stacked(b, idx, real)
        return _Part(sel, sel, causal=True, exclusive=True, pad=~real[:, None, :])

    def _band_parts(self, b: int, dtype: torch.dtype) -> Iterator[_Part]:
        """Pairs with i - j < w sharing no group: blocks of ``bs`` queries against the w + bs keys ending with them
        (strided views), ``bs`` a divisor of w; the first queries (keys before position 0) and a partial last block
        as plain ranges."""
        w, p0, tq = self.window, self.start, self.tq
        bs = band_block(w)
        bq, bk = self.bits_q[b], self.bits_k[b]
        first = max(0, -((p0 - w) // bs))  # block j reads keys from p0 + j bs - w, which must be >= 0
        n_full = tq // bs
        ranges = [(0, min(first * bs, tq))] if first > 0 else []
        if n_full > first:
            r = torch.arange(bs, device=bq.device)
            s = torch.arange(bs + w, device=bq.device)
            local = (s[None, :] > r[:, None]) & (s[None, :] <= r[:, None] + w)  # key p0+j bs-w+s, query p0+j bs+r
            per_chunk = max(1, BAND_ELEMENTS // (bs * (bs + w)))
            for j in range(first, n_full, per_chunk):
                n = min(per_chunk, n_full - j)
                qbits = bq[j * bs : (j + n) * bs].view(n, bs)
                k0 = p0 + j * bs - w
                kbits = bk[k0 : k0 + (n - 1) * bs + bs + w].unfold(0, bs + w, bs)  # [n, bs + w]
                allowed = local & ((qbits[:, :, None] & kbits[:, None, :]) == 0)
                yield _Part(
                    _Blocks(b, j * bs, n, bs),
                    _Windows(b, k0, n, bs, bs + w),
                    causal=False,
                    mask=_additive(allowed, dtype)[:, None],
                    nonempty=allowed.any(-1)[:, None],
                )
        if max(n_full, first) * bs < tq:
            ranges.append((max(n_full, first) * bs, tq))
        for lo, hi in ranges:
            k_lo, k_hi = max(0, p0 + lo - w + 1), p0 + hi
            q_pos = torch.arange(p0 + lo, p0 + hi, device=bq.device)
            dist = q_pos[:, None] - torch.arange(k_lo, k_hi, device=bq.device)[None, :]
            allowed = (dist >= 0) & (dist < w) & ((bq[lo:hi, None] & bk[None, k_lo:k_hi]) == 0)
            yield _Part(
                _Range(b, lo, hi),
                _Range(b, k_lo, k_hi),
                causal=False,
                mask=_additive(allowed, dtype)[None, None],
                nonempty=allowed.any(-1)[None, None],
            )


BAND_BLOCK = 64


def band_block(window: int) -> int:
    """Query block of the band: the largest divisor of ``window`` up to BAND_BLOCK (keys read per query block:
    window + block, so a smaller block wastes less; too small a block starves the kernel)."""
    return max(d for d in range(1, min(window, BAND_BLOCK) + 1) if window % d == 0)


# ---- forward, backward, merge ------------------------------------------------------------------------------------
def _merge(sel, out: Tensor, lse: Tensor, o: Tensor, lse_part: Tensor) -> None:
    """Fold one part's (output, logsumexp) into the running ones, in place where the selector is a view."""
    cur = sel.take(lse)
    new = torch.logaddexp(cur, lse_part)
    ref = new.masked_fill(new == NEG_INF, 0.0)  # rows with nothing yet stay at zero
    acc = sel.take(out)
    acc.mul_(torch.exp(cur - ref)[..., None]).addcmul_(o, torch.exp(lse_part - ref)[..., None])
    if isinstance(sel, _Rows):  # a gathered copy: write back
        sel.put(out, acc)
        sel.put(lse, new)
    else:
        cur.copy_(new)


def _forward(q: Tensor, k: Tensor, v: Tensor, plan: HardPlan, scale: float) -> tuple[Tensor, Tensor]:
    cdt = torch.promote_types(q.dtype, torch.float32)
    b, h, tq, d = q.shape
    out = torch.zeros(b, h, tq, d, dtype=cdt, device=q.device)
    lse = torch.full((b, h, tq), NEG_INF, dtype=cdt, device=q.device)
    for part in plan.parts(q.dtype):
        o, lse_part = _FWD(
            part.q.take(q), part.k.take(k), part.k.take(v), 0.0, part.causal, attn_mask=part.mask, scale=scale
        )
        if part.nonempty is not None:  # the kernel gives a row with no key lse 0, not -inf
            lse_part = lse_part.masked_fill(~part.nonempty, NEG_INF)
        if part.exclusive:
            part.q.put(out, o)
            part.q.put(lse, lse_part)
        else:
            _merge(part.q, out, lse, o.to(cdt), lse_part.to(cdt))
    return out, lse


def _backward(dout, q, k, v, out, lse, plan: HardPlan, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    cdt = out.dtype
    dq = torch.zeros(q.shape, dtype=cdt, device=q.device)
    dk = torch.zeros(k.shape, dtype=cdt, device=k.device)
    dv = torch.zeros(v.shape, dtype=cdt, device=v.device)
    dout, out_q = dout.to(q.dtype), out.to(q.dtype)
    lse = lse.to(torch.promote_types(q.dtype, torch.float32))
    shared = None  # the gathered key set the last parts read: scatter its gradients when the parts move on
    for part in plan.parts(q.dtype):
        base = part.k.base if isinstance(part.k, _Slice) else None
        if shared is not None and base is not shared:
            shared.flush()
        shared = base
        lse_q = part.q.take(lse)
        if part.pad is not None:  # padded query slots: zero probability, so nothing flows into the keys
            lse_q = lse_q.masked_fill(part.pad, float("inf"))
        gq, gk, gv = _BWD(
            part.q.take(dout),
            part.q.take(q),
            part.k.take(k),
            part.k.take(v),
            part.q.take(out_q),
            lse_q,
            0.0,
            part.causal,
            attn_mask=part.mask,
            scale=scale,
        )
        part.q.add(dq, gq)
        part.k.add(dk, gk)
        part.k.add(dv, gv)
    if shared is not None:
        shared.flush()
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _HardAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan, scale):
        out, lse = _forward(q, k, v, plan, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.scale = plan, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        return (*_backward(dout, q, k, v, out, lse, ctx.plan, ctx.scale), None, None)


def cpu_hard_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    bits_q: Tensor,
    bits_k: Tensor,
    window: int,
    scale: float,
    n_groups: int,
    top_k: int,
    split: str = "auto",
) -> Tensor:
    """Exact hard-mode attention on the fused CPU kernel, with gradients.

    q [B, H, Tq, D]; k, v [B, Hkv, Tk, D] (GQA: H a multiple of Hkv); the queries are the last Tq of the Tk tokens
    (training and prefill: Tq == Tk; chunked prefill and decode onto a cache). bits_q [B, Tq], bits_k [B, Tk]: group
    membership bitmasks. ``split``: how the group parts are made disjoint for top_k > 1 (or a chunk onto a cache):
    ``class`` (per query membership class), ``group`` (each pair in its lowest shared group), ``auto`` (class unless
    there are more than CLASS_LIMIT * K classes). Returns [B, H, Tq, D] in q's dtype.
    """
    plan = HardPlan(
        bits_q, bits_k, start=k.shape[2] - q.shape[2], window=window, n_groups=n_groups, top_k=top_k, split=split
    )
    if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
        return _HardAttention.apply(q, k, v, plan, scale)
    return _forward(q, k, v, plan, scale)[0].to(q.dtype)


# ---- decode: per-group index lists in the KV cache ----------------------------------------------------------------
class GroupLists:
    """Per (sequence, group): the positions of the group's members so far, ascending (the hard-mode KV cache)."""

    def __init__(self, batch: int, n_groups: int, device: torch.device | str, capacity: int = 256):
        self.n_groups = n_groups
        self.index = torch.zeros(batch, n_groups, capacity, dtype=torch.long, device=device)
        self.counts = [[0] * n_groups for _ in range(batch)]  # members per (sequence, group)
        self.length = 0  # tokens appended
        self.rows: GroupRows | None = None  # CPU decoding: the groups' keys and values, contiguous

    @property
    def count(self) -> Tensor:
        return torch.tensor(self.counts, dtype=torch.long, device=self.index.device)

    def _reserve(self, need: int) -> None:
        if need > self.index.shape[2]:
            grown = self.index.new_zeros(*self.index.shape[:2], max(need, 2 * self.index.shape[2]))
            grown[:, :, : self.index.shape[2]] = self.index
            self.index = grown

    def append(self, bits: Tensor) -> None:
        """bits [B, t]: memberships of the tokens at positions [length, length + t)."""
        if bits.shape[1] == 1:  # decoding: a few scalar writes
            words = bits[:, 0].tolist()
            self._reserve(max(max(row) for row in self.counts) + 1)
            for b, word in enumerate(words):
                for c in range(self.n_groups):
                    if (word >> c) & 1:
                        self.index[b, c, self.counts[b][c]] = self.length
                        self.counts[b][c] += 1
            self.length += 1
            return
        member = ((bits[:, :, None] >> torch.arange(self.n_groups, device=bits.device)) & 1).bool()  # [B, t, K]
        count = self.count
        added = member.sum(1)
        self._reserve(int((count + added).max()) if member.numel() else 0)
        slot = count[:, None, :] + member.long().cumsum(1) - 1  # [B, t, K]
        b, i, c = member.nonzero(as_tuple=True)
        self.index[b, c, slot[b, i, c]] = self.length + i
        self.counts = (count + added).tolist()
        self.length += bits.shape[1]

    def members(self, b: int, c: int, count: int) -> Tensor:
        return self.index[b, c, :count]


class GroupRows:
    """Per (sequence, group): the keys and values of the group's members, contiguous and in position order, copied
    from the KV cache as tokens arrive (``sync``). CPU decoding then reads a group's far keys as one slice instead of
    gathering them every step. Costs top_k times the raw keys and values (plus growth room)."""

    def __init__(self, batch: int, n_groups: int):
        self.k: list[list[Tensor | None]] = [[None] * n_groups for _ in range(batch)]
        self.v: list[list[Tensor | None]] = [[None] * n_groups for _ in range(batch)]
        self.stored = [[0] * n_groups for _ in range(batch)]

    def sync(self, lists: GroupLists, k: Tensor, v: Tensor) -> None:
        """Copy in the members the lists gained since the last call (k, v: [B, Hkv, Tk, D], the cache so far)."""
        for b, row in enumerate(lists.counts):
            for c, count in enumerate(row):
                have = self.stored[b][c]
                if count == have:
                    continue
                new = lists.members(b, c, count)[have:]
                kb, vb = self.k[b][c], self.v[b][c]
                if kb is None or kb.shape[1] < count:
                    cap = max(count + 64, int(1.5 * (0 if kb is None else kb.shape[1])))
                    grown_k = k.new_empty(k.shape[1], cap, k.shape[3])
                    grown_v = v.new_empty(v.shape[1], cap, v.shape[3])
                    if kb is not None:
                        grown_k[:, :have], grown_v[:, :have] = kb[:, :have], vb[:, :have]
                    self.k[b][c], self.v[b][c] = kb, vb = grown_k, grown_v
                if new.numel() == 1:  # decoding: one row, no gather
                    kb[:, have] = k[b, :, int(new)]
                    vb[:, have] = v[b, :, int(new)]
                else:
                    kb[:, have:count] = take_rows(k, b, new)
                    vb[:, have:count] = take_rows(v, b, new)
                self.stored[b][c] = count


def cpu_decode_hard_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    bits_q: Tensor,
    bits_k: Tensor,
    lists: GroupLists,
    window: int,
    scale: float,
) -> Tensor:
    """``decode_hard_attention`` on the CPU kernel, reading each of the token's groups' far keys as one contiguous
    slice of ``GroupRows`` (kept in ``lists.rows``) and the window as a slice of the cache; the parts (window, one per
    group) merge by logsumexp. With top_k > 1 a far key also in a lower group of the token is masked in the higher
    one. No autograd (the kernel's logsumexp has no gradient): the caller uses ``decode_hard_attention`` then."""
    b_size, tk = q.shape[0], k.shape[2]
    lo = max(0, tk - window)  # keys [lo, tk) are inside the window: all allowed
    if lists.rows is None:
        lists.rows = GroupRows(b_size, lists.n_groups)
    lists.rows.sync(lists, k, v)
    counts = lists.counts
    outs = []
    for b in range(b_size):
        own = int(bits_q[b, 0])
        qb = q[b : b + 1]
        o, lse = _FWD(qb, k[b : b + 1, :, lo:], v[b : b + 1, :, lo:], 0.0, False, scale=scale)
        parts = [(o, lse)]
        for c in range(lists.n_groups):
            if not (own >> c) & 1:
                continue
            idx = lists.members(b, c, counts[b][c])
            n_far = int(torch.searchsorted(idx, lo))  # members before the window
            if n_far == 0:
                continue
            mask = None
            lower = own & ((1 << c) - 1)
            if lower:  # a key also in a lower group of the token was taken there
                dup = (bits_k[b, idx[:n_far]] & lower) != 0
                if bool(dup.all()):
                    continue
                mask = _additive(~dup, q.dtype)[None, None, None]
            kc, vc = lists.rows.k[b][c][None, :, :n_far], lists.rows.v[b][c][None, :, :n_far]
            parts.append(_FWD(qb, kc, vc, 0.0, False, attn_mask=mask, scale=scale))
        if len(parts) == 1:
            outs.append(o)
            continue
        total = parts[0][1]
        for _, lse_part in parts[1:]:
            total = torch.logaddexp(total, lse_part)
        out = sum(o_part * torch.exp(lse_part - total)[..., None] for o_part, lse_part in parts)  # elementwise only
        outs.append(out.to(q.dtype))
    return torch.cat(outs, 0)


def decode_hard_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    bits_q: Tensor,
    bits_k: Tensor,
    lists: GroupLists,
    window: int,
    scale: float,
) -> Tensor:
    """One new token per sequence (q [B, H, 1, D], the last of the Tk cached keys): exact hard attention reading the
    window and the far members of the token's groups only. Any device; SDPA does the attention."""
    b_size, tk = q.shape[0], k.shape[2]
    p = tk - 1
    lo = max(0, p - window + 1)  # keys [lo, p] are inside the window: all allowed
    counts = lists.counts
    near = torch.arange(lo, tk, device=q.device)
    outs = []
    for b in range(b_size):
        own = int(bits_q[b, 0])
        far = []
        for c in range(lists.n_groups):
            if not (own >> c) & 1:
                continue
            idx = lists.members(b, c, counts[b][c])
            idx = idx[: int(torch.searchsorted(idx, lo))]  # members before the window
            lower = own & ((1 << c) - 1)
            if lower and idx.numel():  # a key also in a lower group of the query was taken there
                idx = idx[(bits_k[b, idx] & lower) == 0]
            far.append(idx)
        keys = torch.cat([*far, near])
        kb, vb = take_rows(k, b, keys)[None], take_rows(v, b, keys)[None]
        outs.append(
            F.scaled_dot_product_attention(q[b : b + 1], kb, vb, scale=scale, enable_gqa=kb.shape[1] != q.shape[1])
        )
    return torch.cat(outs, 0)


# ---- GPU: two FlexAttention calls -----------------------------------------------------------------------------------
FLEX_BLOCK = 128


def _group_layout(bits: Tensor, n_groups: int) -> tuple[Tensor, Tensor]:
    """Slots sorted by (group, position): (token index [B, N], group [B, N]), N = top_k * T for every sequence."""
    member = ((bits[:, None, :] >> torch.arange(n_groups, device=bits.device)[None, :, None]) & 1).bool()  # [B, K, T]
    nz = member.nonzero()  # sorted by (b, c, t)
    n = nz.shape[0] // bits.shape[0]
    nz = nz.view(bits.shape[0], n, 3)
    return nz[..., 2], nz[..., 1]


def group_block_mask_tensors(
    group_q: Tensor,
    pos_q: Tensor,
    group_k: Tensor,
    pos_k: Tensor,
    *,
    n_groups: int,
    n_positions: int,
    full_ok: bool,
    block: int = FLEX_BLOCK,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Block structure of the group call from the group counts: (kv_num_blocks, kv_indices, full_kv_num_blocks,
    full_kv_indices), shapes [B, 1, nq] and [B, 1, nq, nk].

    Query slot (c, position p) attends key slots of group c with position <= p: the slot range
    [start_c, start_c + count of c's keys at positions <= p). A query block's key blocks are the span of its slots'
    ranges; a key block is full when the query block is all one group, the key block lies inside that group's range
    and precedes the query block's first position (and ``full_ok``: no lowest-shared-group masking). Positions are
    below ``n_positions``. Tensor work of O(B (N / block)^2) at most; no host synchronisation.
    """
    bsz, nq_slots = group_q.shape
    nk_slots = group_k.shape[1]
    dev = group_q.device
    counts_k = torch.zeros(bsz, n_groups, dtype=torch.long, device=dev).scatter_add_(
        1, group_k, torch.ones_like(group_k)
    )
    starts_k = torch.cumsum(counts_k, 1) - counts_k  # [B, K]
    # keys of group c at positions <= p: the number of c's key slots with pos <= p, by a searchsorted per group
    slot_start = starts_k.gather(1, group_q)  # [B, Nq]
    # key slot positions are ascending within a group: search p in the (group, position) order as one key g * P + p
    big = n_positions
    key_order = group_k * big + pos_k  # ascending along slots
    hi = torch.searchsorted(key_order, group_q * big + pos_q, right=True)  # [B, Nq]: one past the last allowed key
    nq = (nq_slots + block - 1) // block
    nk = (nk_slots + block - 1) // block
    pad = nq * block - nq_slots

    def per_block(x: Tensor, fill: int, reduce: str) -> Tensor:
        x = F.pad(x, (0, pad), value=fill).view(bsz, nq, block)
        return x.amin(-1) if reduce == "min" else x.amax(-1)

    lo_blk = per_block(slot_start, nk_slots, "min") // block  # [B, nq]
    hi_blk = (per_block(hi, 0, "max") - 1).clamp(min=0) // block  # last key block touched
    n_blocks = (hi_blk - lo_blk + 1).clamp(min=0)
    # full blocks: a single-group query block, key blocks inside its group and before its first position
    g_first, g_last = per_block(group_q, n_groups, "min"), per_block(group_q, -1, "max")
    single = (g_first == g_last) & full_ok
    p_first = per_block(pos_q, big, "min")
    g = g_first.clamp(max=n_groups - 1)
    c_start, c_end = starts_k.gather(1, g), (starts_k + counts_k).gather(1, g)  # the group's key slot range
    # last key slot with position < p_first inside the group: keys of the group at positions <= p_first - 1
    full_end = torch.searchsorted(key_order, g * big + p_first - 1, right=True)  # [B, nq], exclusive slot bound
    f_lo = (c_start + block - 1) // block  # first key block wholly inside the group
    f_hi = torch.minimum(full_end, c_end) // block  # key blocks [f_lo, f_hi) wholly inside and causally complete
    n_full = torch.where(single, (f_hi - f_lo).clamp(min=0), torch.zeros_like(f_hi))
    f_lo = torch.where(n_full > 0, f_lo, hi_blk + 1)
    # partial blocks: [lo_blk, f_lo) then [f_lo + n_full, hi_blk]
    ar = torch.arange(nk, device=dev)
    first_run = (f_lo - lo_blk).clamp(min=0)
    n_partial = (n_blocks - n_full).clamp(min=0)
    r = ar[None, None, :]
    partial_idx = torch.where(
        r < first_run[..., None],
        lo_blk[..., None] + r,
        f_lo[..., None] + n_full[..., None] + (r - first_run[..., None]),
    )
    partial_idx = torch.where(r < n_partial[..., None], partial_idx, torch.zeros_like(partial_idx)).clamp(max=nk - 1)
    full_idx = torch.where(r < n_full[..., None], f_lo[..., None] + r, torch.zeros_like(partial_idx)).clamp(max=nk - 1)
    return (
        n_partial[:, None].int(),
        partial_idx[:, None].int(),
        n_full[:, None].int(),
        full_idx[:, None].int(),
    )


def band_block_mask_tensors(tq: int, tk: int, window: int, *, block: int = FLEX_BLOCK, device=None):
    """Block structure of the band call: queries at positions [tk - tq, tk) against keys within ``window`` before
    them (all partial: the cross-group condition depends on the data). Depends on the shape only."""
    start = tk - tq
    nq, nk = (tq + block - 1) // block, (tk + block - 1) // block
    qb = torch.arange(nq, device=device)
    first_pos = start + qb * block
    last_pos = torch.clamp(start + (qb + 1) * block - 1, max=tk - 1)
    lo = torch.clamp(first_pos - window + 1, min=0) // block
    hi = last_pos // block
    n = hi - lo + 1
    r = torch.arange(nk, device=device)
    idx = torch.where(r[None, :] < n[:, None], lo[:, None] + r[None, :], torch.zeros_like(r)[None, :]).clamp(max=nk - 1)
    return n[None, None].int(), idx[None, None].int()


def flex_hard_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    bits_q: Tensor,
    bits_k: Tensor,
    window: int,
    scale: float,
    n_groups: int,
    top_k: int,
    compiled: bool,
) -> Tensor:
    """Exact hard-mode attention as two FlexAttention calls (group-sorted same-group part, cross-group band), merged
    by logsumexp. Compiled on CUDA; eager (a dense math fallback that ignores block sparsity) in CPU tests."""
    from torch.nn.attention.flex_attention import AuxRequest, BlockMask

    bsz, h, tq, d = q.shape
    tk = k.shape[2]
    start = tk - tq
    gqa = k.shape[1] != h
    attend = flex_attention_fn(compiled)
    # ---- same group, lowest shared group, causal on original positions, over group-sorted slots ----
    tok_q, grp_q = _group_layout(bits_q, n_groups)
    tok_k, grp_k = _group_layout(bits_k, n_groups)
    pos_q, pos_k = tok_q + start, tok_k
    sbits_q, sbits_k = bits_q.gather(1, tok_q), bits_k.gather(1, tok_k)
    lower_q = (torch.ones_like(grp_q) << grp_q) - 1  # groups below the slot's group
    q_s = q.gather(2, tok_q[:, None, :, None].expand(bsz, h, -1, d))
    k_s = k.gather(2, tok_k[:, None, :, None].expand(bsz, k.shape[1], -1, d))
    v_s = v.gather(2, tok_k[:, None, :, None].expand(bsz, v.shape[1], -1, d))

    def same_group(b, hh, qi, kv):
        keep = (grp_q[b, qi] == grp_k[b, kv]) & (pos_k[b, kv] <= pos_q[b, qi])
        if top_k > 1:
            keep = keep & ((sbits_q[b, qi] & sbits_k[b, kv] & lower_q[b, qi]) == 0)
        return keep

    kvn, kvi, fkvn, fkvi = group_block_mask_tensors(
        grp_q, pos_q, grp_k, pos_k, n_groups=n_groups, n_positions=tk, full_ok=top_k == 1
    )
    group_mask = BlockMask.from_kv_blocks(
        kvn, kvi, fkvn, fkvi, BLOCK_SIZE=FLEX_BLOCK, mask_mod=same_group, seq_lengths=(tok_q.shape[1], tok_k.shape[1])
    )
    o_s, aux = attend(
        q_s, k_s, v_s, block_mask=group_mask, scale=scale, enable_gqa=gqa, return_aux=AuxRequest(lse=True)
    )
    lse_s = aux.lse
    # back to tokens: each query has top_k slots; merge them by logsumexp
    cdt = torch.promote_types(q.dtype, torch.float32)
    lse_s = lse_s.to(cdt)
    idx = tok_q[:, None, :].expand(bsz, h, -1)
    lse_a = torch.full((bsz, h, tq), NEG_INF, dtype=cdt, device=q.device).scatter_reduce(
        2, idx, lse_s, "amax", include_self=True
    )
    ref_a = lse_a.masked_fill(lse_a == NEG_INF, 0.0)
    w_s = torch.exp(lse_s - ref_a.gather(2, idx))
    sum_a = torch.zeros_like(lse_a).scatter_add(2, idx, w_s)
    o_a = torch.zeros(bsz, h, tq, d, dtype=cdt, device=q.device).scatter_add(
        2, idx[..., None].expand(-1, -1, -1, d), o_s.to(cdt) * w_s[..., None]
    )
    o_a = o_a / sum_a.clamp_min(torch.finfo(cdt).tiny)[..., None]
    lse_a = torch.where(sum_a > 0, torch.log(sum_a.clamp_min(torch.finfo(cdt).tiny)) + ref_a, lse_a)

    # ---- cross-group band: causal, i - j < window, no shared group, original order ----
    q_pos = torch.arange(start, tk, device=q.device)

    def band(b, hh, qi, kv):
        dist = q_pos[qi] - kv
        return (dist >= 0) & (dist < window) & ((bits_q[b, qi] & bits_k[b, kv]) == 0)

    structure = cached_block_mask(
        ("focus_band", tq, tk, window, str(q.device)),
        lambda: BlockMask.from_kv_blocks(
            *band_block_mask_tensors(tq, tk, window, device=q.device),
            BLOCK_SIZE=FLEX_BLOCK,
            seq_lengths=(tq, tk),
        ),
    )
    band_mask = copy.copy(structure)
    band_mask.mask_mod = band  # the cached structure, this layer's memberships
    o_b, aux = attend(q, k, v, block_mask=band_mask, scale=scale, enable_gqa=gqa, return_aux=AuxRequest(lse=True))
    lse_b = aux.lse
    lse_b = lse_b.to(cdt)
    lse = torch.logaddexp(lse_a, lse_b)
    out = o_a * torch.exp(lse_a - lse)[..., None] + o_b.to(cdt) * torch.exp(lse_b - lse)[..., None]
    return out.to(q.dtype)
