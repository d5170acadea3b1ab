"""Exact attention under hard group membership (Focus inference, paper appendix E.4).

Each token belongs to a set of groups, a bitmask (top-k of its assignment). Query i attends key j
iff j <= i and (i - j < window or their memberships intersect). Dense reference: ``naive.hard_mask``.

Exact decomposition, ``hard_attention``: the allowed pairs split into disjoint sets
- A_c, for each group c: pairs that share group c and no lower-numbered group (so a pair sharing
  several groups is counted once, in its first shared group). Tokens are stably sorted by group
  (causal order kept) and padded per group; each group is one attention call over ~kT/K tokens.
  For k = 1 the de-duplication is void and this is the paper's set A.
- B: pairs inside the window that share no group (the paper's cross-group local set).
Each part returns its output and logsumexp; the merge by logsumexp is exact because the parts
are disjoint. Every query has a non-empty part (it shares its own groups with itself).
"""

from __future__ import annotations

import torch
from torch import Tensor

from model.attention.common import reference as ref


def attend_lse(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """Masked softmax attention returning (output, logsumexp) in at least float32.

    q [..., Tq, D], k/v [..., Tk, D], mask broadcastable to [..., Tq, Tk]. A row with no key gives
    output 0 and lse -inf, with zero (not NaN) gradients, so a logsumexp merge can drop it.
    """
    dtype = torch.promote_types(q.dtype, torch.float32)
    s = torch.matmul(q.to(dtype), k.to(dtype).transpose(-1, -2)) * scale
    s = s.masked_fill(~mask, float("-inf"))
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m)).detach()
    e = torch.exp(s - m)
    z = e.sum(dim=-1, keepdim=True)
    nonempty = z > 0
    z_safe = torch.where(nonempty, z, torch.ones_like(z))
    out = torch.matmul(e / z_safe, v.to(dtype))
    lse = torch.where(nonempty, torch.log(z_safe) + m, torch.full_like(z, float("-inf")))
    return out, lse.squeeze(-1)


def _sorted_by_group(bits: Tensor, n_groups: int) -> tuple[Tensor, Tensor, Tensor]:
    """Per (batch, group), the member token indices in position order, padded.

    Returns (index [B, K, L], valid [B, K, L], member [B, T, K]) with L the largest group.
    """
    t = bits.shape[1]
    groups = torch.arange(n_groups, device=bits.device)
    member = ((bits[:, :, None] >> groups) & 1).bool()  # [B, T, K]
    pos = torch.arange(t, device=bits.device)[None, :, None]
    key = torch.where(member, pos, pos + t)  # members first, each in position order
    index = torch.sort(key, dim=1, stable=True).indices.transpose(1, 2)  # [B, K, T]
    count = member.sum(dim=1)  # [B, K]
    length = max(int(count.max()), 1)
    index = index[:, :, :length]
    valid = torch.arange(length, device=bits.device) < count[:, :, None]
    return index, valid, member


def _gather_tokens(x: Tensor, index: Tensor) -> Tensor:
    """x [B, H, T, D], index [B, K, L] -> [B, K, H, L, D]."""
    b, h, _, d = x.shape
    k, length = index.shape[1], index.shape[2]
    idx = index[:, :, None, :, None].expand(b, k, h, length, d)
    return x[:, None].expand(b, k, h, x.shape[2], d).gather(3, idx)


def hard_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    bits_q: Tensor,
    bits_k: Tensor,
    q_pos: Tensor,
    window: int,
    scale: float,
    n_groups: int,
) -> Tensor:
    """Exact hard-membership attention by the disjoint decomposition.

    q [B, H, Tq, D]; k, v [B, Hkv, Tk, D] with key j at position j (a training sequence or a KV
    cache from 0); q_pos [Tq]. Returns [B, H, Tq, D] in q's dtype.
    """
    n_heads = q.shape[1]
    k, v = ref.expand_kv(k, n_heads), ref.expand_kv(v, n_heads)
    b, h, tq, d = q.shape
    tk = k.shape[2]
    k_pos = torch.arange(tk, device=q.device)

    # ---- sets A_c: same group c, first shared group, causal, any distance ----
    qi, q_valid, q_member = _sorted_by_group(bits_q, n_groups)
    ki, k_valid, _ = _sorted_by_group(bits_k, n_groups)
    qg, kg, vg = _gather_tokens(q, qi), _gather_tokens(k, ki), _gather_tokens(v, ki)
    qpos_g, kpos_g = q_pos[qi], k_pos[ki]  # [B, K, L]
    qbits_g, kbits_g = bits_q.gather(1, qi.flatten(1)).view_as(qi), bits_k.gather(1, ki.flatten(1)).view_as(ki)
    lower = (
        torch.bitwise_left_shift(
            torch.ones(n_groups, dtype=torch.int64, device=q.device), torch.arange(n_groups, device=q.device)
        )
        - 1
    )[None, :, None, None]
    mask = (
        q_valid[..., :, None]
        & k_valid[..., None, :]
        & (kpos_g[..., None, :] <= qpos_g[..., :, None])
        & ((qbits_g[..., :, None] & kbits_g[..., None, :] & lower) == 0)
    )
    og, lseg = attend_lse(qg, kg, vg, mask[:, :, None], scale)  # [B, K, H, Lq, D], [B, K, H, Lq]
    # back to query order: query i's part from group c sits at its rank among c's members
    lq = qi.shape[2]
    slot = (torch.cumsum(q_member.long(), dim=1) - 1).clamp(min=0)  # [B, Tq, K]
    flat = (slot + torch.arange(n_groups, device=q.device) * lq).view(b, 1, tq * n_groups)
    o_a = (
        og.transpose(1, 2)
        .reshape(b, h, n_groups * lq, d)
        .gather(2, flat[..., None].expand(b, h, tq * n_groups, d))
        .view(b, h, tq, n_groups, d)
    )
    lse_a = (
        lseg.transpose(1, 2)
        .reshape(b, h, n_groups * lq)
        .gather(2, flat.expand(b, h, tq * n_groups))
        .view(b, h, tq, n_groups)
    )
    lse_a = lse_a.masked_fill(~q_member[:, None], float("-inf"))

    # ---- set B: inside the window, no shared group ----
    w = min(window, tk)
    offsets = torch.arange(w, device=q.device)
    kidx = q_pos[:, None] - offsets[None, :]  # [Tq, w]: positions i, i-1, ..., i-w+1
    in_range = kidx >= 0
    kidx = kidx.clamp(min=0)
    k_win, v_win = k[:, :, kidx], v[:, :, kidx]  # [B, H, Tq, w, D]
    cross = (bits_q[:, :, None] & bits_k[:, kidx]) == 0  # [B, Tq, w]
    o_b, lse_b = attend_lse(q[:, :, :, None], k_win, v_win, (in_range & cross)[:, None, :, None, :], scale)
    o_b, lse_b = o_b.squeeze(3), lse_b.squeeze(3)

    # ---- exact merge ----
    lse_all = torch.cat([lse_a, lse_b[..., None]], dim=-1)  # [B, H, Tq, K + 1]
    weight = torch.softmax(lse_all, dim=-1)
    out = (weight[..., :n_groups, None] * o_a).sum(-2) + weight[..., n_groups:] * o_b
    return out.to(q.dtype)
