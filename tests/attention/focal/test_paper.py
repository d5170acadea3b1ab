"""Paper pins for ``focal`` (papers/focal-attention-temperature.txt, section 2; SPEC 3.4).

- Constant temperature (eq. 5): logits ``q . k / (t sqrt(d))``, t = 0.4 by default; in closed form
  SDPA with ``scale = 1 / (t sqrt(d))``.
- Learned temperature (eq. 6): ``tau = clip(offset + x . w_tau, tau_min, tau_max)`` is the whole
  divisor of the logits, with offset = clip(sqrt(d)) so that w_tau = 0 is standard attention. Scopes:
  ``query`` (z_i = x_i . w_tau), ``prefix_mean`` (the mean of z over tokens <= i) and the paper's
  ``sequence_mean`` (the mean over every token of the sequence).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from model.attention import LayerSpec, build_attention
from model.attention.focal import FocalConfig
from tests.attention.pins import (
    F64,
    IMPLS,
    assert_matches,
    causal,
    expected,
    qkv,
    randn,
    repeat_kv,
    run_module,
    softmax_attention,
)

D = 16
SPEC = LayerSpec(d_model=24, n_heads=4, n_kv_heads=2, head_dim=D, max_seq_len=32, layer_idx=0, n_layers=1)
T = 13


def _logits(q, k):
    return q @ repeat_kv(k, q.shape[1]).transpose(-1, -2)


@pytest.mark.parametrize("t", [0.4, 0.25, 1.0])
@pytest.mark.parametrize("impl", IMPLS)
def test_constant_temperature_divides_the_logits_eq5(t, impl):
    """Eq. 5: softmax(q . k / (t sqrt(d))); the default t = 0.4 is the paper's."""
    q, k, v = qkv(2, 4, 2, T, D, seed=2)

    def formula(q, k, v):
        return softmax_attention(_logits(q, k) / (t * math.sqrt(D)), repeat_kv(v, 4), causal(T))

    module = build_attention("focal", FocalConfig(t=t), SPEC).double()
    assert_matches(run_module(module, q, k, v, impl=impl), expected(formula, q, k, v), f"focal t={t}/{impl}")


@pytest.mark.parametrize("impl", IMPLS)
def test_constant_temperature_is_sdpa_with_scale_one_over_t_sqrt_d(impl):
    """Closed form of eq. 5 (the default config): SDPA with ``scale = 1 / (0.4 sqrt(d))``, and not SDPA's
    default scale."""
    q, k, v = qkv(1, 4, 2, T, D, seed=3)
    module = build_attention("focal", FocalConfig(), SPEC, impl=impl).double()
    out = module(q, k, v, hidden=torch.zeros(1, T, 24, dtype=q.dtype), positions=torch.arange(T)).output
    sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1 / (0.4 * math.sqrt(D)), enable_gqa=True)
    torch.testing.assert_close(out, sdpa, **F64)
    plain = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert (out - plain).abs().max() > 1e-2


def _tau(z, scope):
    """The per-query divisor before the clip, from z_i = x_i . w_tau [B, T], for each scope (eq. 6)."""
    if scope == "query":
        return z
    if scope == "prefix_mean":
        return z.cumsum(1) / torch.arange(1, z.shape[1] + 1, dtype=z.dtype)
    return z.mean(1, keepdim=True).expand_as(z)


@pytest.mark.parametrize("scope", ["query", "prefix_mean", "sequence_mean"])
@pytest.mark.parametrize("impl", IMPLS)
def test_learned_temperature_is_the_whole_divisor_eq6(scope, impl):
    """Eq. 6: tau_i = clip(offset + reduce(x . w_tau), tau_min, tau_max) with offset = clip(sqrt(d)) = 4;
    logits q . k / tau_i (tau replaces sqrt(d), it does not multiply it). A clip range [2.5, 6] around the
    offset, with z of a few units, clips some queries and not others; w_tau's gradient flows only through
    the unclipped ones."""
    tau_min, tau_max = 2.5, 6.0
    cfg = FocalConfig(mode="learned", scope=scope, tau_min=tau_min, tau_max=tau_max)
    module = build_attention("focal", cfg, SPEC).double()
    w_tau = randn(24, seed=4, scale=0.6)
    with torch.no_grad():
        module.w_tau.copy_(w_tau)
    x = randn(2, T, 24, seed=5)
    q, k, v = qkv(2, 4, 2, T, D, seed=6, scale=2.0)
    offset = min(max(math.sqrt(D), tau_min), tau_max)

    def formula(q, k, v, w):
        tau = torch.clamp(offset + _tau(x @ w, scope), tau_min, tau_max)  # [B, T]
        return softmax_attention(_logits(q, k) / tau[:, None, :, None], repeat_kv(v, 4), causal(T))

    tau = torch.clamp(offset + _tau(x @ w_tau, scope), tau_min, tau_max)
    if scope != "sequence_mean":  # a single mean may land anywhere; per-query divisors must span the clip
        clipped = (tau == tau_min) | (tau == tau_max)
        assert bool(clipped.any()) and not bool(clipped.all())
    got = run_module(module, q, k, v, impl=impl, hidden=x, params=("w_tau",))
    assert_matches(got, expected(formula, q, k, v, [w_tau]), f"focal learned {scope}/{impl}")


@pytest.mark.parametrize("impl", IMPLS)
def test_learned_temperature_starts_as_standard_attention(impl):
    """Section 2: w_tau starts at zero, so with the paper's clip [5, 10] and d = 16 the divisor is
    clip(sqrt(16)) = 5, i.e. logits q . k / 5 (not / 4)."""
    module = build_attention("focal", FocalConfig(mode="learned"), SPEC).double()
    q, k, v = qkv(1, 4, 2, T, D, seed=7)

    def formula(q, k, v):
        return softmax_attention(_logits(q, k) / 5.0, repeat_kv(v, 4), causal(T))

    got = run_module(module, q, k, v, impl=impl, hidden=randn(1, T, 24, seed=8))
    assert_matches(got, expected(formula, q, k, v), f"focal learned init/{impl}")
