"""Focus soft mode on the CPU, exact, in memory linear in T (paper appendix E.4.8 and eq. 4).

Query i attends key j <= i; pairs inside the window (i - j < w) are plain attention, farther pairs get the gate of
x_ij = lam (g_i . g_j - 0.5) (additive: + log sigmoid(x) on the logit) or of x_ij = lam g_i . g_j (multiplicative:
the logit times sigmoid(x)). The gate is a function of two per-token assignment vectors g [B, T, K] and is shared by
every head, so a block of queries needs only its [B, Bq, Tk] gate, one small matmul away from g.

``cpu_soft_attention`` goes over blocks of queries; a block reads only the keys up to its last query (its causal
prefix):
- forward, additive: the block's gate (the window band 0, keys after a query -inf) is the float ``attn_mask`` of the
  fused CPU flash kernel (``aten._scaled_dot_product_flash_attention_for_cpu``, broadcast over heads: cheaper than a
  per-head mask), which returns the output and the row logsumexp. Multiplicative: the gate multiplies the logits, which
  no additive mask expresses, so the block's scores are formed explicitly ([B, H, Bq, Tk]) and softmaxed.
- backward (a ``torch.autograd.Function``): per block the probabilities are recomputed from the saved logsumexp,
  P = exp(s - L), and ds = P (dP - D) with D_i = dO_i . O_i; dq, dk, dv are matmuls with ds and P; the gate's
  gradient is ds summed over heads times its derivative (additive: sigmoid(-x); multiplicative: s_raw sigmoid'(x)),
  which gives dg_i = lam sum_j dx_ij g_j, dg_j = lam sum_i dx_ij g_i and dlam = sum dx_ij dx/dlam.
Memory: the inputs, output and gradients, plus a few [B, H, Bq, Tk] block temporaries with Bq * Tk bounded
(``BLOCK_ELEMENTS``): O(T * block), never T x T.

Queries are the last Tq positions of the Tk keys (a whole sequence, a prefill chunk onto a KV cache, or a decode
step); grouped KV heads (GQA) are read in place.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

_FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
BLOCK_ELEMENTS = 1 << 20  # B * H * Bq * Tk entries of one block temporary at least (4 MiB in float32) ...
BLOCK_SHARE = 2  # ... or up to twice q's entries: few blocks (each op's threads meet once per block), the peak memory
# a few times q's
MIN_BLOCK, MAX_BLOCK = 32, 512  # query rows per block


def soft_dtypes() -> tuple[torch.dtype, ...]:
    """Dtypes this path computes in as they are (the reference computes the gate in float32 or wider)."""
    return (torch.float32, torch.float64)


def block_rows(batch: int, heads: int, tq: int, tk: int, head_dim: int) -> int:
    """Query rows per block: as many as keep one [B, H, Bq, Tk] temporary within ``BLOCK_ELEMENTS`` or
    ``BLOCK_SHARE`` times q's size, whichever is larger."""
    budget = max(BLOCK_ELEMENTS, BLOCK_SHARE * batch * heads * tq * head_dim)
    rows = budget // max(1, batch * heads * tk)
    return max(1, min(tq, max(MIN_BLOCK, min(MAX_BLOCK, rows))))


class _Block:
    """One block of queries, rows [lo, hi) at positions start + lo .. start + hi - 1, over keys [0, kend)."""

    def __init__(self, lo: int, hi: int, start: int, window: int):
        self.lo, self.hi = lo, hi
        self.kend = start + hi  # keys after the block's last query are never read
        # keys before ``far`` are outside the window of every row of the block: the gate applies unmasked there; the
        # masks below cover only the tail [far, kend) (at most Bq + window - 1 keys wide)
        self.far = max(0, min(self.kend, start + lo - window + 1))
        pos = torch.arange(start + lo, start + hi)[:, None]
        keys = torch.arange(self.far, self.kend)[None, :]
        self.future = keys > pos  # [Bq, kend - far]
        self.near = (pos - keys < window) & ~self.future  # inside the window: never gated


def _gate_x(g_q: Tensor, g_k: Tensor, lam: Tensor, blk: _Block, additive: bool) -> Tensor:
    """x_ij for the block's rows and keys, [B, Bq, kend]: lam (g_i . g_j - 0.5) as one matmul of [lam g_i, -lam / 2]
    and [g_j, 1] (additive), or (lam g_i) . g_j (multiplicative)."""
    a_q, a_k = g_q[:, blk.lo : blk.hi] * lam, g_k[:, : blk.kend]
    if additive:
        a_q = torch.cat([a_q, (-0.5 * lam).expand(*a_q.shape[:2], 1)], dim=-1)
        a_k = torch.cat([a_k, a_k.new_ones(*a_k.shape[:2], 1)], dim=-1)
    return torch.matmul(a_q, a_k.transpose(-1, -2))


def _factor(g_q: Tensor, g_k: Tensor, lam: Tensor, blk: _Block, additive: bool) -> Tensor:
    """sigmoid(x) on the gated pairs, 1 inside the window, 0 after the query (additive) / sigmoid(x) unmasked at
    the future (multiplicative: those logits are masked separately): [B, Bq, kend]. The additive gate is its log."""
    # out of place: selective activation checkpointing keeps the matmul's output for the replay
    # (model/activation_checkpointing.py)
    factor = torch.sigmoid(_gate_x(g_q, g_k, lam, blk, additive))
    tail = factor[:, :, blk.far :]
    tail.masked_fill_(blk.near, 1.0)
    if additive:
        tail.masked_fill_(blk.future, 0.0)
    return factor


def _additive_mask(g_q: Tensor, g_k: Tensor, lam: Tensor, blk: _Block, exact_log: bool) -> Tensor:
    """The additive gate log sigmoid(x), 0 inside the window and -inf after the query: [B, Bq, kend]. As log of the
    sigmoid (twice as fast as ``logsigmoid``) while |x| cannot reach the sigmoid's underflow (``exact_log`` False)."""
    if not exact_log:
        return _factor(g_q, g_k, lam, blk, True).log_()
    mask = F.logsigmoid(_gate_x(g_q, g_k, lam, blk, True))
    tail = mask[:, :, blk.far :]
    tail.masked_fill_(blk.near, 0.0)
    tail.masked_fill_(blk.future, float("-inf"))
    return mask


def _grouped(x: Tensor, n_kv: int) -> Tensor:
    """[B, H, Bq, D] -> [B, Hkv, G * Bq, D] (head h reads KV head h // G)."""
    b, h, t, d = x.shape
    return x.reshape(b, n_kv, (h // n_kv) * t, d)


def _scores(q_blk: Tensor, k: Tensor) -> Tensor:
    """q k^T (q already scaled) as [B, Hkv, G, Bq, Tk]."""
    b, h, t, _ = q_blk.shape
    n_kv = k.shape[1]
    s = torch.matmul(_grouped(q_blk, n_kv), k.transpose(-1, -2))
    return s.view(b, n_kv, h // n_kv, t, k.shape[2])


def _multiplicative_forward(q_blk: Tensor, k: Tensor, v: Tensor, m: Tensor, blk: _Block) -> tuple[Tensor, Tensor]:
    s = _scores(q_blk, k) * m[:, None, None]  # out of place: the matmul's output may be kept for the replay
    s[..., blk.far :].masked_fill_(blk.future, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = s.sub_(lse[..., None]).exp_()
    b, n_kv, g, t, tk = p.shape
    out = torch.matmul(p.view(b, n_kv, g * t, tk), v).view(b, n_kv * g, t, -1)
    return out, lse.view(b, n_kv * g, t)


def _exact_log(lam: Tensor, additive: bool) -> bool:
    """Whether the gate needs ``logsigmoid`` itself: |x| <= |lam| / 2 (g_i . g_j in [0, 1]) may underflow the
    sigmoid of float32 (below -87) only when |lam| passes 160."""
    return additive and abs(float(lam)) > 160.0


def _forward(
    q: Tensor, k: Tensor, v: Tensor, g_q: Tensor, g_k: Tensor, lam: Tensor, window: int, scale: float, additive: bool
) -> tuple[Tensor, Tensor]:
    b, h, tq, _ = q.shape
    tk = k.shape[2]
    start = tk - tq
    out = torch.empty_like(q)
    lse = q.new_empty(b, h, tq)
    rows = block_rows(b, h, tq, tk, q.shape[3])
    exact_log = _exact_log(lam, additive)
    for lo in range(0, tq, rows):
        blk = _Block(lo, min(tq, lo + rows), start, window)
        q_blk, k_blk, v_blk = q[:, :, blk.lo : blk.hi], k[:, :, : blk.kend], v[:, :, : blk.kend]
        if additive:
            mask = _additive_mask(g_q, g_k, lam, blk, exact_log)
            o, l_blk = _FWD(q_blk, k_blk, v_blk, 0.0, False, attn_mask=mask[:, None], scale=scale)
        else:
            m = _factor(g_q, g_k, lam, blk, False)
            o, l_blk = _multiplicative_forward(q_blk * scale, k_blk, v_blk, m, blk)
        out[:, :, blk.lo : blk.hi] = o
        lse[:, :, blk.lo : blk.hi] = l_blk
    return out, lse


class SoftAttention(torch.autograd.Function):
    """Values and gradients (q, k, v, g_q, g_k, lam) of blockwise soft-gated attention; see the module docstring."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        g_q: Tensor,
        g_k: Tensor,
        lam: Tensor,
        window: int,
        scale: float,
        additive: bool,
    ) -> Tensor:
        out, lse = _forward(q, k, v, g_q, g_k, lam, window, scale, additive)
        ctx.save_for_backward(q, k, v, g_q, g_k, lam, out, lse)
        ctx.window, ctx.scale, ctx.additive = window, scale, additive  # type: ignore[attr-defined]
        return out

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, g_q, g_k, lam, out, lse = ctx.saved_tensors  # type: ignore[attr-defined]
        window, scale, additive = ctx.window, ctx.scale, ctx.additive  # type: ignore[attr-defined]
        grads = _backward(grad_out, q, k, v, g_q, g_k, lam, out, lse, window, scale, additive)
        return (*grads, None, None, None)


def _backward(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g_q: Tensor,
    g_k: Tensor,
    lam: Tensor,
    out: Tensor,
    lse: Tensor,
    window: int,
    scale: float,
    additive: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    b, h, tq, _ = q.shape
    n_kv, tk = k.shape[1], k.shape[2]
    n_rep, start = h // n_kv, tk - tq
    grad_out = grad_out.contiguous()
    q_scaled = q * scale
    dq = torch.empty_like(q)
    dk, dv = (torch.zeros(x.shape, dtype=x.dtype, device=x.device) for x in (k, v))  # contiguous, as k may not be
    dk_3, dv_3 = dk.view(b * n_kv, tk, -1), dv.view(b * n_kv, tk, -1)  # accumulated in place by baddbmm_
    dg_q, dg_k = torch.empty_like(g_q), torch.zeros_like(g_k)
    dlam = torch.zeros((), dtype=g_q.dtype)
    delta = (grad_out * out).sum(-1)  # D_i = dO_i . O_i [B, H, Tq]
    rows = block_rows(b, h, tq, tk, q.shape[3])
    for lo in range(0, tq, rows):
        blk = _Block(lo, min(tq, lo + rows), start, window)
        t, kend = blk.hi - blk.lo, blk.kend
        q_blk, k_blk, v_blk = q_scaled[:, :, blk.lo : blk.hi], k[:, :, :kend], v[:, :, :kend]
        do_g = _grouped(grad_out[:, :, blk.lo : blk.hi], n_kv)
        factor = _factor(g_q, g_k, lam, blk, additive)  # [B, Bq, Tk]
        s = _scores(q_blk, k_blk)  # [B, Hkv, G, Bq, Tk], scaled logits before the gate
        s_raw = None if additive else s.clone()
        if not additive:
            s.mul_(factor[:, None, None])
        s[..., blk.far :].masked_fill_(blk.future, float("-inf"))
        p = s.sub_(lse[:, :, blk.lo : blk.hi].reshape(b, n_kv, n_rep, t, 1)).exp_()
        if additive:  # exp(s + log f - L) = exp(s - L) f: the gate's log is never taken here
            p.mul_(factor[:, None, None])
        p_flat = p.view(b * n_kv, n_rep * t, kend)
        dv_3[:, :kend].baddbmm_(p_flat.transpose(-1, -2), do_g.reshape(b * n_kv, n_rep * t, -1))
        dp = torch.matmul(do_g, v_blk.transpose(-1, -2)).view(b, n_kv, n_rep, t, kend)
        ds = dp.sub_(delta[:, :, blk.lo : blk.hi].reshape(b, n_kv, n_rep, t, 1)).mul_(p)  # dL/d(gated logit)
        if additive:
            # the gate log f is shared by the heads; d log sigmoid(x) / dx = 1 - f (0 in the window, where f = 1)
            ds_heads = ds.sum(dim=(1, 2))
            dx = torch.addcmul(ds_heads, ds_heads, factor, value=-1.0)
        else:
            assert s_raw is not None
            dm = s_raw.mul_(ds).sum(dim=(1, 2))  # d(s_raw f) / df = s_raw, summed over the heads
            dx = dm.mul_(factor * (1.0 - factor))  # sigmoid'(x) = f (1 - f): 0 in the window, where f = 1
            ds.mul_(factor[:, None, None])  # dL/d(raw logit)
        ds_flat = ds.view(b * n_kv, n_rep * t, kend)
        dq_blk = torch.matmul(ds_flat, k_blk.reshape(b * n_kv, kend, -1))
        dq[:, :, blk.lo : blk.hi] = dq_blk.mul_(scale).view(b, h, t, -1)
        # q_blk holds the scale
        dk_3[:, :kend].baddbmm_(ds_flat.transpose(-1, -2), _grouped(q_blk, n_kv).reshape(b * n_kv, n_rep * t, -1))
        # x = lam (g_i . g_j) (- lam / 2): dg_i = lam sum_j dx_ij g_j, dg_j = lam sum_i dx_ij g_i, and dlam =
        # sum dx_ij g_i . g_j (- sum dx / 2) = sum_i g_i . (dx g)_i (- ...): the transposed products are the fast ones
        g_blk = g_q[:, blk.lo : blk.hi]
        dx_g = torch.matmul(g_k[:, :kend].transpose(-1, -2), dx.transpose(-1, -2)).transpose(-1, -2)  # [B, Bq, K]
        dlam += (g_blk * dx_g).sum() - (0.5 * dx.sum() if additive else 0.0)
        dg_q[:, blk.lo : blk.hi] = dx_g.mul_(lam)
        dg_k[:, :kend] += torch.matmul(g_blk.transpose(-1, -2), dx).transpose(-1, -2).mul_(lam)
    return dq, dk, dv, dg_q, dg_k, dlam.reshape(lam.shape).to(lam.dtype)


@torch.compiler.disable  # eager CPU kernels and a custom autograd.Function: dynamo cannot trace its saved
# intermediates ("created inside a higher-order op"), and compiling brings nothing here
def cpu_soft_attention(
    q: Tensor, k: Tensor, v: Tensor, g_q: Tensor, g_k: Tensor, lam: Tensor, *, window: int, scale: float, gate: str
) -> Tensor:
    """Soft-gated causal attention of q [B, H, Tq, D] (the last Tq of the Tk positions) over k, v [B, Hkv, Tk, D];
    g_q [B, Tq, K], g_k [B, Tk, K] assignments, lam [1] the gate strength. The same as the dense reference."""
    dtype = q.dtype
    return SoftAttention.apply(q, k, v, g_q.to(dtype), g_k.to(dtype), lam.to(dtype), window, scale, gate == "additive")
