"""Rotary position embedding (half-rotation layout, as Hugging Face LLaMA checkpoints use) and its
long-context scaling types.

Each scaling type maps (config, head_dim, current length) to inverse frequencies and an attention
factor that multiplies cos and sin (so logits scale by its square). The values equal those of
``transformers``' RoPE initialisation functions for the same settings (tested against the package):

- ``none``: theta^(-2i/d).
- ``linear`` (position interpolation): frequencies / factor.
- ``ntk`` (NTK-aware, static): base theta * factor^(d / (d - 2)).
- ``dynamic_ntk``: NTK-aware with the factor grown from the current length L past the original
  length L0: base theta * (factor * L / L0 - (factor - 1))^(d / (d - 2)); unchanged while L <= L0.
- ``yarn``: a ramp between interpolated and original frequencies over the dimensions whose
  wavelengths lie between beta_fast and beta_slow rotations of L0, and attention factor
  0.1 ln(factor) + 1 unless set.
- ``llama3``: Llama 3.1's smooth interpolation between low- and high-frequency bands.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from model.config import RopeConfig

LLAMA3_DEFAULTS = {"factor": 8.0, "original_max_seq_len": 8192}


def base_frequencies(head_dim: int, theta: float) -> Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))


def resolved_factor(cfg: RopeConfig) -> float:
    return cfg.factor or (LLAMA3_DEFAULTS["factor"] if cfg.scaling == "llama3" else 1.0)


def original_length(cfg: RopeConfig, max_seq_len: int) -> int:
    """The pretraining length L0 the scaling extends: set explicitly, else llama3's 8192, else
    max_seq_len / factor (the context was extended by ``factor``)."""
    if cfg.original_max_seq_len:
        return cfg.original_max_seq_len
    if cfg.scaling == "llama3":
        return int(LLAMA3_DEFAULTS["original_max_seq_len"])
    return max(1, int(max_seq_len / resolved_factor(cfg)))


def yarn_attention_factor(factor: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0


def rope_parameters(
    cfg: RopeConfig, head_dim: int, max_seq_len: int, seq_len: int | None = None
) -> tuple[Tensor, float]:
    """(inverse frequencies [head_dim / 2] in float64, attention factor) for ``cfg``."""
    d, theta, factor = head_dim, cfg.theta, resolved_factor(cfg)
    inv = base_frequencies(d, theta)
    if cfg.scaling == "none":
        return inv, 1.0
    if cfg.scaling == "linear":
        return inv / factor, 1.0
    if cfg.scaling == "ntk":
        return base_frequencies(d, theta * factor ** (d / (d - 2))), 1.0
    if cfg.scaling == "dynamic_ntk":
        l0 = original_length(cfg, max_seq_len)
        length = max(seq_len or l0, l0)
        return base_frequencies(d, theta * (factor * length / l0 - (factor - 1)) ** (d / (d - 2))), 1.0
    if cfg.scaling == "yarn":
        l0 = original_length(cfg, max_seq_len)

        def dim_for_rotations(rotations: float) -> float:  # the dimension whose wavelength fits `rotations` turns in l0
            return d * math.log(l0 / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low = max(math.floor(dim_for_rotations(cfg.beta_fast)), 0)
        high: float = min(math.ceil(dim_for_rotations(cfg.beta_slow)), d - 1)
        if low == high:
            high += 0.001  # avoid a zero-width ramp
        ramp = ((torch.arange(d // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
        keep = 1 - ramp  # 1: original frequency (high-frequency dims), 0: interpolated
        inv = inv / factor * (1 - keep) + inv * keep
        return inv, cfg.attention_factor or yarn_attention_factor(factor)
    if cfg.scaling == "llama3":
        l0 = original_length(cfg, max_seq_len)
        low_wavelen, high_wavelen = l0 / cfg.low_freq_factor, l0 / cfg.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (l0 / wavelen - cfg.low_freq_factor) / (cfg.high_freq_factor - cfg.low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    raise ValueError(f"unknown RoPE scaling {cfg.scaling!r}")


class RotaryEmbedding(nn.Module):
    inv_freq: Tensor  # a buffer

    def __init__(self, cfg: RopeConfig, head_dim: int, max_seq_len: int):
        super().__init__()
        self.cfg, self.head_dim, self.max_seq_len = cfg, head_dim, max_seq_len
        inv, self.attention_factor = rope_parameters(cfg, head_dim, max_seq_len)
        # Not persistent: derived from config, so checkpoints stay valid if the scaling code changes.
        self.register_buffer("inv_freq", inv.float(), persistent=False)

    def reset_buffers(self) -> None:
        """Recompute buffers (after building on the meta device and materialising)."""
        inv, self.attention_factor = rope_parameters(self.cfg, self.head_dim, self.max_seq_len)
        self.inv_freq = inv.float().to(self.inv_freq.device)

    def frequencies(self, positions: Tensor) -> Tensor:
        if self.cfg.scaling == "dynamic_ntk" and positions.numel():
            length = int(positions.max()) + 1  # a host sync, paid only by dynamic NTK
            if length > original_length(self.cfg, self.max_seq_len):
                return rope_parameters(self.cfg, self.head_dim, self.max_seq_len, seq_len=length)[0].to(
                    self.inv_freq.device
                )
        return self.inv_freq

    def cos_sin(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos, sin of shape [T, head_dim] for absolute ``positions`` [T], computed in float32 or better."""
        work = torch.promote_types(dtype, torch.float32)
        inv = self.frequencies(positions)
        freqs = positions.to(work)[:, None] * inv.to(work)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_factor).to(dtype), (emb.sin() * self.attention_factor).to(dtype)


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: [B, H, T, D]; cos/sin: [T, D]."""
    return x * cos + _rotate_half(x) * sin
