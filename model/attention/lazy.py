"""Lazy attention (papers/lazy-attention-elastic-softmax.md, section 4): positional
discrimination plus Elastic-Softmax.

- Logits ``q_i . k_j / sqrt(d_h) - b_h[i - j]``: RoPE (set a large ``model.rope.theta``, e.g.
  500000, as the paper does) plus a learnable per-head bias over distances 0..max_distance-1;
  longer distances use the table's last entry, so contexts past the table still work.
- Elastic-Softmax ``a_ij = relu(softmax_j(s_ij) - tau_h / n_i)`` with ``n_i`` the number of keys
  query i attends (i + 1 at 0-based position i) and a learnable per-head ``tau_h`` (init 1).
  Rows sum to at most 1; weak weights become exactly 0.

This module is the dense reference path; the two-pass FlashAttention-style fast path
(appendix F) is tracked separately and must match it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from model.attention import reference as ref
from model.attention.base import Attention, AttnOut, KVCache, LayerSpec, register_attention
from model.errors import check_choice, check_min

BIAS_INITS = ("zeros", "alibi")


@dataclass
class LazyConfig:
    max_distance: int = 0  # bias table length; 0 = model.max_seq_len
    bias_init: str = "zeros"  # zeros | alibi (head slopes 2^(-8h/H), as ALiBi)
    tau_init: float = 1.0

    def validate(self) -> None:
        check_min("model.attention.lazy.max_distance", self.max_distance, 0, note=" (0 = model.max_seq_len)")
        check_choice("model.attention.lazy.bias_init", self.bias_init, BIAS_INITS)


def alibi_slopes(n_heads: int) -> Tensor:
    return torch.tensor([2.0 ** (-8.0 * (h + 1) / n_heads) for h in range(n_heads)])


@register_attention("lazy", LazyConfig)
class LazyAttention(Attention):
    no_weight_decay = ("distance_bias", "tau")

    def __init__(self, cfg: LazyConfig, spec: LayerSpec):
        super().__init__(cfg, spec)
        self.table = cfg.max_distance or spec.max_seq_len
        self.distance_bias = nn.Parameter(torch.zeros(spec.n_heads, self.table))
        self.tau = nn.Parameter(torch.full((spec.n_heads,), float(cfg.tau_init)))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.tau.fill_(float(self.cfg.tau_init))
            if self.cfg.bias_init == "alibi":
                distances = torch.arange(self.table, dtype=torch.float32, device=self.distance_bias.device)
                self.distance_bias.copy_(alibi_slopes(self.spec.n_heads).to(distances.device)[:, None] * distances)
            else:
                self.distance_bias.zero_()

    def bias(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """[H, Tq, Tk] bias for each query/key distance, clamped to the table."""
        distance = (q_pos[:, None] - k_pos[None, :]).clamp(0, self.table - 1)
        return self.distance_bias[:, distance]

    def weights(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """Elastic-Softmax weights [B, H, Tq, Tk], dense."""
        mask = ref.causal_mask(q_pos, k_pos)
        s = ref.scores(q, k, 1.0 / math.sqrt(self.spec.head_dim)) - self.bias(q_pos, k_pos).to(torch.promote_types(q.dtype, torch.float32))
        p = ref.masked_softmax(s, mask)
        n = (q_pos + 1).to(p.dtype)  # keys attended by each query
        a = torch.relu(p - self.tau.to(p.dtype)[None, :, None, None] / n[None, None, :, None])
        return a.masked_fill(~mask, 0.0)  # a negative tau must not open the future

    def reference(self, q, k, v, *, hidden, q_pos, k_pos, cache) -> AttnOut:
        a = self.weights(q, k, q_pos, k_pos)
        stats = {}
        if self.collect_stats:
            first = (k_pos == 0).to(a.dtype)
            sink = (a * first).sum(-1)
            stats = {"sink_ratio": sink.mean().detach(), "density": (a.sum(-1) - sink).mean().detach(), "tau": self.tau.mean().detach()}
        return AttnOut(ref.weighted_values(a, v, q.dtype), stats=stats)

    def has_fast_path(self, q: Tensor, cache: KVCache | None) -> bool:
        return False
