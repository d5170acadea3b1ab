"""Dynamic Group Attention's FlexAttention path (CUDA, no cache; docs/dga.md, "Paths").

One FlexAttention call over ``[compressed entries; raw keys]`` with appendix D's mask as a ``mask_mod``: plain
functions of tensors and plain values (the compression is the module's, shared by every path), so nothing here
reads a module. The causal form over a whole sequence from position 0 (training) builds its two block masks from
block arithmetic (``causal_masks``), never a Tq x Tk mask, once per step (the module's ``prepare_step``), and runs
one call over the raw keys and one over the entries, merged by logsumexp (no copy of K and V).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from model.attention.common.flex import flex_attention_fn

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

FLEX_BLOCK = 128  # FlexAttention's block size for the causal form's block mask


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    focal_pos: Tensor,
    members: Tensor,
    ck: Tensor,
    cv: Tensor,
    avail: Tensor,
    q_pos: Tensor,
    *,
    selection: str,
    chunk_size: int,
    entries_per_chunk: int,
    scale: float,
    masks: CausalMasks | None = None,
) -> Tensor:
    """One FlexAttention call over [compressed entries; raw keys] with appendix D's mask as a mask_mod.

    q, k, v [B, H, *, D] (k, v at the query head count); focal_pos, members: the compression's focal positions and
    groups (``Compressed``); ck, cv [B, H, N, D] the compressed entries, avail [B, H, N] the position from which each
    is visible; ``entries_per_chunk``: E of the causal form. The causal form over a whole sequence from position 0
    takes ``causal_attention`` with ``masks`` (built here when not given)."""
    from torch.nn.attention.flex_attention import create_block_mask

    b, h, tq, _ = q.shape
    n, tk = ck.shape[2], k.shape[2]
    q_pos = q_pos.to(q.device)
    c = chunk_size
    if selection == "causal" and tq == tk:
        if masks is None:
            masks = causal_masks(tq, n, c, entries_per_chunk, q.device)
        return causal_attention(q, k, v, ck, cv, masks, scale)
    keys, values = torch.cat([ck, k], dim=2), torch.cat([cv, v], dim=2)
    if selection == "causal":

        def raw_visible(bi: Tensor, hi: Tensor, qp: Tensor, t: Tensor) -> Tensor:
            return (t <= qp) & (t // c >= qp // c - 1)
    else:
        group_last = torch.full((b, h, tk), tk, dtype=torch.long, device=q.device)  # focal: never "unfinished"
        group_last.scatter_(-1, members.reshape(b, h, -1), members[..., -1:].expand_as(members).reshape(b, h, -1))
        focal = torch.zeros(b, h, tk, dtype=torch.bool, device=q.device).scatter_(-1, focal_pos.reshape(b, h, -1), True)

        def raw_visible(bi: Tensor, hi: Tensor, qp: Tensor, t: Tensor) -> Tensor:
            return (t <= qp) & ~focal[bi, hi, t] & (group_last[bi, hi, t] > qp)

    if n == 0:  # nothing compressed yet: every visible key is raw

        def mask_mod(bi: Tensor, hi: Tensor, qi: Tensor, kv: Tensor) -> Tensor:
            return raw_visible(bi, hi, q_pos[qi], kv)
    else:

        def mask_mod(bi: Tensor, hi: Tensor, qi: Tensor, kv: Tensor) -> Tensor:
            qp = q_pos[qi]
            comp_ok = avail[bi, hi, kv.clamp(max=n - 1)] <= qp
            return torch.where(kv < n, comp_ok, raw_visible(bi, hi, qp, (kv - n).clamp(min=0)))

    block_mask = create_block_mask(mask_mod, b, h, tq, n + tk, device=q.device)
    return flex_attention_fn(q.is_cuda, "dga")(q, keys, values, block_mask=block_mask, scale=scale)


@dataclass(frozen=True)
class CausalMasks:
    """The causal form's two block masks over a whole sequence of ``t`` tokens from position 0 (``causal_masks``):
    ``entries`` for the queries against the ``n`` compressed entries (None when ``n == 0``), ``raw`` against the raw
    keys (each query's own chunk up to itself and the previous chunk). Both depend only on (t, C, E): built once per
    step and shape (``DynamicGroupAttention.prepare_step``) and shared by every layer."""

    entries: BlockMask | None
    raw: BlockMask


def causal_masks(t: int, n: int, c: int, e: int, device: torch.device | str) -> CausalMasks:
    """Block masks of the causal form from block arithmetic (``causal_flex_blocks``), never a Tq x Tk mask; the
    mask_mods are pure chunk arithmetic (query row p holds position p)."""
    from torch.nn.attention.flex_attention import BlockMask

    n_pad = -(-n // FLEX_BLOCK) * FLEX_BLOCK
    nb = n_pad // FLEX_BLOCK  # entry blocks; the raw key blocks follow them in ``causal_flex_blocks``' columns
    listed, full = causal_flex_blocks(t, n, n_pad, c, e, torch.device(device))
    partial = listed & ~full
    col = torch.arange(listed.shape[-1], device=listed.device)
    entry_col = col < nb

    def lists(flag: Tensor, first: int) -> tuple[Tensor, Tensor]:
        """Per query block: how many key blocks are flagged, and their indices (counted from column ``first``) in
        order, then the others' (never read). Every tensor keeps the full [nq, nk] width: a slice at the entry
        count has strides that specialise a traced length (a recompile at one entry block)."""
        count = flag.sum(-1, keepdim=True)
        slot = torch.where(flag, flag.cumsum(-1), count + (~flag).cumsum(-1)) - 1  # counting sort: flagged first
        order = torch.empty_like(slot).scatter_(-1, slot, col.expand_as(slot))
        return count[..., 0].int()[None, None], (order - first).clamp(min=0).int()[None, None]

    def entry_visible(bi: Tensor, hi: Tensor, qi: Tensor, kv: Tensor) -> Tensor:
        return (kv < n) & ((kv // e + 2) * c <= qi)  # entry kv (chunk kv // E) is visible from (kv // E + 2) C

    def raw_visible(bi: Tensor, hi: Tensor, qi: Tensor, kv: Tensor) -> Tensor:
        return (kv <= qi) & (kv // c >= qi // c - 1)

    entries = None
    if n:
        entries = BlockMask.from_kv_blocks(
            *lists(partial & entry_col, 0),
            *lists(full & entry_col, 0),
            BLOCK_SIZE=FLEX_BLOCK,
            mask_mod=entry_visible,
            seq_lengths=(t, n),
        )
    raw = BlockMask.from_kv_blocks(
        *lists(partial & ~entry_col, nb),
        *lists(full & ~entry_col, nb),
        BLOCK_SIZE=FLEX_BLOCK,
        mask_mod=raw_visible,
        seq_lengths=(t, t),
    )
    return CausalMasks(entries, raw)


def causal_attention(
    q: Tensor, k: Tensor, v: Tensor, ck: Tensor, cv: Tensor, masks: CausalMasks, scale: float
) -> Tensor:
    """Causal form, a whole sequence from position 0: one FlexAttention call over the raw keys (the window) and one
    over the compressed entries, merged exactly by their logsumexps. No ``[entries; K]`` key list is built, so K
    and V are never copied (concatenating them cost a copy of both per layer, forward and backward)."""
    from torch.nn.attention.flex_attention import AuxRequest

    lse_only = AuxRequest(lse=True)
    out, aux = flex_attention_fn(q.is_cuda, "dga_raw")(q, k, v, block_mask=masks.raw, scale=scale, return_aux=lse_only)
    if masks.entries is None:  # nothing compressed yet (t < 3 C)
        return out
    out_c, aux_c = flex_attention_fn(q.is_cuda, "dga_entries")(
        q, ck, cv, block_mask=masks.entries, scale=scale, return_aux=lse_only
    )
    return merge_by_lse(out, aux.lse, out_c, aux_c.lse)


def merge_by_lse(o1: Tensor, lse1: Tensor, o2: Tensor, lse2: Tensor) -> Tensor:
    """Softmax over the union of two disjoint key sets from each set's output and logsumexp [B, H, T] (a row
    that sees no key of a set has lse -inf and weight 0 there), in at least float32, back in ``o1``'s dtype.
    Differentiable: FlexAttention's backward takes the logsumexp's gradient."""
    dt = torch.promote_types(o1.dtype, torch.float32)
    lse = torch.logaddexp(lse1.to(dt), lse2.to(dt))
    w1, w2 = torch.exp(lse1.to(dt) - lse)[..., None], torch.exp(lse2.to(dt) - lse)[..., None]
    return (o1.to(dt) * w1 + o2.to(dt) * w2).to(o1.dtype)


def causal_flex_blocks(
    t: int,
    n: int,
    n_pad: int,
    c: int,
    e: int,
    device: torch.device,
    block: int = FLEX_BLOCK,
) -> tuple[Tensor, Tensor]:
    """Causal form over [entries (n, padded to n_pad, a multiple of ``block``); t raw keys], queries at 0..t-1:
    per (query block, key block) whether any pair may be visible (listed) and whether every pair is (full), from
    block arithmetic. Entry i (chunk i // e) is visible from position (i // e + 2) c on; raw key r to query p iff
    r <= p and r // c >= p // c - 1. Conservative: a listed block may hold no visible pair; a full one never
    holds an invisible pair. [nq, nk] each."""
    nq, nk = -(-t // block), -(-(n_pad + t) // block)
    a = torch.arange(nq, device=device) * block  # first query of each block
    last = torch.clamp(a + block, max=t) - 1
    x = torch.arange(nk, device=device) * block  # first key of each block
    y = torch.clamp(x + block, max=n_pad + t)  # one past its last
    compressed = (y <= n_pad)[None, :]
    ce = torch.clamp(y, max=n)  # real entries [x, ce)
    c_any = (x < ce)[None, :] & (((x // e + 2) * c)[None, :] <= last[:, None])
    c_full = (y <= n)[None, :] & ((((y - 1) // e + 2) * c)[None, :] <= a[:, None])
    rx, ry = x - n_pad, y - n_pad  # raw keys [rx, ry)
    r_any = (rx[None, :] <= last[:, None]) & ((ry - 1)[None, :] >= ((a // c - 1) * c)[:, None])
    r_full = (
        (ry - rx == block)[None, :]
        & ((ry - 1)[None, :] <= a[:, None])
        & (rx[None, :] >= ((last // c - 1) * c)[:, None])
    )
    listed = torch.where(compressed, c_any, r_any)
    return listed, listed & torch.where(compressed, c_full, r_full)
