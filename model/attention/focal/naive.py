"""Focal's dense reference as plain functions (papers/focal-attention-temperature.txt, section 2): the
temperature, a constant t (eq. 5) or the learned tau of eq. 6, and the temperature-scaled causal softmax."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from model.attention.common import reference as ref


def constant_scale(t: float, head_dim: int) -> float:
    """Eq. 5: the logits are q . k / (t * sqrt(d_h))."""
    return 1.0 / (t * math.sqrt(head_dim))


def tau_offset(head_dim: int, tau_min: float, tau_max: float) -> float:
    """clip(sqrt(d_h)): the divisor at w_tau = 0, so that training starts from standard attention."""
    return min(max(math.sqrt(head_dim), tau_min), tau_max)


def clipped_tau(z: Tensor, offset: float, tau_min: float, tau_max: float) -> Tensor:
    """tau = clip(offset + z, tau_min, tau_max) (eq. 6)."""
    return torch.clamp(offset + z, tau_min, tau_max)


def learned_tau(
    hidden: Tensor,
    w_tau: Tensor,
    q_pos: Tensor,
    *,
    scope: str,
    offset: float,
    tau_min: float,
    tau_max: float,
    prior_sum: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """[B, Tq] divisor of each query's logits, reducing z = x . w_tau over the scope: the query itself
    (``query``), the mean over tokens <= i (``prefix_mean``) or over every token so far (``sequence_mean``).

    ``prior_sum`` [B]: the sum of z over the tokens before this chunk (a KV cache keeps it). Also returns the
    sum of z through the last query, for the next chunk (None for the ``query`` scope, which needs none)."""
    z = hidden.to(w_tau.dtype) @ w_tau  # [B, Tq]
    total = None
    if scope != "query":
        csum = torch.cumsum(z, dim=1)
        if prior_sum is not None:  # sum over the tokens already cached
            csum = csum + prior_sum[:, None]
        total = csum[:, -1]
        if scope == "prefix_mean":
            z = csum / (q_pos + 1).to(z.dtype)
        else:  # the mean over every token of the sequence (so far, when decoding)
            z = (csum[:, -1:] / (q_pos[-1] + 1).to(z.dtype)).expand_as(z)
    return clipped_tau(z, offset, tau_min, tau_max), total


def weights(q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor, scale: float | Tensor) -> Tensor:
    """[B, H, Tq, Tk] softmax over keys k_pos[j] <= q_pos[i] of q_i . k_j * scale: a float (1 / (t sqrt(d_h)))
    or a per-query [B, 1, Tq, 1] tensor (1 / tau)."""
    return ref.masked_softmax(ref.scores(q, k, scale), ref.causal_mask(q_pos, k_pos))


def attention(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, k_pos: Tensor, scale: float | Tensor) -> Tensor:
    """[B, H, Tq, D] temperature-scaled causal softmax attention in q's dtype."""
    return ref.weighted_values(weights(q, k, q_pos, k_pos, scale), v, q.dtype)
