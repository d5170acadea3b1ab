"""Standard causal softmax attention (``full``): SDPA (or flash-attn) fast path, dense reference.

- ``config.py``: ``FullConfig`` (the fast path's backend);
- ``module.py``: ``FullAttention``, which Focal subclasses (it changes only the logit scale);
- ``naive.py``: the dense causal softmax reference and its within-document form, plain functions;
- ``sdpa.py``: the SDPA / flash-attn path (training, prefill, chunked prefill, decode; document masks);
- ``flex.py``: the FlexAttention path of packed documents (a block mask that skips other documents' keys).
"""

from model.attention.common.base import register_attention
from model.attention.full import naive
from model.attention.full.config import BACKENDS, FullConfig
from model.attention.full.flex import flex_document_attention
from model.attention.full.module import FullAttention
from model.attention.full.sdpa import sdpa_causal

register_attention("full", FullConfig)(FullAttention)

__all__ = ["BACKENDS", "FullAttention", "FullConfig", "flex_document_attention", "naive", "sdpa_causal"]
