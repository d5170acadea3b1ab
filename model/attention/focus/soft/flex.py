"""Focus soft mode on the GPU without triton: the gated attention as one FlexAttention call whose ``score_mod``
computes the gate from the captured per-token assignments (papers/focus-sinkhorn-centroid-attention.md, E.4.8 and
eq. 4); ``fold_gate``, lambda folded into the per-token vectors, shared with the Triton kernels (``triton.py``)."""

from __future__ import annotations

import torch
from torch import Tensor

from model.attention.common.flex import causal_block_mask, flex_attention_fn


def fold_gate(g_q: Tensor, g_k: Tensor, lam: Tensor, dtype: torch.dtype, additive: bool) -> tuple[Tensor, Tensor]:
    """(a_q, a_k) with ``a_q[i] . a_k[j]`` the gate's argument, lambda folded in: additive ``lam (g_q . g_k - 0.5) =
    [lam g_q, -lam / 2] . [g_k, 1]``, multiplicative ``(lam g_q) . g_k``; in ``dtype``. Gradients reach lambda
    through a_q."""
    lam = lam.to(dtype)
    a_q, a_k = g_q.to(dtype) * lam, g_k.to(dtype)
    if additive:
        a_q = torch.cat([a_q, (-0.5 * lam).expand(*a_q.shape[:2], 1)], dim=-1)
        a_k = torch.cat([a_k, a_k.new_ones(*a_k.shape[:2], 1)], dim=-1)
    return a_q, a_k


def flex_soft_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g_q: Tensor,
    g_k: Tensor,
    lam: Tensor,
    q_pos: Tensor,
    *,
    window: int,
    scale: float,
    gate: str,
) -> Tensor:
    """Soft-gated attention as one FlexAttention call. Lambda is folded into the captured per-token vectors
    (``fold_gate``), so no 0-dim tensor is captured and gradients reach lambda through them. The dot product is K
    scalar loads (a vector reduction does not lower under compile). The causal block mask is cached per shape and
    shared by layers. Compiled on CUDA, eager elsewhere. The soft mode's fallback on CUDA where the Triton kernels
    (``triton.py``) cannot run: the backward adds each captured vector's gradient with one atomic per score element.

    q [B, H, Tq, D] at positions q_pos [Tq] (the last Tq of the keys), k, v [B, Hkv, Tk, D]; g_q [B, Tq, K],
    g_k [B, Tk, K] assignments, lam [1] the gate strength."""
    additive = gate == "additive"
    # the gate in float32 as the reference's (bf16 lost 4x)
    a_q, a_k = fold_gate(g_q, g_k, lam, torch.promote_types(q.dtype, torch.float32), additive)
    # one [B, T] tensor per term, each indexed once: inductor cannot lower a score_mod that indexes one tensor
    # requiring gradients more than once
    terms_q = [t.contiguous() for t in a_q.unbind(-1)]
    terms_k = [t.contiguous() for t in a_k.unbind(-1)]
    q_pos = q_pos.to(q.device)

    def gated(score: Tensor, b: Tensor, h: Tensor, qi: Tensor, kv: Tensor) -> Tensor:
        x = terms_q[0][b, qi] * terms_k[0][b, kv]
        for tq_c, tk_c in zip(terms_q[1:], terms_k[1:]):
            x = x + tq_c[b, qi] * tk_c[b, kv]
        if additive:
            gated_score = score + torch.clamp(x, max=0.0) - torch.log1p(torch.exp(-torch.abs(x)))  # log sigmoid
        else:
            gated_score = score * torch.sigmoid(x)
        return torch.where(q_pos[qi] - kv >= window, gated_score, score)

    block_mask = causal_block_mask(q.shape[2], k.shape[2], q.device)
    return flex_attention_fn(q.is_cuda, "focus_soft")(
        q, k, v, score_mod=gated, block_mask=block_mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1]
    )
