"""Focus's dense references as plain functions of tensors (papers/focus-sinkhorn-centroid-attention.md, E.4).

Soft mode: ``gate_logits`` gives the gate of every (query, key) pair from the per-token assignments g [B, T, K]
(additive: ``log sigmoid(lam (g_i . g_j - 0.5))``, E.4.8; multiplicative: ``sigmoid(lam g_i . g_j)``, eq. 4) and
which pairs it applies to (i - j >= window); ``soft_attention`` is causal attention under it with the dense
[B, H, Tq, Tk] gate and scores.

Hard mode: ``membership_bits`` turns assignments into each token's top-k groups (an int64 bitmask); query i attends
key j iff j <= i and (i - j < window or their memberships intersect), the dense mask ``hard_mask``;
``hard_attention`` is the masked softmax under it.

The fast paths (``soft/``, ``hard/``) are checked against these; ``FocusAttention.reference`` calls them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from model.attention.common import reference as ref


def membership_bits(assign: Tensor, top_k: int) -> Tensor:
    """[B, T, K] assignments -> [B, T] int64 bitmask of each token's top-k groups (ties: lower index)."""
    if top_k == 1:  # argmax returns the first of tied maxima too: the same bits, two operations
        return torch.pow(2, assign.argmax(-1))
    top = torch.sort(assign, dim=-1, descending=True, stable=True).indices[..., :top_k]
    return torch.bitwise_left_shift(torch.ones_like(top), top).sum(-1)


def hard_mask(bits_q: Tensor, bits_k: Tensor, q_pos: Tensor, k_pos: Tensor, window: int) -> Tensor:
    """[B, Tq, Tk] boolean: the dense mask of the hard Focus pattern."""
    causal = ref.causal_mask(q_pos, k_pos)
    local = (q_pos[:, None] - k_pos[None, :]) < window
    shared = (bits_q[:, :, None] & bits_k[:, None, :]) != 0
    return causal & (local | shared)


def hard_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bits_q: Tensor,
    bits_k: Tensor,
    *,
    q_pos: Tensor,
    k_pos: Tensor,
    window: int,
    scale: float,
) -> Tensor:
    """Hard-mode attention of q [B, H, Tq, D] over k, v [B, Hkv, Tk, D] under the dense ``hard_mask`` of the
    memberships bits_q [B, Tq], bits_k [B, Tk]; [B, H, Tq, D] in q's dtype."""
    mask = hard_mask(bits_q, bits_k, q_pos, k_pos, window)[:, None]
    p = ref.masked_softmax(ref.scores(q, k, scale), mask)
    return ref.weighted_values(p, v, q.dtype)


def gate_logits(
    g_q: Tensor, g_k: Tensor, lam: Tensor, q_pos: Tensor, k_pos: Tensor, *, window: int, gate: str
) -> tuple[Tensor, Tensor]:
    """(gate value [B, Tq, Tk], distant [Tq, Tk]) for the soft mode."""
    affinity = g_q @ g_k.transpose(-1, -2)
    lam = lam.to(affinity.dtype)
    distant = (q_pos[:, None] - k_pos[None, :]) >= window
    if gate == "additive":
        return F.logsigmoid(lam * (affinity - 0.5)), distant
    return torch.sigmoid(lam * affinity), distant


def soft_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g_q: Tensor,
    g_k: Tensor,
    lam: Tensor,
    *,
    q_pos: Tensor,
    k_pos: Tensor,
    window: int,
    scale: float,
    gate: str,
) -> Tensor:
    """Soft-gated causal attention with the dense [B, H, Tq, Tk] gate and scores (the reference): q [B, H, Tq, D],
    k, v [B, Hkv, Tk, D], g_q [B, Tq, K], g_k [B, Tk, K] assignments, lam [1] the gate strength."""
    s = ref.scores(q, k, scale)
    value, distant = gate_logits(g_q.to(s.dtype), g_k.to(s.dtype), lam, q_pos, k_pos, window=window, gate=gate)
    if gate == "additive":
        s = s + torch.where(distant, value, torch.zeros_like(value))[:, None]
    else:
        s = torch.where(distant, s * value[:, None], s)
    p = ref.masked_softmax(s, ref.causal_mask(q_pos, k_pos))
    return ref.weighted_values(p, v, q.dtype)
