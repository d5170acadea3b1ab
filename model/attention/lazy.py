"""Lazy attention (papers/lazy-attention-elastic-softmax.md, section 4): positional
discrimination plus Elastic-Softmax.

- Logits ``q_i . k_j / sqrt(d_h) - b_h[i - j]``: RoPE (set a large ``model.rope.theta``, e.g.
  500000, as the paper does) plus a learnable per-head bias over distances 0..max_distance-1;
  longer distances use the table's last entry, so contexts past the table still work.
- Elastic-Softmax ``a_ij = relu(softmax_j(s_ij) - tau_h / n_i)`` with ``n_i`` the number of keys
  query i attends (i + 1 at 0-based position i) and a learnable per-head ``tau_h`` (init 1).
  Rows sum to at most 1; weak weights become exactly 0.

Fast path (appendix F), two FlexAttention passes over the same causal block mask:
pass 1 gives each row's logsumexp ``lse`` of the biased scores; pass 2 uses the score
``s + log(1 - (tau/n) exp(lse - s))`` where that argument is positive and -inf elsewhere, so
its softmax numerators are ``e^lse * relu(p - tau/n)``; the output is ``out2 * exp(lse2 - lse)``
= sum_j relu(p_ij - tau/n_i) v_j, exactly. It runs where FlexAttention has a backward (CUDA);
on CPU the reference path trains, and tests check the composition forward-only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from model.attention import reference as ref
from model.attention.base import Attention, AttnOut, KVCache, LayerSpec, register_attention
from model.attention.flex import flex_attention_fn, flex_available
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
        s = ref.scores(q, k, 1.0 / math.sqrt(self.spec.head_dim)) - self.bias(q_pos, k_pos).to(
            torch.promote_types(q.dtype, torch.float32)
        )
        p = ref.masked_softmax(s, mask)
        n = (q_pos + 1).to(p.dtype)  # keys attended by each query
        a = torch.relu(p - self.tau.to(p.dtype)[None, :, None, None] / n[None, None, :, None])
        return a.masked_fill(~mask, 0.0)  # a negative tau must not open the future

    def reference(self, q, k, v, *, hidden, q_pos, k_pos, cache) -> AttnOut:
        a = self.weights(q, k, q_pos, k_pos)
        stats = {}
        if self.collect_stats:
            stats = {**ref.sink_and_density(a, k_pos), "tau": self.tau.mean().detach()}
        return AttnOut(ref.weighted_values(a, v, q.dtype), stats=stats)

    def has_fast_path(self, q: Tensor, cache: KVCache | None) -> bool:
        return q.is_cuda and flex_available()

    def fast(self, q, k, v, *, hidden, q_pos, k_pos, cache) -> AttnOut:
        from torch.nn.attention.flex_attention import create_block_mask

        flex = flex_attention_fn(q.is_cuda)
        tq, tk = q.shape[2], k.shape[2]
        bias, tau, last = self.distance_bias, self.tau, self.table - 1
        q_pos = q_pos.to(q.device)

        def biased(score, b, h, qi, kv):  # positions of keys are their indices (0..Tk-1)
            return score - bias[h, (q_pos[qi] - kv).clamp(0, last)].to(score.dtype)

        def causal(b, h, qi, kv):
            return kv <= q_pos[qi]

        block_mask = create_block_mask(causal, None, None, tq, tk, device=q.device)
        kwargs = dict(
            block_mask=block_mask,
            scale=1.0 / math.sqrt(self.spec.head_dim),
            enable_gqa=k.shape[1] != q.shape[1],
            return_lse=True,
        )
        _, lse = flex(q, k, v, score_mod=biased, **kwargs)

        def elastic(score, b, h, qi, kv):
            s = biased(score, b, h, qi, kv)
            c = tau[h].to(score.dtype) / (q_pos[qi] + 1).to(score.dtype)
            arg = 1.0 - c * torch.exp((lse[b, h, qi].to(score.dtype) - s).clamp(max=80.0))
            return torch.where(arg > 0, s + torch.log(arg.clamp(min=1e-30)), float("-inf"))

        out2, lse2 = flex(q, k, v, score_mod=elastic, **kwargs)
        weight = torch.exp(lse2 - lse).nan_to_num(0.0)  # a row with nothing above threshold: lse2 = -inf
        # sink ratio and density need the dense weights: the reference path and eval.run attention_stats give them
        stats = {"tau": self.tau.mean().detach()} if self.collect_stats else {}
        return AttnOut((out2.nan_to_num(0.0) * weight[..., None].to(out2.dtype)).to(q.dtype), stats=stats)
