"""Dynamic Group Attention's dense reference as plain functions (appendix D's mask in dense form).

Over ``[all raw keys; all aggregates]`` (T x (T + G)): ``masks`` says which raw keys and which aggregates each
query sees, ``weights`` is the masked softmax over both, ``attention`` its output. The compression (importance,
selection, aggregation) is the module's, shared by every path; these take its focal positions, groups and
aggregates as tensors.
"""

from __future__ import annotations

import torch
from torch import Tensor

from model.attention.common import reference as ref


def masks(
    focal_pos: Tensor, members: Tensor, q_pos: Tensor, k_pos: Tensor, *, selection: str, chunk_size: int
) -> tuple[Tensor, Tensor]:
    """Appendix D's mask in dense form: raw keys [B, H, Tq, Tk] and aggregates [B, H, Tq, U*g].

    focal_pos [B, H, U, r] and members [B, H, U, g, m]: the compression's focal positions and groups (``Compressed``);
    ``chunk_size`` is read by the causal form only."""
    b, h = focal_pos.shape[:2]
    tk = k_pos.numel()
    dev = focal_pos.device
    q_pos, k_pos = q_pos.to(dev), k_pos.to(dev)
    focal = torch.zeros(b, h, tk, dtype=torch.bool, device=dev).scatter_(-1, focal_pos.reshape(b, h, -1), True)
    causal = ref.causal_mask(q_pos, k_pos)
    last = members[..., -1].reshape(b, h, -1)  # [B, H, G] last member of each group
    if selection == "causal":
        c = chunk_size
        window = (k_pos // c)[None, :] >= (q_pos // c)[:, None] - 1
        raw = causal & (focal[:, :, None, :] | window)
        agg = ((last // c + 2) * c)[:, :, None, :] <= q_pos[None, None, :, None]
    else:
        # a non-focal token is seen raw (complementary) while its group is unfinished at the query
        group_last = torch.full((b, h, tk), -1, dtype=torch.long, device=dev)
        group_last.scatter_(-1, members.reshape(b, h, -1), members[..., -1:].expand_as(members).reshape(b, h, -1))
        unfinished = group_last[:, :, None, :] > q_pos[:, None]
        raw = causal & (focal[:, :, None, :] | unfinished)
        agg = last[:, :, None, :] <= q_pos[None, None, :, None]
    return raw, agg


def weights(q: Tensor, k: Tensor, agg_k: Tensor, raw_mask: Tensor, agg_mask: Tensor, scale: float) -> Tensor:
    """Masked softmax of q over [raw keys; aggregates]: [B, H, Tq, Tk + G]. k [B, H, Tk, D] at the query head count,
    agg_k the aggregated keys ([B, H, U, g, D] or [B, H, G, D])."""
    b, h = q.shape[:2]
    keys = torch.cat([k, agg_k.reshape(b, h, -1, k.shape[-1])], dim=2)
    mask = torch.cat([raw_mask, agg_mask], dim=-1)
    return ref.masked_softmax(ref.scores(q, keys, scale), mask)


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    agg_k: Tensor,
    agg_v: Tensor,
    raw_mask: Tensor,
    agg_mask: Tensor,
    scale: float,
) -> Tensor:
    """The dense reference output [B, Hq, Tq, D]: ``weights`` applied to [raw values; aggregated values]."""
    b, h = q.shape[:2]
    values = torch.cat([v, agg_v.reshape(b, h, -1, v.shape[-1])], dim=2)
    return ref.weighted_values(weights(q, k, agg_k, raw_mask, agg_mask, scale), values, q.dtype)
