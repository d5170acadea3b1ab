"""Standard causal softmax attention: SDPA (or flash-attn) fast path, dense reference."""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from core.errors import ConfigError, check_choice
from model.attention.common import reference as ref
from model.attention.common.base import Attention, AttnOut, GpuPath, KVCache, VariantConfig, register_attention
from model.attention.common.flex import flex_attention_fn, flex_supports
from model.attention.common.sdpa import prefix_causal_attention, prefix_causal_supported, sdpa_varying
from model.documents import document_mask

BACKENDS = ("auto", "sdpa", "flash_attn")
_HAS_FLASH_ATTN = importlib.util.find_spec("flash_attn") is not None


@dataclass
class FullConfig(VariantConfig):
    # auto: flash_attn when installed and usable (CUDA, 16-bit, no cache), else SDPA
    backend: str = "auto"

    def validate(self, prefix: str) -> None:
        check_choice(prefix + "backend", self.backend, BACKENDS)
        if self.backend == "flash_attn" and not _HAS_FLASH_ATTN:
            raise ConfigError(f"{prefix}backend: flash_attn is not installed (pip install '.[flash]')")


@register_attention("full", FullConfig)
class FullAttention(Attention):
    """Softmax attention. Subclasses that only change the logit scale (Focal) override
    ``logit_scale`` and keep both paths."""

    description = "standard causal attention (SDPA / flash-attn)"

    def logit_scale(self, hidden: Tensor, q_pos: Tensor, cache: KVCache | None) -> float | Tensor:
        """A float, or a per-query tensor [B, 1, Tq, 1] multiplying q . k."""
        return 1.0 / math.sqrt(self.spec.head_dim)

    def stats(self, scale: float | Tensor) -> dict[str, Tensor]:
        return {}

    def reference(
        self, q: Tensor, k: Tensor, v: Tensor, *, hidden: Tensor, q_pos: Tensor, k_pos: Tensor, cache: KVCache | None
    ) -> AttnOut:
        return self.reference_scaled(q, k, v, self.logit_scale(hidden, q_pos, cache), q_pos=q_pos, k_pos=k_pos)

    def reference_scaled(
        self, q: Tensor, k: Tensor, v: Tensor, scale: float | Tensor, *, q_pos: Tensor, k_pos: Tensor
    ) -> AttnOut:
        p = ref.masked_softmax(ref.scores(q, k, scale), ref.causal_mask(q_pos, k_pos))
        # the weights are materialised here anyway: sink ratio and density come free (the fast path skips them)
        stats = {**self.stats(scale), **ref.sink_and_density(p, k_pos)} if self.collect_stats else {}
        return AttnOut(ref.weighted_values(p, v, q.dtype), stats=stats)

    def has_fast_path(self, q: Tensor, cache: KVCache | None) -> bool:
        return True  # SDPA covers every device and dtype

    def fast(
        self, q: Tensor, k: Tensor, v: Tensor, *, hidden: Tensor, q_pos: Tensor, k_pos: Tensor, cache: KVCache | None
    ) -> AttnOut:
        return self.fast_scaled(q, k, v, self.logit_scale(hidden, q_pos, cache), q_pos=q_pos, k_pos=k_pos, cache=cache)

    def fast_scaled(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        scale: float | Tensor,
        *,
        q_pos: Tensor,
        k_pos: Tensor,
        cache: KVCache | None,
    ) -> AttnOut:
        stats = self.stats(scale) if self.collect_stats else {}
        if isinstance(scale, Tensor):  # a per-query scale folds into q; the kernel then scales by 1
            q, scale = q * scale.to(q.dtype), 1.0
        return AttnOut(
            sdpa_causal(q, k, v, q_pos=q_pos, k_pos=k_pos, scale=scale, flash=self._use_flash_attn(q, cache)),
            stats=stats,
        )

    def cp_logit_scale(self, hidden: Tensor, q_pos: Tensor, context: Any) -> float | Tensor:
        """``logit_scale`` of one context-parallel chunk (``context``: what ``cp_context`` gathered)."""
        return self.logit_scale(hidden, q_pos, None)

    def cp_attend(
        self, q: Tensor, k: Tensor, v: Tensor, *, hidden: Tensor, q_pos: Tensor, k_pos: Tensor, context: Any
    ) -> AttnOut:
        """Under context parallelism full attention gathers K and V only (Focal also its temperature inputs)."""
        scale = self.cp_logit_scale(hidden, q_pos, context)
        if self.impl != "reference":
            return self.fast_scaled(q, k, v, scale, q_pos=q_pos, k_pos=k_pos, cache=None)
        return self.reference_scaled(q, k, v, scale, q_pos=q_pos, k_pos=k_pos)

    supports_documents = True

    def cp_document_attention(
        self, q: Tensor, k: Tensor, v: Tensor, *, q_pos: Tensor, k_pos: Tensor, q_docs: Tensor, k_docs: Tensor
    ) -> AttnOut:
        """One context-parallel chunk of ``document_attention``: causal by global position, same global document."""
        scale = 1.0 / math.sqrt(self.spec.head_dim)
        mask = (ref.causal_mask(q_pos, k_pos) & (q_docs[:, :, None] == k_docs[:, None, :]))[:, None]
        if self.impl == "reference":
            return AttnOut(ref.weighted_values(ref.masked_softmax(ref.scores(q, k, scale), mask), v, q.dtype))
        return AttnOut(
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1])
        )

    def document_attention(self, q: Tensor, k: Tensor, v: Tensor, *, hidden: Tensor, documents: Tensor) -> AttnOut:
        """Within-document causal attention: the dense masked reference, SDPA with the boolean
        mask as the fast path, FlexAttention (a document block mask, fully masked blocks skipped)
        on CUDA."""
        scale = 1.0 / math.sqrt(self.spec.head_dim)
        if self.impl == "reference":
            p = ref.masked_softmax(ref.scores(q, k, scale), document_mask(documents)[:, None])
            return AttnOut(ref.weighted_values(p, v, q.dtype))
        if flex_supports(q):
            return AttnOut(flex_document_attention(q, k, v, documents, scale=scale))
        mask = document_mask(documents)[:, None]
        return AttnOut(
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1])
        )

    def gpu_paths(self) -> dict[str, GpuPath]:
        paths = super().gpu_paths()

        def documents(q: Tensor, k: Tensor, v: Tensor, hidden: Tensor, positions: Tensor) -> tuple[Tensor, ...]:
            docs = (positions // 37).expand(q.shape[0], -1)  # packed documents of 37 tokens
            return (self(q, k, v, hidden=hidden, positions=positions, documents=docs).output,)

        return {**paths, "documents": documents} if self.supports_documents else paths

    def _use_flash_attn(self, q: Tensor, cache: KVCache | None) -> bool:
        if getattr(self.cfg, "backend", "auto") == "sdpa" or not _HAS_FLASH_ATTN or cache is not None:
            return False
        return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)


def flex_document_attention(
    q: Tensor, k: Tensor, v: Tensor, documents: Tensor, *, scale: float, compiled: bool | None = None
) -> Tensor:
    """FlexAttention with a causal, same-document block mask (compiled on CUDA, eager elsewhere)."""
    from torch.nn.attention.flex_attention import create_block_mask

    def same_document(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (kv_idx <= q_idx) & (documents[b, q_idx] == documents[b, kv_idx])

    b, _, t, _ = q.shape
    block_mask = create_block_mask(same_document, B=b, H=None, Q_LEN=t, KV_LEN=t, device=q.device)
    return flex_attention_fn(q.is_cuda if compiled is None else compiled, "documents")(
        q, k, v, block_mask=block_mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1]
    )


def sdpa_causal(
    q: Tensor, k: Tensor, v: Tensor, *, q_pos: Tensor, k_pos: Tensor, scale: float, flash: bool = False
) -> Tensor:
    """Causal attention through flash-attn or SDPA, exact for training, prefill, chunked prefill and decode."""
    if flash:
        from flash_attn import flash_attn_func

        out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True, softmax_scale=scale)
        return out.transpose(1, 2)
    gqa = k.shape[1] != q.shape[1]
    tq, tk = q.shape[2], k.shape[2]
    if tq == tk:  # training / prefill from position 0: the built-in causal mask is exact
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    if tq == 1:  # decode: the one new query sees every cached key
        return sdpa_varying(q, k, v, scale=scale, enable_gqa=gqa)
    if prefix_causal_supported(q):  # the CPU: no Tq x Tk mask (context-parallel chunks, chunked prefill)
        return prefix_causal_attention(q, ref.expand_kv(k, q.shape[1]), ref.expand_kv(v, q.shape[1]), scale=scale)
    # chunked prefill onto a cache: SDPA's is_causal aligns top-left, so pass the mask
    return sdpa_varying(q, k, v, attn_mask=ref.causal_mask(q_pos, k_pos), scale=scale, enable_gqa=gqa)
