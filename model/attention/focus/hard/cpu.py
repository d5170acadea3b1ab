"""Focus hard mode, exact and fast (paper appendix E.4), for any top_k.

The hard mask: query i attends key j iff j <= i and (i - j < window or their group memberships intersect). Its pairs
split into disjoint parts; each part is one attention call returning (output, logsumexp), and the parts merge exactly
by logsumexp. The dense masked reference is ``naive.hard_attention``; ``group_sparse.hard_attention`` is
the batched dense decomposition kept for devices without these kernels.

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
Memory: the output, one group's gathered q/k/v (the class split: one block of at most T / 8 of a class's keys) and one
mask chunk: O(T * D + T / K * D + chunk), not O(T^2).

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

from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from model.attention.focus.hard.rows import (
    NEG_INF,
    Blocks,
    Gathered,
    Part,
    Range,
    Rows,
    Slice,
    Stacked,
    Windows,
    additive,
    narrow,
)

_FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
MASK_ELEMENTS = 1 << 20  # entries of one additive mask chunk (4 MiB in float32)
GROUP_CHUNK = 2048  # a group with more members runs as query chunks of this size (peak memory)
STACK_SLACK = 1.25  # top_k = 1: one call for all groups while padding them to the largest adds <= 25% rows
STACK_ROWS = 4096  # ... and while the stacked rows are few (it gathers q, k, v whole: memory grows with them)
BAND_ELEMENTS = 1 << 19  # mask entries per band chunk (2 MiB in float32: keeps the peak memory near the output's)
CLASS_LEVELS = (1024, 128)  # query chunk sizes of the class split's staircase (see HardPlan._class_parts)
CLASS_LIMIT = 4  # class split while the distinct memberships per sequence are at most CLASS_LIMIT * K


def cpu_kernel_dtypes() -> tuple[torch.dtype, ...]:
    return (torch.float32, torch.float64, torch.bfloat16, torch.float16)


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
        self.bits_q, self.bits_k = narrow(bits_q, n_groups), narrow(bits_k, n_groups)

    def parts(self, dtype: torch.dtype) -> Iterator[Part]:
        for b in range(self.bits_q.shape[0]):
            if self.split == "class" and (self.top_k > 1 or self.start > 0):
                yield from self._class_parts(b, dtype)
            else:
                yield from self._group_parts(b, dtype)
        for b in range(self.bits_q.shape[0]):
            yield from self._band_parts(b, dtype)

    def _class_parts(self, b: int, dtype: torch.dtype) -> Iterator[Part]:
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
            yield from self._staircase(b, iq, ik, q_pos, starts, ends, 0, iq.numel(), 0, 0, dtype)

    def _staircase(
        self,
        b: int,
        iq: Tensor,
        ik: Tensor,
        q_pos: Tensor,
        starts: list[int],
        ends: list[int],
        lo: int,
        hi: int,
        k_lo: int,
        level: int,
        dtype: torch.dtype,
    ) -> Iterator[Part]:
        """Queries [lo, hi) of a class over its keys from ``k_lo`` on (the keys before ``k_lo`` are done).

        Chunks of CLASS_LEVELS[level] queries. Each chunk reads the keys before its first query unmasked; a chunk of
        the last level (or no bigger than the next level's) also reads its own staircase, causal-masked; a bigger
        chunk's staircase is split the same way at the next level. Big chunks keep the kernel efficient; small
        last-level chunks keep the masked strips short. The reads go key block by key block: each block of at most
        ``key_block`` keys is gathered once for every chunk that reads it, so the gathered keys stay a fraction of
        the output however many keys the class has (a read that spans two blocks is two parts)."""
        size = CLASS_LEVELS[level]
        chunks = [(a, min(a + size, hi)) for a in range(lo, hi, size)]
        pre = [max(k_lo, starts[a]) for a, _ in chunks]  # keys before each chunk's first query
        deeper = [level + 1 < len(CLASS_LEVELS) and e - a > CLASS_LEVELS[level + 1] for a, e in chunks]
        stop = [n_pre if down else ends[e - 1] for (_, e), n_pre, down in zip(chunks, pre, deeper)]
        block, top = key_block(self.tk), max(stop)
        for k0 in range(k_lo, top, block):
            k1 = min(k0 + block, top)
            keys = Gathered(b, ik[k0:k1])
            for (a, e), n_pre, n_end in zip(chunks, pre, stop):
                if n_pre > k0:  # keys before the chunk's first query: all allowed
                    yield Part(Rows(b, iq[a:e]), keys.part(0, min(k1, n_pre) - k0), causal=False)
                s0, s1 = max(k0, n_pre), min(k1, n_end)
                if s1 > s0:  # this block's share of the chunk's staircase
                    allowed = ik[None, s0:s1] <= q_pos[a:e, None]
                    yield Part(
                        Rows(b, iq[a:e]),
                        keys.part(s0 - k0, s1 - k0),
                        causal=False,
                        mask=additive(allowed, dtype)[None, None],
                        nonempty=allowed.any(-1)[None, None],
                    )
        for (a, e), n_pre, down in zip(chunks, pre, deeper):
            if down:
                yield from self._staircase(b, iq, ik, q_pos, starts, ends, a, e, n_pre, level + 1, dtype)

    def _group_parts(self, b: int, dtype: torch.dtype) -> Iterator[Part]:
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
                keys = Gathered(b, ik)
                for a in range(0, ik.numel(), GROUP_CHUNK):
                    e = min(a + GROUP_CHUNK, ik.numel())
                    rows = Rows(b, ik[a:e])
                    yield Part(rows, keys.part(a, e), causal=True, exclusive=exclusive)  # the diagonal block
                    if a > 0:
                        yield Part(rows, keys.part(0, a), causal=False)  # every earlier member: unmasked
                continue
            if aligned and not dedup:
                yield Part(Rows(b, iq), Rows(b, ik), causal=True, exclusive=exclusive)
                continue
            q_pos = iq + self.start
            chunk = max(16, MASK_ELEMENTS // ik.numel())
            for a in range(0, iq.numel(), chunk):
                e = min(a + chunk, iq.numel())
                n_keys = e if aligned else int(torch.searchsorted(ik, q_pos[e - 1], right=True))
                if n_keys == 0:
                    continue
                key_idx = ik[:n_keys]
                allowed = key_idx[None, :] <= q_pos[a:e, None]
                if dedup:
                    allowed &= (lq[a:e, None] & lk[None, :n_keys]) == 0
                yield Part(
                    Rows(b, iq[a:e]),
                    Rows(b, key_idx),
                    causal=False,
                    mask=additive(allowed, dtype)[None, None],
                    nonempty=allowed.any(-1)[None, None],
                    exclusive=exclusive,
                )

    def _stacked_groups(self, b: int) -> Part | None:
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
        sel = Stacked(b, idx, real)
        return Part(sel, sel, causal=True, exclusive=True, pad=~real[:, None, :])

    def _band_parts(self, b: int, dtype: torch.dtype) -> Iterator[Part]:
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
                yield Part(
                    Blocks(b, j * bs, n, bs),
                    Windows(b, k0, n, bs, bs + w),
                    causal=False,
                    mask=additive(allowed, dtype)[:, None],
                    nonempty=allowed.any(-1)[:, None],
                )
        if max(n_full, first) * bs < tq:
            ranges.append((max(n_full, first) * bs, tq))
        for lo, hi in ranges:
            k_lo, k_hi = max(0, p0 + lo - w + 1), p0 + hi
            q_pos = torch.arange(p0 + lo, p0 + hi, device=bq.device)
            dist = q_pos[:, None] - torch.arange(k_lo, k_hi, device=bq.device)[None, :]
            allowed = (dist >= 0) & (dist < w) & ((bq[lo:hi, None] & bk[None, k_lo:k_hi]) == 0)
            yield Part(
                Range(b, lo, hi),
                Range(b, k_lo, k_hi),
                causal=False,
                mask=additive(allowed, dtype)[None, None],
                nonempty=allowed.any(-1)[None, None],
            )


# the class split gathers at most T / KEY_BLOCK_SHARE keys at once (with their values, a quarter of the output's size;
# top_k = 2 of 4 groups at T = 16K: peak 1.5x full attention's, against 2.8x gathering each class's keys whole, and
# 1.9x at a share of 4, at the same speed), and never fewer than KEY_BLOCK_MIN (short sequences: one block)
KEY_BLOCK_SHARE = 8
KEY_BLOCK_MIN = 1024


def key_block(tk: int) -> int:
    """Keys of one class the class split gathers at once (see ``HardPlan._staircase``)."""
    return max(KEY_BLOCK_MIN, tk // KEY_BLOCK_SHARE)


BAND_BLOCK = 64


def band_block(window: int) -> int:
    """Query block of the band: the largest divisor of ``window`` up to BAND_BLOCK (keys read per query block:
    window + block, so a smaller block wastes less; too small a block starves the kernel)."""
    return max(d for d in range(1, min(window, BAND_BLOCK) + 1) if window % d == 0)


# ---- forward, backward, merge ------------------------------------------------------------------------------------
def _merge(sel: Any, out: Tensor, lse: Tensor, o: Tensor, lse_part: Tensor) -> None:
    """Fold one part's (output, logsumexp) into the running ones, in place where the selector is a view."""
    cur = sel.take(lse)
    new = torch.logaddexp(cur, lse_part)
    ref = new.masked_fill(new == NEG_INF, 0.0)  # rows with nothing yet stay at zero
    acc = sel.take(out)
    acc.mul_(torch.exp(cur - ref)[..., None]).addcmul_(o, torch.exp(lse_part - ref)[..., None])
    if isinstance(sel, Rows):  # a gathered copy: write back
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


def _backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, plan: HardPlan, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    cdt = out.dtype
    dq = torch.zeros(q.shape, dtype=cdt, device=q.device)
    dk = torch.zeros(k.shape, dtype=cdt, device=k.device)
    dv = torch.zeros(v.shape, dtype=cdt, device=v.device)
    dout, out_q = dout.to(q.dtype), out.to(q.dtype)
    lse = lse.to(torch.promote_types(q.dtype, torch.float32))
    shared = None  # the gathered key set the last parts read: scatter its gradients when the parts move on
    for part in plan.parts(q.dtype):
        base = part.k.base if isinstance(part.k, Slice) else None
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
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, plan: HardPlan, scale: float) -> Tensor:
        out, lse = _forward(q, k, v, plan, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.scale = plan, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        return (*_backward(dout, q, k, v, out, lse, ctx.plan, ctx.scale), None, None)


def cpu_hard_attention(
    q: Tensor, k: Tensor, v: Tensor, *, bits_q: Tensor, bits_k: Tensor, window: int, scale: float, n_groups: int,
    top_k: int, split: str = "auto",
) -> Tensor:  # fmt: skip
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
