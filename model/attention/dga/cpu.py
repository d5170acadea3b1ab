"""Dynamic Group Attention's memory-linear training form on the fused CPU kernel (docs/dga.md, "Paths").

A query's keys are disjoint parts, each a contiguous range of one of two key lists built once per layer: the raw
keys ``k`` (positions in order) and the compressed entries ``ck`` (focal keys and group aggregates, ordered so that
what a query may see is a prefix). Each part is one call of ``aten._scaled_dot_product_flash_attention_for_cpu``
returning (output, logsumexp); the parts of a row merge exactly by logsumexp. The backward calls the kernel's
backward per part with the merged output O and logsumexp L of the whole row (then P_ij = exp(s_ij - L_i) and
D_i = dO_i . O_i are the full row's), so the parts' gradients add up exactly; they flow on to q, k, v and to the
compressed entries (whose aggregation weights carry them to q and k through autograd).

Causal form (``CausalPlan``): query chunk j reads its own chunk (the kernel's causal mask), the previous chunk
(unmasked) and the first ``E (j - 1)`` compressed entries (chunks <= j - 2, unmasked). The first two are one call
each for all whole chunks, as strided views ``[B * H, n, C, D]`` of q, k and v (no copies). The queries may start
at a chunk boundary inside the keys (context parallelism: a rank's chunk against the gathered keys and entries).
Sequence form (``SequencePlan``): entries sorted by the position from which they are visible, so a query block reads
a prefix unmasked, the few entries that become visible inside the block with a mask, and the raw members of the
groups still open in the block with a mask (both masks O(block x (block + group span))).
Memory: the output, its logsumexp, the gradients, one block's masks: O(T D), never O(T^2).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

_FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
NEG_INF = float("-inf")
KERNEL_DTYPES = (torch.float32, torch.float64)  # the merge runs in the kernel's output dtype
SEQUENCE_BLOCK = 256  # query rows per part of the sequence form
COMPRESSED_ROWS = 1024  # query rows per compressed part of the causal form


@dataclass(frozen=True)
class Span:
    """Rows [lo, hi) of dim 2 of a [B, H, T, *] tensor; with ``block`` > 0 as a strided view [B * H, n, block, *]
    (n = (hi - lo) / block): whole chunks batched as heads of one kernel call."""

    lo: int
    hi: int
    block: int = 0

    def take(self, x: Tensor) -> Tensor:
        s = x[:, :, self.lo : self.hi]
        if not self.block:
            return s
        return s.view(x.shape[0] * x.shape[1], (self.hi - self.lo) // self.block, self.block, *x.shape[3:])


@dataclass(frozen=True)
class Part:
    q: Span  # query rows
    k: Span  # key rows of the raw keys (compressed=False) or of the compressed entries
    compressed: bool = False
    causal: bool = False  # the kernel's own (top-left) causal mask: only for aligned square parts
    mask: Tensor | None = None  # additive, broadcastable to the call's [B, H, rows, keys]
    nonempty: Tensor | None = None  # rows with a visible key (with ``mask``); the kernel gives an empty row lse 0
    first: bool = False  # the first part of its rows: written, not merged


class Plan:
    """The parts of one call; ``parts`` is a generator, run in the forward and again in the backward (masks are
    built per part and dropped, so they never add up)."""

    def parts(self, device: torch.device | None = None) -> Iterator[Part]:
        raise NotImplementedError


class CausalPlan(Plan):
    """Causal form: T queries from position ``q0`` (a multiple of C: 0 for a whole sequence, a context-parallel
    chunk's start otherwise) against the raw keys from position 0 and E compressed entries per chunk (chunk u's
    visible from chunk u + 2 on, stored chunk after chunk). Query rows are local (position - q0); raw key rows and
    entries are global.

    The compressed parts go by groups of G = COMPRESSED_ROWS / C query chunks (few kernel calls: on a loaded machine
    every parallel call waits on the slowest thread): the entries every chunk of the group sees (chunks <= j0 - 2)
    unmasked, then the staircase of the G - 1 chunks after them with one mask shared by all groups. The raw parts
    (own chunk causal, previous chunk whole) are one call each for all whole chunks."""

    def __init__(self, t: int, chunk: int, per_chunk: int, dtype: torch.dtype, q0: int = 0):
        if q0 % chunk:
            raise ValueError(f"causal parts: the first query position {q0} is not a multiple of the chunk {chunk}")
        self.t, self.c, self.e, self.dtype, self.q0 = t, chunk, per_chunk, dtype, q0
        self.group = max(1, COMPRESSED_ROWS // chunk)
        self._masks: dict[tuple[int, int], tuple[Tensor, Tensor]] = {}

    def _staircase(self, rows: int, entries: int, device: torch.device) -> tuple[Tensor, Tensor]:
        key = (rows, entries)
        if key not in self._masks:
            u = torch.arange(entries, device=device) // self.e  # entry chunk, from the group's first chunk - 1
            j = torch.arange(rows, device=device) // self.c  # query chunk, from the group's first chunk
            allowed = u[None, :] <= j[:, None] - 1
            self._masks[key] = (additive(allowed, self.dtype), allowed.any(-1))
        return self._masks[key]

    def parts(self, device: torch.device | None = None) -> Iterator[Part]:
        t, c, e, q0 = self.t, self.c, self.e, self.q0
        nf, n_chunks = t // c, -(-t // c)  # local query chunks
        tf = nf * c
        j_first = q0 // c  # global index of the first query chunk
        if nf >= 1:  # own chunk, causal, every whole chunk in one call (first: its output becomes the buffer)
            yield Part(Span(0, tf, c), Span(q0, q0 + tf, c), causal=True, first=True)
        if tf < t:  # a partial last chunk
            yield Part(Span(tf, t), Span(q0 + tf, q0 + t), causal=True, first=True)
            if q0 + tf >= c:
                yield Part(Span(tf, t), Span(q0 + tf - c, q0 + tf))
        a = 1 if j_first == 0 else 0  # the first local chunk with a previous chunk
        if nf > a:  # the previous chunk, whole
            yield Part(Span(a * c, tf, c), Span(q0 + (a - 1) * c, q0 + tf - c, c))
        for j0 in range(max(2, j_first), j_first + n_chunks, self.group):  # compressed chunks <= j - 2 for chunk j
            j1 = min(j0 + self.group, j_first + n_chunks)
            rows = Span(j0 * c - q0, min(j1 * c - q0, t))
            yield Part(rows, Span(0, e * (j0 - 1)), compressed=True)
            if j1 - j0 > 1:
                mask, nonempty = self._staircase(rows.hi - rows.lo, e * (j1 - j0 - 1), device or torch.device("cpu"))
                yield Part(rows, Span(e * (j0 - 1), e * (j1 - 2)), compressed=True, mask=mask, nonempty=nonempty)


def additive(allowed: Tensor, dtype: torch.dtype) -> Tensor:
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, NEG_INF)


class SequencePlan(Plan):
    """Sequence form, queries at positions 0..T-1. ``avail`` [B, H, N]: the position from which each (sorted)
    entry is visible, ascending; ``focal`` [B, H, T] flags; ``group_last`` [B, H, T] the last member of each
    non-focal token's group; ``first_member`` [B, H, G] and ``last_member`` [B, H, G] of each group (ascending)."""

    def __init__(
        self,
        avail: Tensor,
        focal: Tensor,
        group_last: Tensor,
        first_member: Tensor,
        last_member: Tensor,
        dtype: torch.dtype,
        block: int | None = None,
    ):
        t = focal.shape[-1]
        block = block or SEQUENCE_BLOCK
        dev = avail.device
        self.t, self.block, self.dtype = t, block, dtype
        self.avail, self.focal, self.group_last = avail, focal, group_last
        starts = torch.arange(0, t, block, device=dev)
        ends = torch.clamp(starts + block, max=t)
        b, h = focal.shape[:2]
        # entries visible to every query of a block, and to its last query
        n_lo = torch.searchsorted(avail, starts.expand(b, h, -1).contiguous(), right=True).amin((0, 1))
        n_hi = torch.searchsorted(avail, (ends - 1).expand(b, h, -1).contiguous(), right=True).amax((0, 1))
        # the lowest raw key a block reads: the first member of the first group not finished at its first query
        g = last_member.shape[-1]
        if g:
            z = torch.searchsorted(last_member.contiguous(), starts.expand(b, h, -1).contiguous(), right=True)
            first = first_member.gather(-1, z.clamp(max=g - 1))
            r_lo = torch.where(z < g, first, ends.expand(b, h, -1)).amin((0, 1))
        else:
            r_lo = ends
        r_lo = torch.minimum(r_lo, ends)
        self.bounds = torch.stack([starts, ends, n_lo, n_hi, r_lo], 1).tolist()  # one host sync per layer

    def parts(self, device: torch.device | None = None) -> Iterator[Part]:
        dev = self.avail.device
        for a, e, n_lo, n_hi, r_lo in self.bounds:
            rows = Span(a, e)
            q_pos = torch.arange(a, e, device=dev)
            if n_lo > 0:
                yield Part(rows, Span(0, n_lo), compressed=True, first=True)
            if n_hi > n_lo:
                allowed = self.avail[:, :, None, n_lo:n_hi] <= q_pos[:, None]
                yield Part(
                    rows,
                    Span(n_lo, n_hi),
                    compressed=True,
                    mask=additive(allowed, self.dtype),
                    nonempty=allowed.any(-1),
                )
            if e > r_lo:
                t_pos = torch.arange(r_lo, e, device=dev)
                allowed = (
                    (t_pos[None, :] <= q_pos[:, None])
                    & ~self.focal[:, :, None, r_lo:e]
                    & (self.group_last[:, :, None, r_lo:e] > q_pos[:, None])
                )
                yield Part(rows, Span(r_lo, e), mask=additive(allowed, self.dtype), nonempty=allowed.any(-1))


# ---- forward, backward, merge ------------------------------------------------------------------------------------
def _under_sac() -> bool:
    """Whether a torch dispatch mode (selective activation checkpointing's caching mode) is active."""
    return bool(torch.utils._python_dispatch._get_current_dispatch_mode_stack())


def _merge(out: Tensor, lse: Tensor, o: Tensor, lse_part: Tensor) -> None:
    """Fold one part's (output, logsumexp) into the running ones (views: in place)."""
    new = torch.logaddexp(lse, lse_part)
    ref = new.masked_fill(new == NEG_INF, 0.0)  # rows with nothing yet stay at zero
    out.mul_(torch.exp(lse - ref)[..., None]).addcmul_(o, torch.exp(lse_part - ref)[..., None])
    lse.copy_(new)


def _forward(
    q: Tensor, k: Tensor, v: Tensor, ck: Tensor, cv: Tensor, plan: Plan, scale: float
) -> tuple[Tensor, Tensor]:
    b, h, t, d = q.shape
    out: Tensor | None = None
    lse = torch.full((b, h, t), NEG_INF, dtype=q.dtype, device=q.device)
    for p in plan.parts(q.device):
        ks, vs = (ck, cv) if p.compressed else (k, v)
        o, lse_p = _FWD(p.q.take(q), p.k.take(ks), p.k.take(vs), 0.0, p.causal, attn_mask=p.mask, scale=scale)
        if p.nonempty is not None:
            lse_p = lse_p.masked_fill(~p.nonempty, NEG_INF)
        if out is None:
            # every row: no second T x D buffer. Not under selective activation checkpointing, which may keep the
            # kernel's output for the recompute: the merges below would mutate what it kept
            if p.first and p.q.lo == 0 and p.q.hi == t and o.is_contiguous() and not _under_sac():
                out = o.view(b, h, t, d)
                p.q.take(lse).copy_(lse_p)
                continue
            out = torch.zeros_like(q)
        if p.first:
            p.q.take(out).copy_(o)
            p.q.take(lse).copy_(lse_p)
        else:
            _merge(p.q.take(out), p.q.take(lse), o, lse_p)
    return (torch.zeros_like(q) if out is None else out), lse


def _backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    ck: Tensor,
    cv: Tensor,
    out: Tensor,
    lse: Tensor,
    plan: Plan,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    dq, dk, dv, dck, dcv = (torch.zeros_like(x) for x in (q, k, v, ck, cv))
    dout = dout.contiguous()
    for p in plan.parts(q.device):
        ks, vs, gk_to, gv_to = (ck, cv, dck, dcv) if p.compressed else (k, v, dk, dv)
        gq, gk, gv = _BWD(
            p.q.take(dout),
            p.q.take(q),
            p.k.take(ks),
            p.k.take(vs),
            p.q.take(out),
            p.q.take(lse),
            0.0,
            p.causal,
            attn_mask=p.mask,
            scale=scale,
        )
        p.q.take(dq).add_(gq)
        p.k.take(gk_to).add_(gk)
        p.k.take(gv_to).add_(gv)
    return dq, dk, dv, dck, dcv


class _PartsAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, ck: Tensor, cv: Tensor, plan: Plan, scale: float) -> Tensor:
        out, lse = _forward(q, k, v, ck, cv, plan, scale)
        ctx.save_for_backward(q, k, v, ck, cv, out, lse)
        ctx.plan, ctx.scale = plan, scale
        return out

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, ck, cv, out, lse = ctx.saved_tensors
        return (*_backward(dout, q, k, v, ck, cv, out, lse, ctx.plan, ctx.scale), None, None)


@torch.compiler.disable  # eager CPU kernels and a custom autograd.Function: dynamo cannot trace its saved
# intermediates ("created inside a higher-order op"), and compiling brings nothing here
def parts_attention(q: Tensor, k: Tensor, v: Tensor, ck: Tensor, cv: Tensor, plan: Plan, scale: float) -> Tensor:
    """Exact attention of q [B, H, T, D] over the parts of ``plan`` (ranges of k, v [B, H, T, D] and of the
    compressed entries ck, cv [B, H, N, D]), with gradients for all five. float32 / float64 on the CPU."""
    q, k, v, ck, cv = (x.contiguous() for x in (q, k, v, ck, cv))
    if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v, ck, cv)):
        return _PartsAttention.apply(q, k, v, ck, cv, plan, scale)
    return _forward(q, k, v, ck, cv, plan, scale)[0]
