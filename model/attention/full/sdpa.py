"""Full attention's fast path on every device: PyTorch SDPA, or flash-attn (CUDA, 16-bit) when chosen."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from model.attention.common import reference as ref
from model.attention.common.sdpa import prefix_causal_attention, prefix_causal_supported, sdpa_varying


def sdpa_causal(
    q: Tensor, k: Tensor, v: Tensor, *, q_pos: Tensor, k_pos: Tensor, scale: float, flash: bool = False
) -> Tensor:
    """Causal attention through flash-attn or SDPA, exact for training, prefill, chunked prefill and decode."""
    if flash:
        from flash_attn import flash_attn_func

        out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True, softmax_scale=scale)
        return out.transpose(1, 2)
    gqa = k.shape[1] != q.shape[1]
    tq, tk = q.shape[2], k.shape[2]
    if tq == tk:  # training / prefill from position 0: the built-in causal mask is exact
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    if tq == 1:  # decode: the one new query sees every cached key
        return sdpa_varying(q, k, v, scale=scale, enable_gqa=gqa)
    if prefix_causal_supported(q):  # the CPU: no Tq x Tk mask (context-parallel chunks, chunked prefill)
        return prefix_causal_attention(q, ref.expand_kv(k, q.shape[1]), ref.expand_kv(v, q.shape[1]), scale=scale)
    # chunked prefill onto a cache: SDPA's is_causal aligns top-left, so pass the mask
    return sdpa_varying(q, k, v, attn_mask=ref.causal_mask(q_pos, k_pos), scale=scale, enable_gqa=gqa)


def sdpa_masked(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, *, scale: float) -> Tensor:
    """SDPA under an explicit boolean mask (True: may attend), e.g. a document mask."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1])
