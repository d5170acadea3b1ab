"""``prefix_causal_attention`` (the CPU kernel of context-parallel chunks) under CPU bf16 autocast: rotated q and k
arrive in float32 while v is bf16 (RoPE multiplies by float32 tables); it casts them as autocast casts SDPA's inputs,
so a ``train.precision = "bf16"`` run under ``cp > 1`` works on the CPU (llama-7b-128k.toml's launch-config test)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from model.attention.common.sdpa import prefix_causal_attention


def test_mixed_dtypes_under_autocast_match_sdpa():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 8, 4, generator=g, requires_grad=True)
    k = torch.randn(1, 2, 16, 4, generator=g, requires_grad=True)
    v = torch.randn(1, 2, 16, 4, generator=g).bfloat16()
    mask = torch.arange(16)[None, :] <= torch.arange(8, 16)[:, None]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = prefix_causal_attention(q, k, v, scale=0.5)
        expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.5)
    assert out.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected, atol=1e-2, rtol=1e-2)
    out.float().sum().backward()
    assert q.grad is not None and k.grad is not None and q.grad.dtype == k.grad.dtype == torch.float32
