"""Dynamic Group Attention's FlexAttention path (CUDA, no cache; docs/dga.md, "Paths").

One FlexAttention call over ``[compressed entries; raw keys]`` with appendix D's mask as a ``mask_mod``: plain
functions of tensors and plain values (the compression is the module's, shared by every path), so nothing here
reads a module. The causal form over a whole sequence from position 0 builds its block mask from block arithmetic
(``causal_flex_blocks``), never a Tq x Tk mask.
"""

from __future__ import annotations

import torch
from torch import Tensor

from model.attention.common.flex import flex_attention_fn

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
) -> Tensor:
    """One FlexAttention call over [compressed entries; raw keys] with appendix D's mask as a mask_mod.

    q, k, v [B, H, *, D] (k, v at the query head count); focal_pos, members: the compression's focal positions and
    groups (``Compressed``); ck, cv [B, H, N, D] the compressed entries, avail [B, H, N] the position from which each
    is visible; ``entries_per_chunk``: E of the causal form."""
    from torch.nn.attention.flex_attention import create_block_mask

    b, h, tq, _ = q.shape
    n, tk = ck.shape[2], k.shape[2]
    q_pos = q_pos.to(q.device)
    c = chunk_size
    if selection == "causal" and tq == tk:
        return causal_attention(q, k, v, ck, cv, q_pos, chunk_size=c, entries_per_chunk=entries_per_chunk, scale=scale)
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


def causal_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    ck: Tensor,
    cv: Tensor,
    q_pos: Tensor,
    *,
    chunk_size: int,
    entries_per_chunk: int,
    scale: float,
) -> Tensor:
    """Causal form, a whole sequence from position 0: FlexAttention over [entries, padded to a whole block; raw
    keys] with a mask_mod from chunk arithmetic and a block mask from block arithmetic (``causal_flex_blocks``),
    so nothing of size Tq x Tk is ever built (``create_block_mask`` evaluates the mask_mod on every pair)."""
    from torch.nn.attention.flex_attention import BlockMask

    b, h, t, d = q.shape
    n, c, e = ck.shape[2], chunk_size, entries_per_chunk
    n_pad = -(-n // FLEX_BLOCK) * FLEX_BLOCK
    pad = q.new_zeros(b, h, n_pad - n, d)
    keys, values = torch.cat([ck, pad, k], dim=2), torch.cat([cv, pad, v], dim=2)

    def mask_mod(bi: Tensor, hi: Tensor, qi: Tensor, kv: Tensor) -> Tensor:
        qp = q_pos[qi]
        comp_ok = (kv < n) & ((kv // e + 2) * c <= qp)
        r = kv - n_pad
        raw_ok = (r >= 0) & (r <= qp) & (r // c >= qp // c - 1)
        return torch.where(kv < n_pad, comp_ok, raw_ok)

    listed, full = causal_flex_blocks(t, n, n_pad, c, e, q.device)
    partial = listed & ~full

    def lists(flag: Tensor) -> tuple[Tensor, Tensor]:
        order = torch.argsort((~flag).to(torch.int8), dim=-1, stable=True)  # listed blocks first, in order
        return flag.sum(-1).int()[None, None], order.int()[None, None]

    block_mask = BlockMask.from_kv_blocks(
        *lists(partial), *lists(full), BLOCK_SIZE=FLEX_BLOCK, mask_mod=mask_mod, seq_lengths=(t, n_pad + t)
    )
    return flex_attention_fn(q.is_cuda, "dga")(q, keys, values, block_mask=block_mask, scale=scale)


def causal_flex_blocks(
    t: int, n: int, n_pad: int, c: int, e: int, device: torch.device, block: int = FLEX_BLOCK
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
