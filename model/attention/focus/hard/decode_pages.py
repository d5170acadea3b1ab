"""Focus hard mode, decode on the device: the KV cache paged by group, and the step's attention over the token's
groups' pages plus the window, as partial softmax statistics merged by log-sum-exp.

A decoding token at position p with membership word ``bits_q`` attends key j <= p iff p - j < window (the window)
or ``bits_k[j] & bits_q != 0`` (a shared group; ``naive.hard_mask``). Those keys are the window ``(p - w, p]`` and,
for each of the token's top_k groups c, the group's members at positions <= p - w ("far" members), a key also in a
lower group of the token read there only. So a step needs, per (sequence, group), the group's member positions in
order and how many of them are far: ``GroupPages``, static device buffers of the cache's shape.

- ``index`` [B, K, max_len + 1]: the members' positions in the main KV cache, in position order (the last column
  takes the build's writes of non-members). Read in pages of ``PAGE`` slots: a page is the unit a kernel loads, so
  a step reads at most one page per group beyond its far members. The capacity of a group is the worst case (every
  token in it), so no token is ever refused and nothing is reallocated; the table costs K int64 per cached token.
- ``count`` [B, K]: members so far; ``far`` [B, K]: of them, those at positions <= p - w (a prefix of the list).
- appending the token (``append``) writes its position into its top_k groups' next slots (a scatter at device
  offsets ``count``) and moves the token at p - w, now past the window, into ``far`` of its groups: O(top_k + K)
  device operations, no host read.

The attention (``torch_partials`` here, ``decode_triton.py`` on CUDA and under Triton's interpreter) computes one
(output, log-sum-exp) pair per part (each of the token's groups, the window), and ``merge`` combines them exactly.
This torch form gathers every slot of the token's groups (a static shape; masked past ``far``): the CPU stand-in and
the reference; the Triton kernel loops only over the pages below ``far`` (device-side bounds), reading
``sum(far[selected]) + window`` rows, plus at most one partial page per group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

PAGE = 16  # slots per page: the kernel's key tile (tl.dot's minimum); a tail page is read masked


@dataclass
class GroupPages:
    """The per-(sequence, group) member tables of one cache (see the module docstring). ``length``: the tokens they
    cover (host bookkeeping of the module: a table built from ``focus_bits`` once after a prefill, then appended to
    by every device step)."""

    index: Tensor  # [B, K, max_len + 1] int64
    count: Tensor  # [B, K] int64
    far: Tensor  # [B, K] int64
    length: int

    @property
    def capacity(self) -> int:
        return self.index.shape[2] - 1


def build_pages(bits_all: Tensor, lengths: Tensor, n_groups: int, window: int) -> GroupPages:
    """The tables of tokens [0, lengths[b]) of each sequence from their membership words bits_all [B, L] (static
    shapes, no host read: a cumulative count per group gives each member its slot). ``far`` counts members at
    positions <= lengths - 1 - window: the state before decoding the token at ``lengths``."""
    b, length = bits_all.shape
    pos = torch.arange(length, device=bits_all.device)
    groups = torch.arange(n_groups, device=bits_all.device)
    n = lengths.reshape(-1, 1).expand(b, 1)  # [B, 1]
    member = (((bits_all[:, None, :] >> groups[None, :, None]) & 1) != 0) & (pos < n)[:, None, :]  # [B, K, L]
    slot = torch.where(member, member.cumsum(-1) - 1, length)  # non-members into the spare last column
    index = torch.zeros(b, n_groups, length + 1, dtype=torch.long, device=bits_all.device)
    index.scatter_(2, slot, pos.expand(b, n_groups, length).contiguous())
    index[:, :, length] = 0  # the spare column: whatever landed there, a valid position
    count = member.sum(-1)
    far = (member & (pos <= n - 1 - window)[:, None, :]).sum(-1)
    return GroupPages(index, count, far, 0)


def token_groups(g: Tensor, top_k: int) -> Tensor:
    """The token's top_k groups [B, top_k] from its assignment g [B, 1, K]: the groups of ``membership_bits`` (ties
    to the lower index; the same operations), so ``bits_q`` is the sum of their bits."""
    if top_k == 1:
        return g.argmax(-1)
    return torch.sort(g, dim=-1, descending=True, stable=True).indices[:, 0, :top_k]


def append(pages: GroupPages, groups: Tensor, p: Tensor, bits_all: Tensor, window: int) -> None:
    """Append the token at positions p [B, 1] (its word already in bits_all [B, L]) to its groups [B, top_k], then
    move the token at p - window into ``far`` of its groups. In place, static shapes."""
    b, n_groups = pages.count.shape
    width = pages.index.shape[2]
    slot = pages.count.gather(1, groups)  # [B, top_k]: each group's next free slot
    pages.index.view(b, -1).scatter_(1, groups * width + slot, p.expand_as(slot))
    pages.count.scatter_add_(1, groups, torch.ones_like(groups))
    leaving = p - window  # [B, 1]: the position that leaves the window now (none while < 0)
    word = bits_all.gather(1, leaving.clamp(min=0))
    shifts = torch.arange(n_groups, device=word.device)
    pages.far.add_(((word >> shifts) & 1) * (leaving >= 0))


def _partial(q: Tensor, k: Tensor, v: Tensor, valid: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """Softmax attention statistics of q [..., G, D] over k, v [..., N, D] where valid [..., 1, N]: (output
    [..., G, D], log-sum-exp [..., G]); an empty part gives output 0 and log-sum-exp -inf (weight 0 in ``merge``)."""
    s = torch.where(valid, (q @ k.transpose(-1, -2)) * scale, float("-inf"))
    top = s.amax(-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    e = torch.exp(s - top)
    den = e.sum(-1, keepdim=True)
    out = (e @ v) / torch.where(den > 0, den, torch.ones_like(den))
    return out, (top + torch.log(den)).squeeze(-1)


def torch_partials(
    q: Tensor, k_all: Tensor, v_all: Tensor, bits_all: Tensor, pages: GroupPages, groups: Tensor, bits_q: Tensor,
    p: Tensor, *, window: int, scale: float,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """The parts' statistics in torch, static shapes: (outputs [B, Hq, top_k + 1, D], log-sum-exps [B, Hq, top_k + 1])
    for the token's groups then the window (none when window is 0), in the accumulator dtype (float32, float64 for
    float64). q [B, Hq, 1, D]; k_all, v_all [B, Hkv, L, D] the cache; p [B, 1] the token's positions."""
    b, hq, _, dim = q.shape
    hkv, top_k = k_all.shape[1], groups.shape[1]
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    qg = q.reshape(b, hkv, hq // hkv, dim).to(acc)  # GQA: the query heads of a key head as rows
    cap = pages.capacity
    slots = torch.arange(cap, device=q.device)
    rows = pages.index[:, :, :cap].gather(1, groups[:, :, None].expand(b, top_k, cap))  # [B, top_k, cap]
    lower = bits_q & ((1 << groups) - 1)  # [B, top_k]: the token's groups below each (their keys are taken there)
    key_bits = bits_all.gather(1, rows.reshape(b, -1)).view(b, top_k, cap)
    valid = (slots < pages.far.gather(1, groups)[:, :, None]) & ((key_bits & lower[:, :, None]) == 0)
    flat = rows.reshape(b, 1, top_k * cap, 1).expand(b, hkv, top_k * cap, dim)
    kg = k_all.gather(2, flat).view(b, hkv, top_k, cap, dim).to(acc)
    vg = v_all.gather(2, flat).view(b, hkv, top_k, cap, dim).to(acc)
    outs, lses = _partial(qg[:, :, None], kg, vg, valid[:, None, :, None, :], scale)  # [B, Hkv, top_k, G, ...]
    outs, lses = outs.transpose(2, 3), lses.transpose(2, 3)  # [B, Hkv, G, top_k, ...]
    if window > 0:
        near = p - window + 1 + torch.arange(window, device=q.device)  # [B, w]: positions (p - w, p]
        idx = near.clamp(min=0)[:, None, :, None].expand(b, hkv, window, dim)
        kw, vw = k_all.gather(2, idx).to(acc), v_all.gather(2, idx).to(acc)
        out_w, lse_w = _partial(qg, kw, vw, (near >= 0)[:, None, None, :], scale)  # [B, Hkv, G, ...]
        outs = torch.cat([outs, out_w[:, :, :, None]], 3)
        lses = torch.cat([lses, lse_w[:, :, :, None]], 3)
    return outs.reshape(b, hq, -1, dim), lses.reshape(b, hq, -1)


def merge(outs: Tensor, lses: Tensor) -> Tensor:
    """Parts' outputs [B, Hq, S, D] and log-sum-exps [B, Hq, S] over disjoint key sets -> the output over their union
    [B, Hq, 1, D] (at least one part non-empty: the window holds the token itself, or its group does)."""
    weights = torch.softmax(lses, dim=-1)  # exp(lse_s - lse_total)
    return (weights[..., None] * outs).sum(-2, keepdim=True)
