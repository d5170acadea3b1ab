"""Focus hard mode on the GPU: the group part and the band part as two FlexAttention calls, block masks built
from group counts and cached (see ``hard/cpu.py``'s docstring).
"""

from __future__ import annotations

import copy
from typing import NamedTuple

import torch
from torch import Tensor

from model.attention.common.flex import cached_block_mask, flex_attention_fn

# ---- GPU: two FlexAttention calls -----------------------------------------------------------------------------------
FLEX_BLOCK = 128


class GroupLayout(NamedTuple):
    """Slots sorted by (group, position), N = top_k * T of them for every sequence (every token is in exactly top_k
    groups): ``tok`` [B, N] each slot's token, ``grp`` [B, N] its group, ``starts`` [B, K] each group's first slot,
    ``dest`` [B, K, T] the slot of (group, token), N where the token is not in the group."""

    tok: Tensor
    grp: Tensor
    starts: Tensor
    dest: Tensor


def group_layout(bits: Tensor, n_groups: int, top_k: int) -> GroupLayout:
    """The slot layout by one counting sort over the K groups (no comparison sort, no ``nonzero``, whose size the
    host would read): the memberships laid out group-major [B, K, T], whose exclusive running count is each member's
    slot (the members of the earlier groups, then its rank in its own group: histogram, exclusive scan and rank in
    one scan), then a stable scatter of every member to its slot."""
    t = bits.shape[1]
    n = top_k * t
    member = (bits[:, None, :] >> torch.arange(n_groups, device=bits.device)[:, None]) & 1  # [B, K, T]
    before = torch.cumsum(member.flatten(1), 1).view_as(member) - member  # members before (group, position)
    dest = torch.where(member == 1, before, n)  # non-members to one slot past the end
    source = torch.arange(n_groups * t, device=bits.device).expand(bits.shape[0], -1)  # group * T + token
    slot = bits.new_empty(bits.shape[0], n + 1).scatter_(1, dest.flatten(1), source)[:, :n]
    return GroupLayout(slot % t, slot // t, before[:, :, 0], dest)


def _group_layout(bits: Tensor, n_groups: int, top_k: int) -> tuple[Tensor, Tensor]:
    """(token [B, N], group [B, N]) of the slots (``group_layout``)."""
    layout = group_layout(bits, n_groups, top_k)
    return layout.tok, layout.grp


def self_block_mask_tensors(
    layout: GroupLayout, *, full_ok: bool, block: int = FLEX_BLOCK
) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
    """``group_block_mask_tensors`` of a whole sequence against itself (the query slots are the key slots): slot j
    attends the slots [start of its group, j], packed causal segments. Query block qb's key blocks run from the block
    of its first slot's group start to qb itself (every block between holds an allowed pair); those before qb from
    the block after its last slot's group start on are full (one group there, causally complete), for k = 1. From
    the group starts of two slots per block: some 20 operations on [B, nb] and [B, nb, nb], in int32 (as FlexAttention
    takes them) from the first."""
    bsz, n = layout.grp.shape
    nb = (n + block - 1) // block
    qb = torch.arange(nb, device=layout.grp.device, dtype=torch.int32)
    first = qb * block
    ends = torch.stack([first, torch.clamp(first + (block - 1), max=n - 1)])  # the first and last slot of each block
    start = layout.starts.gather(1, layout.grp[:, ends.flatten()]).int().view(bsz, 2, nb)  # their groups' starts
    lo = start[:, 0] // block
    f_lo = torch.minimum((start[:, 1] + (block - 1)) // block, qb) if full_ok else qb.expand(bsz, nb)
    before = f_lo - lo  # partial blocks [lo, f_lo), then qb
    r = qb[None, None, :]
    partial_idx = torch.where(r < before[..., None], lo[..., None] + r, qb[None, :, None])[:, None]
    num = (before + 1)[:, None]
    if not full_ok:
        return num, partial_idx, None, None
    full_idx = torch.clamp(f_lo[..., None] + r, max=nb - 1)[:, None]
    return num, partial_idx, (qb - f_lo)[:, None], full_idx


def group_block_mask_tensors(
    group_q: Tensor,
    pos_q: Tensor,
    group_k: Tensor,
    pos_k: Tensor,
    *,
    n_groups: int,
    n_positions: int,
    full_ok: bool,
    block: int = FLEX_BLOCK,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Block structure of the group call from the group counts: (kv_num_blocks, kv_indices, full_kv_num_blocks,
    full_kv_indices), shapes [B, 1, nq] and [B, 1, nq, nk].

    Query slot (c, position p) attends key slots of group c with position <= p: the slot range
    [start_c, start_c + count of c's keys at positions <= p). A query block's key blocks are the span of its slots'
    ranges; a key block is full when the query block is all one group, the key block lies inside that group's range
    and precedes the query block's first position (and ``full_ok``: no lowest-shared-group masking). Positions are
    below ``n_positions``. Tensor work of O(B (N / block)^2) at most; no host synchronisation.
    """
    bsz, nq_slots = group_q.shape
    nk_slots = group_k.shape[1]
    dev = group_q.device
    counts_k = torch.zeros(bsz, n_groups, dtype=torch.long, device=dev).scatter_add_(
        1, group_k, torch.ones_like(group_k)
    )
    starts_k = torch.cumsum(counts_k, 1) - counts_k  # [B, K]
    # keys of group c at positions <= p: the number of c's key slots with pos <= p, by a searchsorted per group
    slot_start = starts_k.gather(1, group_q)  # [B, Nq]
    # key slot positions are ascending within a group: search p in the (group, position) order as one key g * P + p
    big = n_positions
    key_order = group_k * big + pos_k  # ascending along slots
    hi = torch.searchsorted(key_order, group_q * big + pos_q, right=True)  # [B, Nq]: one past the last allowed key
    nq = (nq_slots + block - 1) // block
    nk = (nk_slots + block - 1) // block
    pad = nq * block - nq_slots

    def per_block(x: Tensor, reduce: str) -> Tensor:
        # padded with copies of the last slot, which lies in the last block: neither reduction changes, and no fill
        # value is read from the lengths (F.pad's value is a constant: a length there recompiles per length)
        x = torch.cat([x, x[:, -1:].expand(bsz, pad)], 1).view(bsz, nq, block)
        return x.amin(-1) if reduce == "min" else x.amax(-1)

    lo_blk = per_block(slot_start, "min") // block  # [B, nq]
    hi_blk = (per_block(hi, "max") - 1).clamp(min=0) // block  # last key block touched
    n_blocks = (hi_blk - lo_blk + 1).clamp(min=0)
    # full blocks: a single-group query block, key blocks inside its group and before its first position
    g_first, g_last = per_block(group_q, "min"), per_block(group_q, "max")
    single = (g_first == g_last) & full_ok
    p_first = per_block(pos_q, "min")
    g = g_first.clamp(max=n_groups - 1)
    c_start, c_end = starts_k.gather(1, g), (starts_k + counts_k).gather(1, g)  # the group's key slot range
    # last key slot with position < p_first inside the group: keys of the group at positions <= p_first - 1
    full_end = torch.searchsorted(key_order, g * big + p_first - 1, right=True)  # [B, nq], exclusive slot bound
    f_lo = (c_start + block - 1) // block  # first key block wholly inside the group
    f_hi = torch.minimum(full_end, c_end) // block  # key blocks [f_lo, f_hi) wholly inside and causally complete
    n_full = torch.where(single, (f_hi - f_lo).clamp(min=0), torch.zeros_like(f_hi))
    f_lo = torch.where(n_full > 0, f_lo, hi_blk + 1)
    # partial blocks: [lo_blk, f_lo) then [f_lo + n_full, hi_blk]
    ar = torch.arange(nk, device=dev)
    first_run = (f_lo - lo_blk).clamp(min=0)
    n_partial = (n_blocks - n_full).clamp(min=0)
    r = ar[None, None, :]
    partial_idx = torch.where(
        r < first_run[..., None],
        lo_blk[..., None] + r,
        f_lo[..., None] + n_full[..., None] + (r - first_run[..., None]),
    )
    partial_idx = torch.where(r < n_partial[..., None], partial_idx, torch.zeros_like(partial_idx)).clamp(max=nk - 1)
    full_idx = torch.where(r < n_full[..., None], f_lo[..., None] + r, torch.zeros_like(partial_idx)).clamp(max=nk - 1)
    return (
        n_partial[:, None].int(),
        partial_idx[:, None].int(),
        n_full[:, None].int(),
        full_idx[:, None].int(),
    )


def band_block_mask_tensors(
    tq: int, tk: int, window: int, *, block: int = FLEX_BLOCK, device: torch.device | str | None = None
) -> tuple[Tensor, Tensor]:
    """Block structure of the band call: queries at positions [tk - tq, tk) against keys within ``window`` before
    them (all partial: the cross-group condition depends on the data). Depends on the shape only."""
    start = tk - tq
    nq, nk = (tq + block - 1) // block, (tk + block - 1) // block
    qb = torch.arange(nq, device=device)
    first_pos = start + qb * block
    last_pos = torch.clamp(start + (qb + 1) * block - 1, max=tk - 1)
    lo = torch.clamp(first_pos - window + 1, min=0) // block
    hi = last_pos // block
    n = hi - lo + 1
    r = torch.arange(nk, device=device)
    idx = torch.where(r[None, :] < n[:, None], lo[:, None] + r[None, :], torch.zeros_like(r)[None, :]).clamp(max=nk - 1)
    return n[None, None].int(), idx[None, None].int()


def whole_band_block_mask_tensors(
    t: int, window: int, *, device: torch.device, block: int = FLEX_BLOCK
) -> tuple[Tensor, Tensor]:
    """``band_block_mask_tensors(t, t, window)`` of a whole sequence, in seven int32 operations (what a compiled
    graph builds when no caller passed the structure in: the cache cannot serve it there). Query
    block qb reads key blocks qb - ceil((window - 1) / block) (at least 0) to qb; entries past the count repeat qb
    (FlexAttention reads only the first ``count``)."""
    qb = torch.arange((t + block - 1) // block, device=device, dtype=torch.int32)
    lo = torch.clamp(qb - (window - 2 + block) // block, min=0)
    idx = torch.minimum(lo[:, None] + qb[None, :], qb[:, None])
    return (qb - lo + 1)[None, None], idx[None, None]


def flex_hard_attention(
    q: Tensor, k: Tensor, v: Tensor, *, bits_q: Tensor, bits_k: Tensor, window: int, scale: float, n_groups: int,
    top_k: int, compiled: bool, band: tuple[Tensor, Tensor] | None = None,
) -> Tensor:  # fmt: skip
    """Exact hard-mode attention as two FlexAttention calls (group-sorted same-group part, cross-group band), merged
    by logsumexp. Compiled on CUDA; eager (a dense math fallback that ignores block sparsity) in CPU tests.

    ``band``: the band's shape-only block structure (``band_block_mask_tensors``) from the caller, built outside a
    compiled graph (``module.run_hard_inference``); None = cached per shape here where nothing traces, and built in
    seven small operations inside a compiled graph of a whole sequence (``whole_band_block_mask_tensors``). Without
    autograd only the key-side block lists are built (``compute_q_blocks=False``: the backward's query-side transposes
    are three sorts and some 45 operations that inference never reads)."""
    from torch.nn.attention.flex_attention import AuxRequest, BlockMask

    bsz, h, tq, d = q.shape
    tk = k.shape[2]
    start = tk - tq
    gqa = k.shape[1] != h
    backward = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    # ---- same group, lowest shared group, causal on original positions, over group-sorted slots ----
    whole = bits_q is bits_k and start == 0  # one sequence against itself: one layout, packed causal segments
    lay_q = group_layout(bits_q, n_groups, top_k)
    lay_k = lay_q if whole else group_layout(bits_k, n_groups, top_k)
    tok_q, grp_q, tok_k, grp_k = lay_q.tok, lay_q.grp, lay_k.tok, lay_k.grp
    pos_q, pos_k = (tok_q, tok_k) if whole else (tok_q + start, tok_k)
    sbits_q = bits_q.gather(1, tok_q)
    sbits_k = sbits_q if whole else bits_k.gather(1, tok_k)
    lower_q = (torch.ones_like(grp_q) << grp_q) - 1  # groups below the slot's group
    q_s = q.gather(2, tok_q[:, None, :, None].expand(bsz, h, -1, d))
    k_s = k.gather(2, tok_k[:, None, :, None].expand(bsz, k.shape[1], -1, d))
    v_s = v.gather(2, tok_k[:, None, :, None].expand(bsz, v.shape[1], -1, d))

    def same_group(b: Tensor, hh: Tensor, qi: Tensor, kv: Tensor) -> Tensor:
        if whole:  # slot order is position order inside a group
            keep = (grp_q[b, qi] == grp_k[b, kv]) & (kv <= qi)
        else:
            keep = (grp_q[b, qi] == grp_k[b, kv]) & (pos_k[b, kv] <= pos_q[b, qi])
        if top_k > 1:
            keep = keep & ((sbits_q[b, qi] & sbits_k[b, kv] & lower_q[b, qi]) == 0)
        return keep

    if whole:
        kvn, kvi, fkvn, fkvi = self_block_mask_tensors(lay_q, full_ok=top_k == 1)
    else:
        kvn, kvi, fkvn, fkvi = group_block_mask_tensors(
            grp_q, pos_q, grp_k, pos_k, n_groups=n_groups, n_positions=tk, full_ok=top_k == 1
        )
    group_mask = BlockMask.from_kv_blocks(
        kvn, kvi, fkvn, fkvi, BLOCK_SIZE=FLEX_BLOCK, mask_mod=same_group, seq_lengths=(tok_q.shape[1], tok_k.shape[1]),
        compute_q_blocks=backward,
    )  # fmt: skip
    # one block of slots: eager (a dense 128 x 128 problem at most); inductor (torch 2.11) finds no kernel config
    # for some of these shapes with top_k > 1 (74 slots failed, 37 and 600 compiled)
    one_block = tok_q.shape[1] <= FLEX_BLOCK and tok_k.shape[1] <= FLEX_BLOCK
    o_s, aux = flex_attention_fn(compiled and not one_block, "focus_group")(
        q_s, k_s, v_s, block_mask=group_mask, scale=scale, enable_gqa=gqa, return_aux=AuxRequest(lse=True)
    )
    del q_s, k_s, v_s  # the sorted copies: not kept past the call (autograd keeps what its backward needs)
    cdt = torch.promote_types(q.dtype, torch.float32)
    if top_k == 1:
        # each query has one slot: the slot order is a permutation of the tokens, undone by a gather with its inverse
        # (the counting sort's destination of each token's one group: the other groups hold N, past every slot)
        inv = lay_q.dest.amin(1)
        o_a = o_s.gather(2, inv[:, None, :, None].expand(bsz, h, tq, d))
        lse_a = aux.lse.gather(2, inv[:, None, :].expand(bsz, h, tq)).to(cdt)
    else:
        o_a, lse_a = _merge_slots(o_s, aux.lse, lay_q.dest, top_k, cdt)
    del o_s, aux

    # ---- cross-group band: causal, i - j < window, no shared group, original order ----
    def band_mod(b: Tensor, hh: Tensor, qi: Tensor, kv: Tensor) -> Tensor:
        dist = qi - kv if start == 0 else qi + start - kv
        return (dist >= 0) & (dist < window) & ((bits_q[b, qi] & bits_k[b, kv]) == 0)

    if band is None and whole and torch.compiler.is_compiling():
        band = whole_band_block_mask_tensors(tk, window, device=q.device)
    if band is not None:
        band_mask = BlockMask.from_kv_blocks(
            *band, BLOCK_SIZE=FLEX_BLOCK, mask_mod=band_mod, seq_lengths=(tq, tk), compute_q_blocks=backward
        )
    else:
        structure = cached_block_mask(
            ("focus_band", tq, tk, window, str(q.device)),
            lambda: BlockMask.from_kv_blocks(
                *band_block_mask_tensors(tq, tk, window, device=q.device),
                BLOCK_SIZE=FLEX_BLOCK,
                seq_lengths=(tq, tk),
            ),
        )
        band_mask = copy.copy(structure)
        band_mask.mask_mod = band_mod  # the cached structure, this layer's memberships
    o_b, aux = flex_attention_fn(compiled, "focus_band")(
        q, k, v, block_mask=band_mask, scale=scale, enable_gqa=gqa, return_aux=AuxRequest(lse=True)
    )
    # the merge: weights exp(lse_a - lse) = sigmoid(lse_a - lse_b) and 1 - it (lse_a is finite: a query shares its
    # groups with itself; a query with no band key has lse_b = -inf, o_b = 0: weight 1 on its group part)
    o_b = o_b.to(cdt)
    out = o_b + (o_a.to(cdt) - o_b) * torch.sigmoid(lse_a - aux.lse.to(cdt))[..., None]
    return out.to(q.dtype)


def _merge_slots(o_s: Tensor, lse_s: Tensor, dest: Tensor, top_k: int, cdt: torch.dtype) -> tuple[Tensor, Tensor]:
    """top_k > 1: each token's top_k slots (outputs [B, H, N, D], logsumexps [B, H, N]) merged by logsumexp into
    [B, H, tq, D] (in ``cdt``) and [B, H, tq]. A token's slots are the top_k smallest of its counting-sort
    destinations ``dest`` [B, K, tq] (the other groups hold N): gathered, no scatter. Its first group's slot sees the
    token itself, so the merged logsumexp is finite (a later slot may see no key: lse -inf, weight 0)."""
    bsz, h, _, d = o_s.shape
    tq = dest.shape[2]
    idx = torch.topk(dest, top_k, dim=1, largest=False).values.transpose(1, 2).flatten(1)  # [B, tq * top_k]
    lse = lse_s.to(cdt).gather(2, idx[:, None].expand(bsz, h, -1)).view(bsz, h, tq, top_k)
    lse_a = torch.logsumexp(lse, -1)
    weight = torch.exp(lse - lse_a[..., None])
    o = o_s.gather(2, idx[:, None, :, None].expand(bsz, h, -1, d)).view(bsz, h, tq, top_k, d)
    return (o.to(cdt) * weight[..., None]).sum(-2), lse_a
