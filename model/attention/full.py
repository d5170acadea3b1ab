"""Standard causal softmax attention: SDPA (or flash-attn) fast path, dense reference."""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from model.attention import reference as ref
from model.attention.base import Attention, AttnOut, KVCache, register_attention
from model.errors import ConfigError, check_choice

BACKENDS = ("auto", "sdpa", "flash_attn")
_HAS_FLASH_ATTN = importlib.util.find_spec("flash_attn") is not None


@dataclass
class FullConfig:
    # auto: flash_attn when installed and usable (CUDA, 16-bit, no cache), else SDPA
    backend: str = "auto"

    def validate(self) -> None:
        check_choice("model.attention.full.backend", self.backend, BACKENDS)
        if self.backend == "flash_attn" and not _HAS_FLASH_ATTN:
            raise ConfigError("model.attention.full.backend: flash_attn is not installed (pip install '.[flash]')")


@register_attention("full", FullConfig)
class FullAttention(Attention):
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.spec.head_dim)

    def reference(self, q, k, v, *, hidden, q_pos, k_pos, cache) -> AttnOut:
        p = ref.masked_softmax(ref.scores(q, k, self.scale()), ref.causal_mask(q_pos, k_pos))
        return AttnOut(ref.weighted_values(p, v, q.dtype))

    def has_fast_path(self, q: Tensor, cache: KVCache | None) -> bool:
        return True  # SDPA covers every device and dtype

    def fast(self, q, k, v, *, hidden, q_pos, k_pos, cache) -> AttnOut:
        gqa = k.shape[1] != q.shape[1]
        if self._use_flash_attn(q, cache):
            from flash_attn import flash_attn_func

            out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True, softmax_scale=self.scale())
            return AttnOut(out.transpose(1, 2))
        tq, tk = q.shape[2], k.shape[2]
        if tq == tk:  # training / prefill from position 0: the built-in causal mask is exact
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale(), enable_gqa=gqa)
        elif tq == 1:  # decode: the one new query sees every cached key
            out = F.scaled_dot_product_attention(q, k, v, scale=self.scale(), enable_gqa=gqa)
        else:  # chunked prefill onto a cache: SDPA's is_causal aligns top-left, so pass the mask
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=ref.causal_mask(q_pos, k_pos), scale=self.scale(), enable_gqa=gqa)
        return AttnOut(out)

    def _use_flash_attn(self, q: Tensor, cache: KVCache | None) -> bool:
        if self.cfg.backend == "sdpa" or not _HAS_FLASH_ATTN or cache is not None:
            return False
        return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
