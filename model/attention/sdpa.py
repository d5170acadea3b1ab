"""SDPA for calls whose shapes change from call to call: decode and chunked prefill onto a KV cache.

On Hopper and newer GPUs torch 2.11 tries cuDNN's SDPA first, and cuDNN builds an execution plan for every new shape
(FunASR issue 3704 measured 0.44 s per new shape on a B200). Decoding changes the key length with every token. On an
H100 this project measured 43.6 ms per decode token of full attention at a 16K context (docs/benchmarks.md), far above
what reading 16K keys and values should take (an estimate, not a measurement: 16 MiB in bf16 at ~3 TB/s is ~5 us).
These calls therefore leave cuDNN out; fixed-shape training calls keep torch's choice.
"""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

VARYING_SHAPE_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def sdpa_varying(q: Tensor, k: Tensor, v: Tensor, **kwargs: Any) -> Tensor:
    """``F.scaled_dot_product_attention`` for a shape that changes per call (on CUDA without cuDNN's backend)."""
    if not q.is_cuda:
        return F.scaled_dot_product_attention(q, k, v, **kwargs)
    with sdpa_kernel(VARYING_SHAPE_BACKENDS):
        return F.scaled_dot_product_attention(q, k, v, **kwargs)
