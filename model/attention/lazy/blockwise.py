"""Lazy attention on CPU, exact, in memory linear in T: Elastic-Softmax in two passes over block diagonals.

Queries at positions ``P .. P + Tq - 1`` (``P = Tk - Tq``: training has P = 0, chunked prefill onto a KV cache P > 0)
attend keys ``0 .. Tk - 1``. Both are cut into blocks of ``block`` rows (the last padded): query block I starts at
``P + I * block``, key block J at ``J * block``. Every pair of blocks on one diagonal ``e = I - J`` has the same
distances ``i - j = P + e * block + a - b``, so the same distance-bias block (the bias is Toeplitz) and the same causal
pattern: a diagonal is one batched matmul over its block pairs (chunked to ``CHUNK_ELEMENTS`` scores), with one
``[H, block, block]`` bias block broadcast over them. Diagonals wholly in the future are skipped.

- Forward, pass 1: each row's logsumexp ``lse`` of ``s = q.k * scale - b[clamp(i - j)]``, merged across diagonals.
- Pass 2: ``w = relu(exp(s - lse) - c)`` with ``c_i = tau_h / n_i`` (``n_i = i + 1``), future pairs zeroed (a
  negative tau would lift them), ``o += w @ v``; with grad, also ``a_i = sum_j 1[w_ij > 0] v_j``.
- Backward recomputes each block (nothing T x T is stored). With m = 1[w > 0]:
  ``dp = m * (do . v)``, ``ds = p * (dp - D)`` with ``D_i = sum_k p_ik dp_ik = do_i . (o_i + c_i a_i)``,
  ``dq = scale * ds @ k``, ``dk = scale * ds^T @ q``, ``dv = w^T @ do``, the bias table gets ``-ds`` summed per
  (clamped) distance, and ``dc_i = -do_i . a_i`` gives ``dtau_h = sum_i dc_i / n_i``.
- The first query (position 0) sees one key: its p is set to exactly 1 (lse's rounding could put it on either side of
  tau / 1 = 1, the paper's init, where the reference's weight and gradient are exactly zero).

Memory: q, k, v, o, a, their gradients in block layout (O(T * D)), row statistics (O(T)) and one chunk of scores
(``CHUNK_ELEMENTS``): never O(T^2). Arithmetic runs in float32 at least (float64 stays float64; bf16 inputs, e.g.
under CPU autocast, are computed in float32 and cast back).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

BLOCK = 256  # rows of a query / key block
MIN_ROWS = 8  # fewer queries (decode, short prefill chunks) take the dense reference: O(Tq * Tk) is small there
CHUNK_ELEMENTS = 1 << 20  # scores per batched matmul (4 MiB in float32): the working set of one step


def kernel_dtypes() -> tuple[torch.dtype, ...]:
    return (torch.float32, torch.float64, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Diagonal:
    """Block pairs (I, I - e) for I in [i0, i1) of one diagonal e, and what their shared bias block needs."""

    e: int
    i0: int
    i1: int
    partial: bool  # some pairs are in the future (causal mask inside the blocks)


class Layout:
    """Block geometry of one call: ``nq`` query blocks from position ``start``, ``nk`` key blocks from 0."""

    def __init__(self, tq: int, tk: int, block: int, heads: int, batch: int, last: int):
        self.tq, self.tk, self.block, self.heads, self.batch, self.last = tq, tk, block, heads, batch, last
        self.start = tk - tq
        self.nq, self.nk = -(-tq // block), -(-tk // block)
        self.rows = batch * heads  # batched rows of one block pair

    def diagonals(self) -> Iterator[Diagonal]:
        b, p = self.block, self.start
        for e in range(-(self.nk - 1), self.nq):
            if p + e * b + b - 1 < 0:  # every pair is in the future
                continue
            i0, i1 = max(0, e), min(self.nq, self.nk + e)
            if i0 < i1:
                yield Diagonal(e, i0, i1, partial=p + e * b - (b - 1) < 0)

    def chunks(self, diag: Diagonal) -> Iterator[tuple[int, int]]:
        step = max(1, CHUNK_ELEMENTS // (self.rows * self.block * self.block))
        for i in range(diag.i0, diag.i1, step):
            yield i, min(diag.i1, i + step)

    def distances(self, e: int, device: torch.device) -> Tensor:
        """[block, block] distances i - j of the pairs on diagonal e."""
        r = torch.arange(self.block, device=device)
        return self.start + e * self.block + r[:, None] - r[None, :]

    def neg_bias(self, table: Tensor, e: int, dtype: torch.dtype) -> Tensor:
        """[H, block, block] ``-b[h, clamp(i - j)]`` on diagonal e, -inf on future pairs."""
        # Toeplitz: entry (a, c) is u[c - a + block - 1] for one row u over the 2 * block - 1 distances (and a
        # spare slot); u laid out block times, read with a row length one shorter, shifts each row one place
        # (a gather over block^2 entries costs far more)
        b = self.block
        dist = self.start + e * b + (b - 1) - torch.arange(2 * b, device=table.device)
        u = -table.to(dtype)[:, dist.clamp(0, self.last)]
        u.masked_fill_((dist < 0)[None], float("-inf"))
        return u.repeat(1, b)[:, : b * (2 * b - 1)].view(-1, b, 2 * b - 1)[:, :, b - 1 :]


def to_blocks(x: Tensor, layout: Layout, n: int) -> Tensor:
    """[B, H, T, D] -> [n, B * H, block, D] (zero-padded to n blocks), contiguous."""
    b, h, t, d = x.shape
    pad = n * layout.block - t
    if pad:
        x = torch.nn.functional.pad(x, (0, 0, 0, pad))
    return x.reshape(b, h, n, layout.block, d).permute(2, 0, 1, 3, 4).reshape(n, b * h, layout.block, d).contiguous()


def from_blocks(x: Tensor, layout: Layout, t: int) -> Tensor:
    n, bh, blk, d = x.shape
    return (
        x.reshape(n, layout.batch, layout.heads, blk, d)
        .permute(1, 2, 0, 3, 4)
        .reshape(layout.batch, layout.heads, n * blk, d)[:, :, :t]
    )


def rows_to_blocks(x: Tensor, layout: Layout) -> Tensor:
    """[B, H, Tq] row statistic -> [nq, B * H, block] (padding rows get 0)."""
    return to_blocks(x[..., None], layout, layout.nq)[..., 0]


class _Scores:
    """Recomputes ``p = exp(s - lse)`` for one chunk of a diagonal (pass 2 and the backward)."""

    def __init__(self, layout: Layout, qb: Tensor, kb: Tensor, lse: Tensor, table: Tensor):
        self.layout, self.qb, self.kb, self.lse, self.table = layout, qb, kb, lse, table
        self.bias: dict[int, Tensor] = {}

    def neg_bias(self, e: int) -> Tensor:
        if e not in self.bias:
            self.bias = {e: self.layout.neg_bias(self.table, e, self.qb.dtype)}  # one diagonal at a time
        return self.bias[e]

    def scores(self, diag: Diagonal, i0: int, i1: int, shift: bool = False) -> Tensor:
        """[n * B * H, block, block] biased scores s of query blocks i0..i1-1 on diagonal e (``s - lse`` with
        ``shift``: the row's logsumexp goes in with the bias, before the matmul accumulates onto it)."""
        lay, n = self.layout, i1 - i0
        j0 = i0 - diag.e
        s = torch.empty(n * lay.rows, lay.block, lay.block, dtype=self.qb.dtype, device=self.qb.device)
        s4 = s.view(n * lay.batch, lay.heads, lay.block, lay.block)
        if shift:
            torch.sub(self.neg_bias(diag.e), self.lse[i0:i1].view(n * lay.batch, lay.heads, lay.block, 1), out=s4)
        else:
            s4.copy_(self.neg_bias(diag.e))
        q = self.qb[i0:i1].view(n * lay.rows, lay.block, -1)
        k = self.kb[j0 : j0 + n].view(n * lay.rows, lay.block, -1)
        return s.baddbmm_(q, k.transpose(1, 2))

    def probs(self, diag: Diagonal, i0: int, i1: int) -> Tensor:
        lay = self.layout
        p = self.scores(diag, i0, i1, shift=True).exp_()
        if lay.start == 0 and diag.e == 0 and i0 == 0:
            p[: lay.rows, 0, 0] = 1.0  # the first query's only key: p = 1 exactly
        return p


def _thresholds(layout: Layout, tau: Tensor, dtype: torch.dtype, device: torch.device) -> Tensor:
    """[nq, B * H, block] c_i = tau_h / (i + 1) for every query row (padding rows included)."""
    pos = torch.arange(layout.start, layout.start + layout.nq * layout.block, device=device, dtype=dtype)
    c = tau.to(dtype)[:, None] / (pos + 1)[None, :]  # [H, nq * block]
    c = c.view(layout.heads, layout.nq, layout.block).permute(1, 0, 2)
    return (
        c[:, None]
        .expand(layout.nq, layout.batch, layout.heads, layout.block)
        .reshape(layout.nq, layout.rows, -1)
        .contiguous()
    )


def _weights(p: Tensor, c: Tensor, diag: Diagonal, layout: Layout, n: int, out: Tensor | None = None) -> Tensor:
    """w = relu(p - c) on a chunk, zero on future pairs."""
    w = torch.sub(p, c.view(-1, layout.block, 1), out=out).clamp_min_(0.0)
    if diag.partial:
        future = layout.distances(diag.e, p.device) < 0
        w.masked_fill_(future, 0.0)
    return w


def logsumexp_rows(scores: _Scores, layout: Layout) -> Tensor:
    """Pass 1: [nq, B * H, block] logsumexp of each row's biased scores over its visible keys."""
    qb = scores.qb
    lse = torch.full((layout.nq, layout.rows, layout.block), float("-inf"), dtype=qb.dtype, device=qb.device)
    for diag in layout.diagonals():
        for i0, i1 in layout.chunks(diag):
            row = lse[i0:i1].view(-1, layout.block)
            s = scores.scores(diag, i0, i1)
            top = s.amax(-1, keepdim=True).clamp_min_(torch.finfo(s.dtype).min)  # a row may see no key here
            blk = s.sub_(top).exp_().sum(-1).log_().add_(top[..., 0])
            torch.logaddexp(row, blk, out=row)
    return lse


class ElasticBlockwise(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        table: Tensor,
        tau: Tensor,
        scale: float,
        block: int,
        need_grad: bool,
        stats: dict[str, Tensor] | None,
    ) -> Tensor:
        dtype = torch.promote_types(q.dtype, torch.float32)
        b, h, tq, d = q.shape
        tk, rep = k.shape[2], h // k.shape[1]
        lay = Layout(tq, tk, block, h, b, table.shape[1] - 1)
        with torch.autocast(q.device.type, enabled=False):
            qb = to_blocks(q.to(dtype) * scale, lay, lay.nq)
            kb, vb = (to_blocks(x.to(dtype).repeat_interleave(rep, 1), lay, lay.nk) for x in (k, v))
            sc = _Scores(lay, qb, kb, torch.empty(0), table.detach())
            sc.lse = logsumexp_rows(sc, lay)
            c = _thresholds(lay, tau.detach(), dtype, q.device)
            ob = torch.zeros_like(qb)
            ab = torch.zeros_like(qb) if need_grad else None
            rowsum = torch.zeros_like(sc.lse) if stats is not None else None
            sink = torch.zeros_like(sc.lse) if stats is not None else None
            for diag in lay.diagonals():
                for i0, i1 in lay.chunks(diag):
                    n, j0 = i1 - i0, i0 - diag.e
                    p = sc.probs(diag, i0, i1)
                    w = _weights(p, c[i0:i1], diag, lay, n, out=p)
                    vj = vb[j0 : j0 + n].view(n * lay.rows, block, d)
                    ob[i0:i1].view(n * lay.rows, block, d).baddbmm_(w, vj)
                    if ab is not None:
                        ab[i0:i1].view(n * lay.rows, block, d).baddbmm_(torch.sign(w), vj)
                    if rowsum is not None and sink is not None:
                        rowsum[i0:i1] += w.view(n, lay.rows, block, block).sum(-1)
                        if j0 == 0:
                            sink[i0] += w[: lay.rows, :, 0]
            out = from_blocks(ob, lay, tq)
            if stats is not None and rowsum is not None and sink is not None:
                rs = from_blocks(rowsum[..., None], lay, tq)[..., 0]
                sk = from_blocks(sink[..., None], lay, tq)[..., 0]
                stats["sink_ratio"] = sk.mean()
                stats["density"] = (rs - sk).mean()
        if need_grad:
            ctx.save_for_backward(q, k, v, table, tau, qb, kb, vb, ob, ab, sc.lse, c)
            ctx.layout, ctx.scale = lay, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, table, tau, qb, kb, vb, ob, ab, lse, c = ctx.saved_tensors
        lay: Layout = ctx.layout
        block, d, dtype = lay.block, qb.shape[-1], qb.dtype
        with torch.autocast(q.device.type, enabled=False):
            dob = to_blocks(grad.to(dtype), lay, lay.nq)
            # D_i = do_i . (o_i + c_i a_i) and dc_i = -do_i . a_i, per row
            da = (dob * ab).sum(-1)
            big_d = (dob * ob).sum(-1) + c * da
            sc = _Scores(lay, qb, kb, lse, table.detach())
            dqb, dkb, dvb = torch.zeros_like(qb), torch.zeros_like(kb), torch.zeros_like(vb)
            dtable = torch.zeros(table.shape, dtype=dtype, device=table.device)
            for diag in lay.diagonals():
                acc = torch.zeros(lay.heads, block, block, dtype=dtype, device=q.device)
                for i0, i1 in lay.chunks(diag):
                    n, j0 = i1 - i0, i0 - diag.e
                    rows = n * lay.rows
                    p = sc.probs(diag, i0, i1)
                    w = _weights(p, c[i0:i1], diag, lay, n)
                    dov = dob[i0:i1].view(rows, block, d)
                    vj = vb[j0 : j0 + n].view(rows, block, d)
                    dvb[j0 : j0 + n].view(rows, block, d).baddbmm_(w.transpose(1, 2), dov)
                    ds = torch.bmm(dov, vj.transpose(1, 2)).masked_fill_(w <= 0, 0.0)
                    ds.sub_(big_d[i0:i1].view(rows, block, 1)).mul_(p)
                    dqb[i0:i1].view(rows, block, d).baddbmm_(ds, kb[j0 : j0 + n].view(rows, block, d))
                    dkb[j0 : j0 + n].view(rows, block, d).baddbmm_(ds.transpose(1, 2), qb[i0:i1].view(rows, block, d))
                    acc += ds.view(n * lay.batch, lay.heads, block, block).sum(0)
                dist = lay.distances(diag.e, q.device)
                visible = dist >= 0
                dtable.index_add_(1, dist.clamp(0, lay.last)[visible], -acc[:, visible])
            pos = torch.arange(lay.start, lay.start + lay.nq * block, device=q.device, dtype=dtype)
            inv_n = (1.0 / (pos + 1)).view(lay.nq, 1, block)
            dtau = -(da * inv_n).view(lay.nq, lay.batch, lay.heads, block).sum((0, 1, 3))
            dq = from_blocks(dqb, lay, lay.tq) * ctx.scale
            dk = from_blocks(dkb, lay, lay.tk)
            dv = from_blocks(dvb, lay, lay.tk)
            rep = lay.heads // k.shape[1]
            if rep > 1:
                dk = dk.reshape(lay.batch, k.shape[1], rep, lay.tk, d).sum(2)
                dv = dv.reshape(lay.batch, k.shape[1], rep, lay.tk, d).sum(2)
        return (
            dq.to(q.dtype),
            dk.to(k.dtype),
            dv.to(v.dtype),
            dtable.to(table.dtype),
            dtau.to(tau.dtype),
            None,
            None,
            None,
            None,
        )


@torch.compiler.disable  # eager CPU kernels and a custom autograd.Function: dynamo cannot trace its saved
# intermediates ("created inside a higher-order op"), and compiling brings nothing here
def elastic_blockwise(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    table: Tensor,
    tau: Tensor,
    scale: float,
    *,
    block: int = BLOCK,
    stats: dict[str, Tensor] | None = None,
) -> Tensor:
    """sum_j relu(softmax_j(s_ij) - tau_h / (i + 1)) v_j, s = q.k * scale - table[h, clamp(i - j, 0, len - 1)], for
    queries at positions Tk - Tq .. Tk - 1 over keys 0 .. Tk - 1 (module docstring). ``stats``, when given, receives
    the mean sink ratio (weight on key 0) and density (weight on the others) of the real rows."""
    block = max(1, min(block, q.shape[2]))
    need_grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v, table, tau))
    return ElasticBlockwise.apply(q, k, v, table, tau, scale, block, need_grad, stats)
