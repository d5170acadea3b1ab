"""Rotary position embedding (half-rotation layout, as Hugging Face LLaMA checkpoints use).

Scaling types for long context (linear, NTK, YaRN, Llama-3) plug in through
``inverse_frequencies``; the foundation ships the unscaled form.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

SCALING_TYPES = ("none",)


def inverse_frequencies(head_dim: int, theta: float, device: torch.device | str | None = None) -> Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim))


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        # Not persistent: derived from config, so checkpoints stay valid if the scaling code changes.
        self.register_buffer("inv_freq", inverse_frequencies(head_dim, theta).float(), persistent=False)

    def reset_buffers(self) -> None:
        """Recompute buffers (after building on the meta device and materialising)."""
        self.inv_freq = inverse_frequencies(self.head_dim, self.theta, device=self.inv_freq.device).float()

    def cos_sin(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos, sin of shape [T, head_dim] for absolute ``positions`` [T], computed in float32 or better."""
        work = torch.promote_types(dtype, torch.float32)
        freqs = positions.to(work)[:, None] * self.inv_freq.to(work)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: [B, H, T, D]; cos/sin: [T, D]."""
    return x * cos + _rotate_half(x) * sin
