"""Paper pin for ``full``: causal softmax attention (SPEC 3.1; Vaswani et al. eq. 1,
``softmax(Q K^T / sqrt(d_k)) V``), with grouped KV heads, on the dense reference and the SDPA path."""

from __future__ import annotations

import math

import pytest

from model.attention import LayerSpec, build_attention
from model.attention.full import FullConfig
from tests.attention.pins import IMPLS, assert_matches, causal, expected, qkv, repeat_kv, run_module, softmax_attention

SPEC = LayerSpec(d_model=32, n_heads=4, n_kv_heads=2, head_dim=8, max_seq_len=32, layer_idx=0, n_layers=1)


@pytest.mark.parametrize("impl", IMPLS)
def test_full_is_scaled_dot_product_softmax_eq1(impl):
    """Eq. 1: out_i = sum_{j <= i} softmax_j(q_i . k_j / sqrt(d)) v_j; KV head h // 2 serves query head h."""
    q, k, v = qkv(2, 4, 2, 11, 8, seed=1, scale=2.0)

    def formula(q, k, v):
        logits = q @ repeat_kv(k, 4).transpose(-1, -2) / math.sqrt(8)
        return softmax_attention(logits, repeat_kv(v, 4), causal(11))

    module = build_attention("full", FullConfig(), SPEC).double()
    assert_matches(run_module(module, q, k, v, impl=impl), expected(formula, q, k, v), f"full/{impl}")
