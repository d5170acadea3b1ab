"""Lazy attention on CPU, exact, in memory linear in T: Elastic-Softmax in two passes over block diagonals.

Queries at positions ``P .. P + Tq - 1`` (``P = Tk - Tq``: training has P = 0, chunked prefill onto a KV cache P > 0)
attend keys ``0 .. Tk - 1``. Both are cut into blocks of ``block`` rows: query block I starts at ``P + I * block``, key
block J at ``J * block``. Every pair of blocks on one diagonal ``e = I - J`` has the same distances
``i - j = P + e * block + a - b``, so the same distance-bias block (the bias is Toeplitz) and the same causal pattern:
for one (batch, head) a diagonal's query blocks I and key blocks I - e are consecutive rows of q and k, so one batched
matmul over ``[m, block, D]`` views of the inputs (no copy, whatever the strides of their T and D axes) gives m block
pairs' scores (``CHUNK_ELEMENTS`` per step), with that head's ``[block, block]`` bias block broadcast over them.
Diagonals wholly in the future are skipped. A ragged last block (T not a multiple of ``block``) is read from a
zero-padded copy of that one block and written through its real rows only.

- Forward, pass 1: each row's logsumexp ``lse`` of ``s = q.k * scale - b[clamp(i - j)]``, merged across diagonals.
- Pass 2: ``w = relu(exp(s - lse) - c)`` with ``c_i = tau_h / n_i`` (``n_i = i + 1``), future pairs zeroed (a
  negative tau would lift them), ``o += w @ v``; with grad, also ``a_i = sum_j 1[w_ij > 0] v_j``.
- Backward recomputes each block (nothing T x T is stored). With m = 1[w > 0]:
  ``dp = m * (do . v)``, ``ds = p * (dp - D)`` with ``D_i = sum_k p_ik dp_ik = do_i . (o_i + c_i a_i)``,
  ``dq = scale * ds @ k``, ``dk = scale * ds^T @ q``, ``dv = w^T @ do``, the bias table gets ``-ds`` summed per
  (clamped) distance, and ``dc_i = -do_i . a_i`` gives ``dtau_h = sum_i dc_i / n_i``.
- The first query (position 0) sees one key: its p is set to exactly 1 (lse's rounding could put it on either side of
  tau / 1 = 1, the paper's init, where the reference's weight and gradient are exactly zero).

Memory: the output (and with grad a, saved with the original q, k, v: no copies of them), row statistics (O(T)), one
chunk of scores and one ``[H, block, block]`` bias block; the backward adds dq, dk, dv and a few chunks. Never O(T^2).
The output is laid out as ``[B, T, H, D]`` (what the model's output projection reads, so its reshape is free).
Arithmetic runs in float32 at least (float64 stays float64; bf16 inputs, e.g. under CPU autocast, are read in
float32 chunk by chunk and the results cast back).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

BLOCK = 256  # rows of a query / key block
MIN_ROWS = 8  # fewer queries (decode, short prefill chunks) take the dense reference: O(Tq * Tk) is small there
CHUNK_ELEMENTS = 1 << 20  # scores per batched matmul of one (batch, head) (4 MiB in float32): one step's working set


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

    def __init__(self, tq: int, tk: int, block: int, heads: int, kv_heads: int, batch: int, last: int):
        self.tq, self.tk, self.block, self.heads, self.batch, self.last = tq, tk, block, heads, batch, last
        self.rep = heads // kv_heads  # query heads per key/value head (GQA)
        self.start = tk - tq
        self.nq, self.nk = -(-tq // block), -(-tk // block)

    def diagonals(self) -> Iterator[Diagonal]:
        b, p = self.block, self.start
        for e in range(-(self.nk - 1), self.nq):
            if p + e * b + b - 1 < 0:  # every pair is in the future
                continue
            i0, i1 = max(0, e), min(self.nq, self.nk + e)
            if i0 < i1:
                yield Diagonal(e, i0, i1, partial=p + e * b - (b - 1) < 0)

    def chunks(self, diag: Diagonal) -> Iterator[tuple[int, int]]:
        step = max(1, CHUNK_ELEMENTS // (self.block * self.block))
        for i in range(diag.i0, diag.i1, step):
            yield i, min(diag.i1, i + step)

    def heads_of_batch(self) -> Iterator[tuple[int, int]]:
        """Every (batch row, query head)."""
        for b in range(self.batch):
            for h in range(self.heads):
                yield b, h

    def distances(self, e: int, device: torch.device) -> Tensor:
        """[block, block] distances i - j of the pairs on diagonal e."""
        r = torch.arange(self.block, device=device)
        return self.start + e * self.block + r[:, None] - r[None, :]

    def visible(self, diag: Diagonal, dtype: torch.dtype, device: torch.device) -> Tensor | None:
        """[block, block] 1 on the pairs of a partial diagonal that are not in the future, else 0 (None: all are
        visible). A product, not a masked fill: masked_fill_ costs several times a multiplication on CPU."""
        return (self.distances(diag.e, device) >= 0).to(dtype) if diag.partial else None

    def distance_sums(self, acc: Tensor, e: int) -> tuple[Tensor, Tensor]:
        """Sums of a [H, block, block] block of diagonal e over its pairs of equal distance: ([H, 2 * block - 1]
        sums, their distances). Entry (a, c) goes to column c - a + block - 1 of a [block, 2 * block - 1] matrix:
        rows written 2 * block - 2 apart (a strided copy, then a column sum; no gather)."""
        h, b = acc.shape[0], self.block
        skew = acc.new_zeros(h, b * (2 * b - 1))
        skew.as_strided((h, b, b), (b * (2 * b - 1), 2 * b - 2, 1), b - 1).copy_(acc)
        dist = self.start + e * b + (b - 1) - torch.arange(2 * b - 1, device=acc.device)
        return skew.view(h, b, 2 * b - 1).sum(1), dist

    def neg_bias(self, table: Tensor, e: int, dtype: torch.dtype) -> Tensor:
        """[H, block, block] ``-b[h, clamp(i - j)]`` on diagonal e, -inf on future pairs."""
        # Toeplitz: entry (a, c) is u[c - a + block - 1] for one row u over the 2 * block - 1 distances (and a
        # spare slot): windows of u read backwards (a gather over block^2 entries costs far more)
        b = self.block
        dist = self.start + e * b + (b - 1) - torch.arange(2 * b, device=table.device)
        u = -table.to(dtype)[:, dist.clamp(0, self.last)]
        u.masked_fill_((dist < 0)[None], float("-inf"))
        return u.unfold(1, b, 1)[:, :b].flip(1)


class Blocks:
    """Reads ``[m, block, D]`` blocks of one (batch, head) of a ``[B, H, T, D]`` tensor: views of it (any strides),
    except the ragged last block, read from a zero-padded copy of that block (one block per batch and head)."""

    def __init__(self, x: Tensor, block: int, dtype: torch.dtype):
        self.x, self.block, self.dtype = x, block, dtype
        t = x.shape[2]
        self.full = t // block  # blocks wholly inside
        self.tail: Tensor | None = None
        if t % block:
            self.tail = x.new_zeros(x.shape[0], x.shape[1], block, x.shape[3], dtype=dtype)
            self.tail[:, :, : t - self.full * block] = x[:, :, self.full * block :]

    def __call__(self, b: int, h: int, i0: int, i1: int) -> Tensor:
        blk, hi = self.block, min(i1, self.full)
        body = self.x[b, h, i0 * blk : hi * blk].unflatten(0, (hi - i0, blk)).to(self.dtype) if i0 < hi else None
        if i1 <= self.full and body is not None:
            return body
        assert self.tail is not None  # i1 is past the whole blocks: there is a ragged one
        tail = self.tail[b, h, None]
        return tail if body is None else torch.cat((body, tail))


class Rows:
    """Accumulates ``x @ y`` (``[m, block, *] @ [m, *, D]``) into blocks of one (batch, head) of a ``[B, H, T, D]``
    buffer; of a ragged last block only the real rows."""

    def __init__(self, buf: Tensor, block: int):
        self.buf, self.block = buf, block
        self.full = buf.shape[2] // block

    def add(self, b: int, h: int, i0: int, i1: int, x: Tensor, y: Tensor, alpha: float = 1.0) -> None:
        blk, hi = self.block, min(i1, self.full)
        rows = self.buf[b, h]
        if i0 < hi:
            rows[i0 * blk : hi * blk].unflatten(0, (hi - i0, blk)).baddbmm_(x[: hi - i0], y[: hi - i0], alpha=alpha)
        if i1 > self.full:
            real = rows.shape[0] - self.full * blk
            rows[self.full * blk :].addmm_(x[-1, :real], y[-1], alpha=alpha)


def model_layout(b: int, h: int, t: int, d: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Zeros of shape [B, H, T, D] stored as [B, T, H, D]: the model's ``out.transpose(1, 2).reshape(B, T, H * D)``
    is then a view (and the tensor is not a view, so a caller may change it in place)."""
    return torch.empty_strided((b, h, t, d), (t * h * d, d, h * d, 1), dtype=dtype, device=device).zero_()


class _Scores:
    """Recomputes the biased scores / ``p = exp(s - lse)`` of one chunk of a diagonal for one (batch, head)."""

    def __init__(self, layout: Layout, q: Blocks, k: Blocks, lse: Tensor, table: Tensor, scale: float):
        self.layout, self.q, self.k, self.lse, self.table, self.scale = layout, q, k, lse, table, scale
        self.bias: dict[int, Tensor] = {}

    def neg_bias(self, e: int) -> Tensor:
        if e not in self.bias:
            self.bias = {e: self.layout.neg_bias(self.table, e, self.q.dtype)}  # one diagonal at a time
        return self.bias[e]

    def scores(self, diag: Diagonal, b: int, h: int, i0: int, i1: int, shift: bool = False) -> Tensor:
        """[n, block, block] biased scores s of query blocks i0..i1-1 on diagonal e (``s - lse`` with ``shift``:
        the row's logsumexp goes in with the bias, before the matmul accumulates onto it)."""
        lay, n = self.layout, i1 - i0
        j0, blk = i0 - diag.e, lay.block
        bias = self.neg_bias(diag.e)[h]
        if shift:
            s = torch.sub(bias, self.lse[b, h, i0 * blk : i1 * blk].view(n, blk, 1))
        else:
            s = bias.expand(n, blk, blk).clone()
        q, k = self.q(b, h, i0, i1), self.k(b, h // lay.rep, j0, j0 + n)
        return s.baddbmm_(q, k.transpose(1, 2), alpha=self.scale)

    def probs(self, diag: Diagonal, b: int, h: int, i0: int, i1: int) -> Tensor:
        lay = self.layout
        p = self.scores(diag, b, h, i0, i1, shift=True).exp_()
        if lay.start == 0 and diag.e == 0 and i0 == 0:
            p[0, 0, 0] = 1.0  # the first query's only key: p = 1 exactly
        return p


def _thresholds(layout: Layout, tau: Tensor, dtype: torch.dtype, device: torch.device) -> Tensor:
    """[H, nq * block] c_i = tau_h / (i + 1) for every query row (padding rows included)."""
    pos = torch.arange(layout.start, layout.start + layout.nq * layout.block, device=device, dtype=dtype)
    c = tau.to(dtype)[:, None] / (pos + 1)[None, :]  # [H, nq * block]
    return c


def _weights(p: Tensor, c: Tensor, visible: Tensor | None, out: Tensor | None = None) -> Tensor:
    """w = relu(p - c) on a chunk, zero on future pairs."""
    w = torch.sub(p, c, out=out).clamp_min_(0.0)
    if visible is not None:
        w.mul_(visible)
    return w


def logsumexp_rows(scores: _Scores, layout: Layout) -> Tensor:
    """Pass 1: [B, H, nq * block] logsumexp of each row's biased scores over its visible keys."""
    lay, blk = layout, layout.block
    shape, device = (lay.batch, lay.heads, lay.nq * blk), scores.q.x.device
    lse = torch.full(shape, float("-inf"), dtype=scores.q.dtype, device=device)
    for diag in lay.diagonals():
        for i0, i1 in lay.chunks(diag):
            for b, h in lay.heads_of_batch():
                row = lse[b, h, i0 * blk : i1 * blk].view(-1, blk)
                s = scores.scores(diag, b, h, i0, i1)
                top = s.amax(-1, keepdim=True).clamp_min_(torch.finfo(s.dtype).min)  # a row may see no key here
                chunk = s.sub_(top).exp_().sum(-1).log_().add_(top[..., 0])
                torch.logaddexp(row, chunk, out=row)
                del s, top, chunk  # before the next chunk's scores exist
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
        batch, heads, tq, d = q.shape
        lay = Layout(tq, k.shape[2], block, heads, k.shape[1], batch, table.shape[1] - 1)
        blk, dev = block, q.device
        with torch.autocast(q.device.type, enabled=False):
            sc = _Scores(lay, Blocks(q, blk, dtype), Blocks(k, blk, dtype), torch.empty(0), table.detach(), scale)
            sc.lse = logsumexp_rows(sc, lay)
            vs = Blocks(v, blk, dtype)
            c = _thresholds(lay, tau.detach(), dtype, dev)
            o = model_layout(batch, heads, tq, d, dtype, dev)
            a = torch.zeros_like(o) if need_grad else None
            out_rows, a_rows = Rows(o, blk), (Rows(a, blk) if a is not None else None)
            rowsum = torch.zeros_like(sc.lse) if stats is not None else None
            sink = torch.zeros_like(sc.lse) if stats is not None else None
            for diag in lay.diagonals():
                visible = lay.visible(diag, dtype, dev)
                for i0, i1 in lay.chunks(diag):
                    n, j0 = i1 - i0, i0 - diag.e
                    for b, h in lay.heads_of_batch():
                        p = sc.probs(diag, b, h, i0, i1)
                        w = _weights(p, c[h, i0 * blk : i1 * blk].view(n, blk, 1), visible, out=p)
                        vj = vs(b, h // lay.rep, j0, j0 + n)
                        out_rows.add(b, h, i0, i1, w, vj)
                        if a_rows is not None:
                            a_rows.add(b, h, i0, i1, torch.sign(w), vj)
                        if rowsum is not None and sink is not None:
                            rowsum[b, h, i0 * blk : i1 * blk] += w.sum(-1).view(-1)
                            if j0 == 0:
                                sink[b, h, i0 * blk : (i0 + 1) * blk] += w[0, :, 0]
                        del p, w, vj  # before the next chunk's scores exist
            if stats is not None and rowsum is not None and sink is not None:
                stats["sink_ratio"] = sink[..., :tq].mean()
                stats["density"] = (rowsum - sink)[..., :tq].mean()
        if need_grad:
            ctx.save_for_backward(q, k, v, table, tau, o, a, sc.lse)
            ctx.layout, ctx.scale, ctx.dtype = lay, scale, dtype
        return o.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, table, tau, o, a, lse = ctx.saved_tensors
        lay: Layout = ctx.layout
        blk, dtype, dev = lay.block, ctx.dtype, q.device
        with torch.autocast(q.device.type, enabled=False):
            c = _thresholds(lay, tau.detach(), dtype, dev)
            # D_i = do_i . (o_i + c_i a_i) and dc_i = -do_i . a_i, per row (one head at a time: no [B, H, T, D] product)
            da = torch.zeros_like(lse)
            big_d = torch.zeros_like(lse)
            for b, h in lay.heads_of_batch():
                do = grad[b, h].to(dtype)
                torch.sum(do * a[b, h], -1, out=da[b, h, : lay.tq])
                torch.sum(do * o[b, h], -1, out=big_d[b, h, : lay.tq])
            big_d.addcmul_(c[None], da)
            sc = _Scores(lay, Blocks(q, blk, dtype), Blocks(k, blk, dtype), lse, table.detach(), ctx.scale)
            vs, dos = Blocks(v, blk, dtype), Blocks(grad, blk, dtype)
            dq = torch.zeros(q.shape, dtype=dtype, device=dev)
            dk = torch.zeros(k.shape, dtype=dtype, device=dev)
            dv = torch.zeros(v.shape, dtype=dtype, device=dev)
            dq_rows, dk_rows, dv_rows = Rows(dq, blk), Rows(dk, blk), Rows(dv, blk)
            dtable = torch.zeros(table.shape, dtype=dtype, device=table.device)
            for diag in lay.diagonals():
                visible = lay.visible(diag, dtype, dev)
                acc = torch.zeros(lay.heads, blk, blk, dtype=dtype, device=dev)
                for i0, i1 in lay.chunks(diag):
                    n, j0 = i1 - i0, i0 - diag.e
                    for b, h in lay.heads_of_batch():
                        hk = h // lay.rep
                        p = sc.probs(diag, b, h, i0, i1)
                        w = _weights(p, c[h, i0 * blk : i1 * blk].view(n, blk, 1), visible)
                        dov = dos(b, h, i0, i1)
                        dv_rows.add(b, hk, j0, j0 + n, w.transpose(1, 2), dov)
                        # ds = p (m (do.v) - D) with m = sign(w) (w >= 0): a product, not a masked fill
                        ds = torch.bmm(dov, vs(b, hk, j0, j0 + n).transpose(1, 2)).mul_(w.sign_())
                        ds.sub_(big_d[b, h, i0 * blk : i1 * blk].view(n, blk, 1)).mul_(p)
                        dq_rows.add(b, h, i0, i1, ds, sc.k(b, hk, j0, j0 + n), alpha=ctx.scale)
                        dk_rows.add(b, hk, j0, j0 + n, ds.transpose(1, 2), sc.q(b, h, i0, i1), alpha=ctx.scale)
                        acc[h] += ds.sum(0)
                        del p, w, dov, ds
                sums, dist = lay.distance_sums(acc, diag.e)  # future pairs have p = 0, so ds = 0: sums of 0
                dtable.index_add_(1, dist.clamp(0, lay.last), sums.neg_())
            pos = torch.arange(lay.start, lay.start + lay.nq * blk, device=dev, dtype=dtype)
            dtau = -(da * (1.0 / (pos + 1))).sum((0, 2))
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
