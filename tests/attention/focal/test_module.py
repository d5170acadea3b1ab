from __future__ import annotations

import pytest
import torch

from core.errors import ConfigError
from model.attention import LayerSpec, build_attention
from model.attention.focal import FocalConfig
from model.config import ModelConfig
from model.transformer import Transformer


def model_with(kind: str, **options) -> Transformer:
    cfg = ModelConfig(vocab_size=50, max_seq_len=32, d_model=64, n_layers=2, n_heads=4)
    cfg.attention.kind = kind
    for key, value in options.items():
        setattr(cfg.attention.options[kind], key, value)
    torch.manual_seed(0)
    return Transformer(cfg).double().eval()


def test_constant_t_of_one_is_full_attention():
    idx = torch.randint(0, 50, (2, 20), generator=torch.Generator().manual_seed(0))
    full, focal = model_with("full"), model_with("focal", t=1.0)
    focal.load_state_dict(full.state_dict())
    torch.testing.assert_close(focal(idx).logits, full(idx).logits, atol=1e-12, rtol=0)
    sharp = model_with("focal", t=0.4)
    sharp.load_state_dict(full.state_dict())
    assert (sharp(idx).logits - full(idx).logits).abs().max() > 1e-3


def test_constant_scale_is_one_over_t_sqrt_d():
    spec = LayerSpec(64, 4, 4, 16, 32, 0, 1)
    module = build_attention("focal", FocalConfig(t=0.4), spec)
    assert module.logit_scale(torch.zeros(1, 3, 64), torch.arange(3), None) == pytest.approx(1 / (0.4 * 4.0))


@pytest.mark.parametrize("head_dim", [16, 25, 64, 100, 128])
def test_learned_tau_starts_at_clipped_sqrt_head_dim(head_dim):
    """Section 2.2 with w_tau = 0: training starts from the standard divisor sqrt(d_h), clipped to the paper's
    [tau_min, tau_max] = [5, 10] (section 5.2): d_h = 16 -> 5 (clipped up), 25 -> 5, 64 -> 8, 100 -> 10, 128 -> 10
    (clipped down from 11.31). The divisor is worked out here from d_h, not read from the module."""
    spec = LayerSpec(4 * head_dim, 4, 4, head_dim, 32, 0, 1)
    module = build_attention("focal", FocalConfig(mode="learned"), spec)
    hidden = torch.randn(2, 7, 4 * head_dim)
    root = head_dim**0.5
    expected = 5.0 if root < 5.0 else 10.0 if root > 10.0 else root
    assert torch.equal(module.tau(hidden, torch.arange(7), None), torch.full((2, 7), expected))


@pytest.mark.parametrize("scope", ["query", "prefix_mean", "sequence_mean"])
def test_learned_tau_is_eq6_with_the_offset(scope):
    """Eq. 6, tau = clip(reduce(X w_tau), tau_min, tau_max) plus the clip(sqrt(d_h)) offset, worked out token by
    token in float64: x_i . w_tau per query (``query``), its mean over tokens <= i (``prefix_mean``) or over the
    whole sequence (``sequence_mean``, the paper's mean). w_tau is drawn so that some tokens clip and some do not."""
    spec = LayerSpec(64, 4, 4, 16, 32, 0, 1)  # d_h = 16: the offset clips up to tau_min = 5
    module = build_attention("focal", FocalConfig(mode="learned", scope=scope), spec).double()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        module.w_tau.copy_(torch.randn(64, generator=g, dtype=torch.float64))
    hidden = torch.randn(2, 9, 64, generator=g, dtype=torch.float64)
    got = module.tau(hidden, torch.arange(9), None)
    w = module.w_tau.detach().tolist()
    for b in range(2):
        z = [sum(x * wi for x, wi in zip(hidden[b, i].tolist(), w)) for i in range(9)]
        for i in range(9):
            seen = z[i : i + 1] if scope == "query" else z[: i + 1] if scope == "prefix_mean" else z
            want = min(max(5.0 + sum(seen) / len(seen), 5.0), 10.0)
            assert got[b, i].item() == pytest.approx(want, abs=1e-12), (b, i)
    assert ((got == 5.0) | (got == 10.0)).any() and ((got > 5.0) & (got < 10.0)).any(), "clipped and unclipped"


def test_learned_tau_is_clipped_and_trains():
    spec = LayerSpec(64, 4, 4, 16, 32, 0, 1)
    module = build_attention("focal", FocalConfig(mode="learned"), spec).double()
    with torch.no_grad():
        module.w_tau.normal_(0, 2.0)
    hidden = torch.randn(2, 9, 64, dtype=torch.float64)
    tau = module.tau(hidden, torch.arange(9), None)
    assert tau.min() >= 5.0 and tau.max() <= 10.0 and (tau == 5.0).any() and (tau == 10.0).any()
    q, k, v = (torch.randn(2, 4, 9, 16, dtype=torch.float64) for _ in range(3))
    out = module(q, k, v, hidden=hidden, positions=torch.arange(9))
    out.output.square().sum().backward()
    assert module.w_tau.grad is not None and module.w_tau.grad.abs().sum() > 0


def test_bad_focal_options():
    with pytest.raises(ConfigError, match="model.attention.focal.scope"):
        FocalConfig(scope="global").validate("model.attention.focal.")
    with pytest.raises(ConfigError, match="model.attention.focal.tau_max: 4.0 is below tau_min=5.0"):
        FocalConfig(tau_max=4.0).validate("model.attention.focal.")
