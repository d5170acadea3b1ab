"""RoPE scaling equals transformers' RoPE initialisation functions for the same settings."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from core.errors import ConfigError
from model.config import ModelConfig, RopeConfig
from model.rope import RotaryEmbedding, rope_parameters
from model.transformer import Transformer

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

L0 = 1024  # the "pretraining" length


def hf(kind: str, head_dim: int, max_pos: int, params: dict, seq_len=None):
    cfg = transformers.LlamaConfig(
        hidden_size=head_dim * 4,
        num_attention_heads=4,
        head_dim=head_dim,
        max_position_embeddings=max_pos,
        rope_parameters={"rope_theta": 10000.0, "rope_type": kind, **params},
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ROPE_INIT_FUNCTIONS[kind](cfg, device="cpu", seq_len=seq_len)


def ours(head_dim: int, max_seq_len: int, seq_len=None, **kw):
    inv, factor = rope_parameters(RopeConfig(theta=10000.0, **kw), head_dim, max_seq_len, seq_len=seq_len)
    return inv.float(), factor


def same(a, b):
    (inv_a, af_a), (inv_b, af_b) = a, b
    torch.testing.assert_close(inv_a, inv_b.float(), rtol=2e-6, atol=0)
    assert af_a == pytest.approx(af_b, rel=1e-12)


@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("factor", [2.0, 4.0, 8.0])
def test_linear(head_dim, factor):
    same(ours(head_dim, L0, scaling="linear", factor=factor), hf("linear", head_dim, L0, {"factor": factor}))


@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("factor", [2.0, 4.0, 8.0])
@pytest.mark.parametrize("length", [512, 1024, 3000, 8192])
def test_dynamic_ntk_follows_the_current_length(head_dim, factor, length):
    mine = ours(head_dim, L0, seq_len=length, scaling="dynamic_ntk", factor=factor, original_max_seq_len=L0)
    same(mine, hf("dynamic", head_dim, L0, {"factor": factor}, seq_len=length))


@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("factor", [2.0, 4.0, 8.0])
def test_static_ntk_is_dynamic_ntk_at_its_fixed_point(head_dim, factor):
    # HF has no static NTK-aware type; dynamic NTK equals it where factor*L/L0 - (factor-1) == factor.
    length = L0 * (2 * factor - 1) / factor
    same(
        ours(head_dim, L0, scaling="ntk", factor=factor),
        hf("dynamic", head_dim, L0, {"factor": factor}, seq_len=length),
    )


@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("factor", [2.0, 4.0, 16.0])
@pytest.mark.parametrize("extra", [{}, {"beta_fast": 16.0, "beta_slow": 2.0}, {"attention_factor": 1.3}])
def test_yarn(head_dim, factor, extra):
    params = {"factor": factor, "original_max_position_embeddings": L0, **extra}
    mine = ours(
        head_dim, int(L0 * factor), scaling="yarn", factor=factor, **extra
    )  # original length defaults to max_seq_len / factor
    same(mine, hf("yarn", head_dim, int(L0 * factor), params))
    if "attention_factor" not in extra:
        assert mine[1] == pytest.approx(0.1 * math.log(factor) + 1)


@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize(
    "factor,low,high,original", [(8.0, 1.0, 4.0, 8192), (32.0, 1.0, 4.0, 8192), (4.0, 2.0, 8.0, 2048)]
)
def test_llama3(head_dim, factor, low, high, original):
    mine = ours(
        head_dim,
        131072,
        scaling="llama3",
        factor=factor,
        low_freq_factor=low,
        high_freq_factor=high,
        original_max_seq_len=original,
    )
    theirs = hf(
        "llama3",
        head_dim,
        131072,
        {
            "factor": factor,
            "low_freq_factor": low,
            "high_freq_factor": high,
            "original_max_position_embeddings": original,
        },
    )
    same(mine, theirs)


def test_llama3_defaults_are_factor_8_over_8192():
    same(
        ours(128, 131072, scaling="llama3"), ours(128, 131072, scaling="llama3", factor=8.0, original_max_seq_len=8192)
    )


def test_attention_factor_scales_cos_and_sin_and_dynamic_recomputes():
    yarn = RotaryEmbedding(RopeConfig(scaling="yarn", factor=4.0), head_dim=16, max_seq_len=64)
    plain = RotaryEmbedding(RopeConfig(scaling="linear", factor=4.0), head_dim=16, max_seq_len=64)
    cos, sin = yarn.cos_sin(torch.arange(5), torch.float32)
    assert torch.allclose(cos[0], torch.full((16,), yarn.attention_factor))
    assert torch.allclose(plain.cos_sin(torch.arange(5), torch.float32)[0][0], torch.ones(16))
    dyn = RotaryEmbedding(
        RopeConfig(scaling="dynamic_ntk", factor=2.0, original_max_seq_len=32), head_dim=16, max_seq_len=128
    )
    short, long = dyn.cos_sin(torch.arange(32), torch.float64), dyn.cos_sin(torch.arange(100), torch.float64)
    assert torch.equal(short[0], dyn.cos_sin(torch.arange(32), torch.float64)[0])
    assert not torch.allclose(short[0][31], long[0][31]), "past the original length the frequencies change"


def test_scaled_model_runs_and_bad_values_are_rejected():
    cfg = ModelConfig(vocab_size=32, max_seq_len=64, d_model=32, n_layers=1, n_heads=2)
    cfg.rope.scaling, cfg.rope.factor = "yarn", 4.0
    cfg.validate()
    out = Transformer(cfg)(torch.zeros(1, 10, dtype=torch.long))
    assert torch.isfinite(out.logits).all()
    cfg.rope.scaling = "alibi"
    with pytest.raises(
        ConfigError, match="model.rope.scaling: 'alibi' is not one of none, linear, ntk, dynamic_ntk, yarn, llama3"
    ):
        cfg.validate()
    with pytest.raises(ConfigError, match="model.rope.factor"):
        RopeConfig(factor=0.5).validate()
