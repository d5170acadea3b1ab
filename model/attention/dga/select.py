"""Dynamic Group Attention's focal selection as one operator, ``dga::focal_order``: its integer output is what
selective activation checkpointing keeps for the backward (``DynamicGroupAttention.attention_ops``), so the
backward neither recomputes the importance scores nor re-runs their top-k and ordering."""

from __future__ import annotations

import torch
from torch import Tensor


@torch.library.custom_op("dga::focal_order", mutates_args=())
def focal_order(importance: Tensor, r: int) -> Tensor:
    """Per row of ``importance`` [..., n]: the indices of the ``n - r`` non-focal keys, then of the ``r`` focal ones
    (the ``r`` most important), each part in position order (int64 [..., n]): a stable sort on the focal flag, done
    as a counting sort (two running counts and a scatter, no sort)."""
    n = importance.shape[-1]
    focal = torch.zeros_like(importance, dtype=torch.bool).scatter_(-1, importance.topk(r, dim=-1).indices, True)
    # each key's slot: the non-focal ones first, then the focal ones, position order kept within each part
    slot = torch.where(focal, (n - r) + focal.cumsum(-1), (~focal).cumsum(-1)) - 1
    order = torch.empty(importance.shape, dtype=torch.long, device=importance.device)
    return order.scatter_(-1, slot, torch.arange(n, device=importance.device).expand(importance.shape))


@focal_order.register_fake
def _focal_order_fake(importance: Tensor, r: int) -> Tensor:
    return importance.new_empty(importance.shape, dtype=torch.long)
