"""Dense T x T building blocks shared by every variant's reference path."""

from __future__ import annotations

import torch
from torch import Tensor


def causal_mask(q_pos: Tensor, k_pos: Tensor) -> Tensor:
    """[Tq, Tk] boolean, True where query i may attend key j (k_pos[j] <= q_pos[i])."""
    return k_pos[None, :] <= q_pos[:, None]


def expand_kv(x: Tensor, n_heads: int) -> Tensor:
    """Repeat grouped KV heads ([B, Hkv, T, D]) to the query head count."""
    rep = n_heads // x.shape[1]
    return x if rep == 1 else x.repeat_interleave(rep, dim=1)


def scores(q: Tensor, k: Tensor, scale: float | Tensor) -> Tensor:
    """q k^T * scale in at least float32 (float64 stays float64). [B, H, Tq, Tk]."""
    dtype = torch.promote_types(q.dtype, torch.float32)
    return torch.matmul(q.to(dtype), expand_kv(k, q.shape[1]).to(dtype).transpose(-1, -2)) * scale


def masked_softmax(s: Tensor, mask: Tensor) -> Tensor:
    """Softmax over keys with disallowed entries at exactly zero; a row with no key gives zeros."""
    s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, dim=-1)
    return torch.nan_to_num(p, nan=0.0)


def weighted_values(p: Tensor, v: Tensor, out_dtype: torch.dtype) -> Tensor:
    return torch.matmul(p, expand_kv(v, p.shape[1]).to(p.dtype)).to(out_dtype)


def sink_and_density(a: Tensor, k_pos: Tensor) -> dict[str, Tensor]:
    """Appendix C.3 of the Lazy paper: mean weight on the first token (sink ratio) and on all the
    others (density), over queries, heads and batch. ``a``: [B, H, Tq, Tk] attention weights."""
    first = (k_pos == 0).to(a.dtype)
    sink = (a * first).sum(-1)
    return {"sink_ratio": sink.mean().detach(), "density": (a.sum(-1) - sink).mean().detach()}


def take_rows(x: Tensor, idx: Tensor) -> Tensor:
    """Rows of ``x`` [B, H, T, D] at per-(batch, head) positions ``idx`` [B, H, *S] -> [B, H, *S, D]."""
    b, h = idx.shape[:2]
    flat = idx.reshape(b, h, -1)
    return x.gather(2, flat[..., None].expand(-1, -1, -1, x.shape[-1])).reshape(*idx.shape, x.shape[-1])
