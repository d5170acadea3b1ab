"""Focal attention (``focal``, papers/focal-attention-temperature.txt, section 2): a sharper softmax.

- ``constant``: logits scaled by 1 / (t * sqrt(d_h)), t = 0.4; through SDPA's ``scale``, no extra cost.
- ``learned``: tau = clip(sqrt_offset + x . w_tau, tau_min, tau_max) replaces sqrt(d_h) as the full
  divisor; w_tau (one vector per layer) starts at zero and the offset is clip(sqrt(d_h)), so training
  starts from standard attention.

``config.py``: ``FocalConfig``; ``module.py``: ``FocalAttention``, a ``FullAttention`` with another logit
scale (full's SDPA / flash-attn fast path); ``naive.py``: the temperatures and the scaled dense reference.
"""

from model.attention.common.base import register_attention
from model.attention.focal import naive
from model.attention.focal.config import MODES, SCOPES, FocalConfig
from model.attention.focal.module import FocalAttention

register_attention("focal", FocalConfig)(FocalAttention)

__all__ = ["MODES", "SCOPES", "FocalAttention", "FocalConfig", "naive"]
