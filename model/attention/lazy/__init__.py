"""Lazy attention (papers/lazy-attention-elastic-softmax.md, section 4): positional
discrimination plus Elastic-Softmax.

- Logits ``q_i . k_j / sqrt(d_h) - b_h[i - j]``: RoPE (set a large ``model.rope.theta``, e.g.
  500000, as the paper does) plus a learnable per-head bias over distances 0..max_distance-1;
  longer distances use the table's last entry, so contexts past the table still work.
- Elastic-Softmax ``a_ij = relu(softmax_j(s_ij) - tau_h / n_i)`` with ``n_i`` the number of keys
  query i attends (i + 1 at 0-based position i) and a learnable per-head ``tau_h`` (init 1).
  With tau > 0 rows sum to at most 1 and weak weights become exactly 0; a negative tau (the paper
  reports learned negative offsets) adds |tau|/n to every visible weight (rows sum to 1 + |tau|).

Rooms: ``config.py`` (LazyConfig, the ALiBi init slopes), ``module.py`` (LazyAttention and its choice of path),
``naive.py`` (the dense reference, plain functions), ``cpu.py`` (the CPU fast path: two passes over block diagonals,
exact, memory linear in T), ``triton.py`` (the CUDA fast path: fused Triton kernels, forward and backward),
``flex.py`` (two FlexAttention passes, appendix F: CUDA without triton).
"""

from model.attention.common.base import register_attention
from model.attention.lazy.config import BIAS_INITS, LazyConfig, alibi_slopes
from model.attention.lazy.cpu import elastic_blockwise
from model.attention.lazy.flex import COMPILE_OPTIONS, causal_block_mask, compiled_two_pass, elastic_two_pass
from model.attention.lazy.module import LazyAttention

register_attention("lazy", LazyConfig)(LazyAttention)

__all__ = [
    "BIAS_INITS",
    "COMPILE_OPTIONS",
    "LazyAttention",
    "LazyConfig",
    "alibi_slopes",
    "causal_block_mask",
    "compiled_two_pass",
    "elastic_blockwise",
    "elastic_two_pass",
]
