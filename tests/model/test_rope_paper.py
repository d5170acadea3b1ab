"""Paper pins for RoPE and its long-context scaling (SPEC 4), each formula written out here in float64:

- RoFormer (Su et al., eq. 34): theta_i = base^(-2i/d); rotation in the half layout; q.k after rotation
  depends only on the relative position m - n.
- Position interpolation (Chen et al. 2023, eq. 4): frequencies / s.
- NTK-aware scaling (bloc97, 2023): base' = base * s^(d / (d - 2)).
- Dynamic NTK (Peng et al., YaRN section 3.3): s' = s L / L0 - (s - 1) for the current length L > L0.
- YaRN (Peng et al. 2023, eq. 18-21): h(theta_d) = (1 - gamma_d) theta_d / s + gamma_d theta_d, gamma ramps
  over the dimensions whose wavelength fits between beta (= beta_fast, 32) and alpha (= beta_slow, 1)
  rotations of L0 (the reference code's floor / ceil dimension bounds); attention factor sqrt(1/t) =
  0.1 ln s + 1 on cos and sin.
- Llama 3.1: wavelengths under L0 / high_freq_factor keep their frequency, those over L0 / low_freq_factor
  are divided by s, and in between (1 - smooth) theta / s + smooth theta with
  smooth = (L0 / wavelength - low) / (high - low).
"""

from __future__ import annotations

import math

import pytest
import torch

from model.config import RopeConfig
from model.rope import RotaryEmbedding, apply_rope

D, BASE, L0 = 16, 10000.0, 4096
F32 = dict(rtol=2e-7, atol=0)  # the module keeps inverse frequencies as float32


def base_inv(base: float = BASE) -> torch.Tensor:
    return base ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)  # eq. 34


def rope(max_seq_len: int = 4 * L0, **options) -> RotaryEmbedding:
    return RotaryEmbedding(RopeConfig(theta=BASE, **options), D, max_seq_len)


def inv_of(module: RotaryEmbedding) -> torch.Tensor:
    return module.inv_freq.double()


def test_none_is_roformer_base_frequencies_and_relative_eq34():
    """Eq. 34 frequencies; rotated q . k depends only on m - n (the defining property), not on m and n."""
    module = rope()
    torch.testing.assert_close(inv_of(module), base_inv(), **F32)
    assert module.attention_factor == 1.0
    g = torch.Generator().manual_seed(0)
    q, k = (
        torch.randn(1, 1, 1, D, generator=g, dtype=torch.float64),
        torch.randn(1, 1, 1, D, generator=g, dtype=torch.float64),
    )

    def dot(m: int, n: int) -> float:
        cos, sin = module.cos_sin(torch.tensor([m, n]), torch.float64)
        return float(apply_rope(q, cos[:1], sin[:1]).flatten() @ apply_rope(k, cos[1:], sin[1:]).flatten())

    assert dot(7, 3) == pytest.approx(dot(40, 36), rel=1e-6)
    assert dot(7, 3) != pytest.approx(dot(7, 4), rel=1e-3)
    # half layout: dimension i and i + d/2 rotate together by angle m theta_i
    cos, sin = module.cos_sin(torch.tensor([5]), torch.float64)
    angle = 5 * base_inv()
    torch.testing.assert_close(cos[0], torch.cat([angle.cos(), angle.cos()]), atol=1e-6, rtol=0)
    torch.testing.assert_close(sin[0], torch.cat([angle.sin(), angle.sin()]), atol=1e-6, rtol=0)


@pytest.mark.parametrize("s", [2.0, 4.0])
def test_linear_is_position_interpolation_eq4(s):
    torch.testing.assert_close(inv_of(rope(scaling="linear", factor=s)), base_inv() / s, **F32)


@pytest.mark.parametrize("s", [2.0, 8.0])
def test_ntk_raises_the_base_by_s_to_d_over_d_minus_2(s):
    torch.testing.assert_close(inv_of(rope(scaling="ntk", factor=s)), base_inv(BASE * s ** (D / (D - 2))), **F32)


@pytest.mark.parametrize("s", [2.0, 4.0])
def test_dynamic_ntk_grows_the_factor_with_the_length(s):
    """Unchanged up to L0; at length L > L0 the NTK base with s' = s L / L0 - (s - 1)."""
    module = rope(scaling="dynamic_ntk", factor=s, original_max_seq_len=L0)
    torch.testing.assert_close(inv_of(module), base_inv(), **F32)
    for length in (L0, 3 * L0):
        s_now = max(s * length / L0 - (s - 1), 1.0)
        inv = base_inv(BASE * s_now ** (D / (D - 2)))
        cos, sin = module.cos_sin(torch.arange(length), torch.float64)
        angle = (length - 1) * inv
        torch.testing.assert_close(cos[-1, : D // 2], angle.cos(), atol=1e-5, rtol=0)
        torch.testing.assert_close(sin[-1, : D // 2], angle.sin(), atol=1e-5, rtol=0)


def yarn_inv(s: float, alpha: float = 1.0, beta: float = 32.0) -> torch.Tensor:
    def dim(rotations: float) -> float:  # the dimension whose wavelength makes ``rotations`` turns over L0
        return D * math.log(L0 / (rotations * 2 * math.pi)) / (2 * math.log(BASE))

    low, high = max(math.floor(dim(beta)), 0), min(math.ceil(dim(alpha)), D - 1)
    gamma = 1 - ((torch.arange(D // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    return (1 - gamma) * base_inv() / s + gamma * base_inv()


@pytest.mark.parametrize("s", [4.0, 16.0])
def test_yarn_ramps_between_interpolation_and_extrapolation_eq18_to_21(s):
    module = rope(scaling="yarn", factor=s, original_max_seq_len=L0)
    inv = inv_of(module)
    torch.testing.assert_close(inv, yarn_inv(s), **F32)
    # the paper's bands: many rotations over L0 (r > beta) keep theta; fewer than alpha are interpolated
    r = L0 * base_inv() / (2 * math.pi)
    torch.testing.assert_close(inv[r > 32], base_inv()[r > 32], **F32)
    torch.testing.assert_close(inv[r < 1], base_inv()[r < 1] / s, **F32)
    assert bool((r > 32).any() and (r < 1).any())
    assert module.attention_factor == pytest.approx(0.1 * math.log(s) + 1, rel=1e-12)
    cos, _ = module.cos_sin(torch.tensor([0]), torch.float64)
    torch.testing.assert_close(cos[0], torch.full((D,), 0.1 * math.log(s) + 1, dtype=torch.float64))
    assert rope(scaling="yarn", factor=s, original_max_seq_len=L0, attention_factor=1.5).attention_factor == 1.5


@pytest.mark.parametrize("low,high", [(1.0, 4.0), (2.0, 8.0)])
def test_llama3_bands(low, high):
    s = 8.0
    module = rope(scaling="llama3", factor=s, original_max_seq_len=L0, low_freq_factor=low, high_freq_factor=high)
    theta = base_inv()
    wavelength = 2 * math.pi / theta
    smooth = (L0 / wavelength - low) / (high - low)
    want = torch.where(
        wavelength < L0 / high,
        theta,
        torch.where(wavelength > L0 / low, theta / s, (1 - smooth) * theta / s + smooth * theta),
    )
    bands = (wavelength < L0 / high, wavelength > L0 / low)
    assert all(bool(b.any()) for b in bands) and bool((~bands[0] & ~bands[1]).any()), "every band must be exercised"
    torch.testing.assert_close(inv_of(module), want, **F32)
