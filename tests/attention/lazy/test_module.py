from __future__ import annotations

import pytest
import torch

from core.errors import ConfigError
from model.attention import LayerSpec, build_attention
from model.attention.lazy import LazyConfig, alibi_slopes
from model.config import ModelConfig
from model.transformer import Transformer

SPEC = LayerSpec(d_model=32, n_heads=4, n_kv_heads=2, head_dim=8, max_seq_len=16, layer_idx=0, n_layers=1)


def inputs(t=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, t, 8, generator=g, dtype=torch.float64)
    k = torch.randn(2, 2, t, 8, generator=g, dtype=torch.float64)
    v = torch.randn(2, 2, t, 8, generator=g, dtype=torch.float64)
    return q, k, v, torch.zeros(2, t, 32, dtype=torch.float64)


def test_zero_bias_and_zero_tau_is_full_attention_with_the_same_rope():
    cfg = ModelConfig(vocab_size=50, max_seq_len=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2)
    cfg.rope.theta = 500000.0
    torch.manual_seed(0)
    full = Transformer(cfg).double().eval()
    cfg.attention.kind = "lazy"
    cfg.attention.options["lazy"].tau_init = 0.0
    lazy = Transformer(cfg).double().eval()
    missing, unexpected = lazy.load_state_dict(full.state_dict(), strict=False)
    assert unexpected == [] and all(m.endswith(("distance_bias", "tau")) for m in missing)
    idx = torch.randint(0, 50, (2, 20), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(lazy(idx).logits, full(idx).logits, atol=1e-12, rtol=0)


def test_elastic_softmax_rows_sum_to_at_most_one_and_are_sparse():
    module = build_attention("lazy", LazyConfig(), SPEC).double()
    module.collect_stats = True
    q, k, v, hidden = inputs()
    positions = torch.arange(12)
    a = module.weights(q * 3, k, positions, positions)
    assert (a >= 0).all() and (a.sum(-1) <= 1 + 1e-12).all() and (a == 0).double().mean() > 0.3
    assert a[..., 0, :].abs().sum() == 0, "the first query has one key, p = 1 = tau / n: nothing survives"
    assert (a.sum(-1) < 1 - 1e-3).any(), "rows no longer sum to 1"
    stats = module(q * 3, k, v, hidden=hidden, positions=positions).stats
    torch.testing.assert_close(stats["sink_ratio"], a[..., 0].mean())
    torch.testing.assert_close(stats["density"], a[..., 1:].sum(-1).mean())


def test_tau_gradient_matches_finite_differences():
    module = build_attention("lazy", LazyConfig(tau_init=0.3), SPEC).double()
    with torch.no_grad():
        module.distance_bias.normal_(0, 0.5)
    q, k, v, hidden = inputs(seed=2)
    weights = torch.randn(2, 4, 12, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(3))

    def f(tau):
        module.tau.data.copy_(tau)
        return (module(q * 2, k, v, hidden=hidden, positions=torch.arange(12)).output * weights).sum()

    tau0 = module.tau.detach().clone()
    module.tau.grad = None
    f(tau0).backward()
    analytic = module.tau.grad.clone()
    eps = 1e-6
    numeric = torch.stack(
        [(f(tau0 + eps * e) - f(tau0 - eps * e)) / (2 * eps) for e in torch.eye(4, dtype=torch.float64)]
    )
    torch.testing.assert_close(analytic, numeric.detach(), atol=1e-6, rtol=1e-5)
    assert analytic.abs().min() > 0


def test_bias_gradient_reaches_every_used_distance_and_clamps_past_the_table():
    spec = LayerSpec(32, 4, 2, 8, max_seq_len=16, layer_idx=0, n_layers=1)
    module = build_attention("lazy", LazyConfig(max_distance=5, tau_init=0.0), spec).double()
    q, k, v, hidden = inputs(t=12, seed=4)
    module(q, k, v, hidden=hidden, positions=torch.arange(12)).output.square().sum().backward()
    grad = module.distance_bias.grad
    assert grad.shape == (4, 5) and (grad.abs() > 0).all()
    # distances 4..11 all read the table's last entry
    positions = torch.arange(12)
    far = module.bias(positions, positions)[:, 11, :8]
    assert torch.equal(far, module.distance_bias[:, 4:5].expand(4, 8))


def test_alibi_init():
    module = build_attention("lazy", LazyConfig(bias_init="alibi", max_distance=8), SPEC)
    torch.testing.assert_close(module.distance_bias[:, 3], 3 * alibi_slopes(4))
    assert alibi_slopes(8)[0] == 0.5 and alibi_slopes(8)[-1] == 2.0**-8


def test_bad_lazy_options():
    with pytest.raises(ConfigError, match="model.attention.lazy.bias_init"):
        LazyConfig(bias_init="rope").validate("model.attention.lazy.")
