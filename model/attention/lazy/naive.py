"""Lazy attention's dense reference, as plain functions of tensors: the distance bias, the Elastic-Softmax weights
``[B, H, Tq, Tk]`` and the output. O(Tq * Tk) memory: the module's ``reference`` path (and decode, short chunks), and
what the fast paths (``cpu.py``, ``flex.py``) are tested against.

``distance_bias`` is the ``[H, table]`` bias table, ``last`` its last index (distances past it read that entry),
``tau`` the ``[H]`` offsets and ``scale`` the logit scale (``1 / sqrt(d_h)``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from model.attention.common import reference as ref


def bias(q_pos: Tensor, k_pos: Tensor, distance_bias: Tensor, last: int) -> Tensor:
    """[H, Tq, Tk] bias for each query/key distance, clamped to the table."""
    distance = (q_pos[:, None] - k_pos[None, :]).clamp(0, last)
    return distance_bias[:, distance]


def weights(
    q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor, distance_bias: Tensor, tau: Tensor, scale: float, last: int
) -> Tensor:
    """Elastic-Softmax weights [B, H, Tq, Tk], dense."""
    mask = ref.causal_mask(q_pos, k_pos)
    s = ref.scores(q, k, scale) - bias(q_pos, k_pos, distance_bias, last).to(
        torch.promote_types(q.dtype, torch.float32)
    )
    p = ref.masked_softmax(s, mask)
    n = (q_pos + 1).to(p.dtype)  # keys attended by each query
    a = torch.relu(p - tau.to(p.dtype)[None, :, None, None] / n[None, None, :, None])
    return a.masked_fill(~mask, 0.0)  # a negative tau must not open the future


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_pos: Tensor,
    k_pos: Tensor,
    distance_bias: Tensor,
    tau: Tensor,
    scale: float,
    last: int,
) -> Tensor:
    """sum_j a_ij v_j with the weights above, in q's dtype."""
    return ref.weighted_values(weights(q, k, q_pos, k_pos, distance_bias, tau, scale, last), v, q.dtype)
