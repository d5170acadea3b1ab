"""Standard causal softmax attention: SDPA (or flash-attn) fast path, dense reference (``naive``)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from model.attention.common import reference as ref
from model.attention.common.base import Attention, AttnOut, GpuPath, KVCache
from model.attention.common.flex import flex_supports
from model.attention.full import naive
from model.attention.full.config import HAS_FLASH_ATTN
from model.attention.full.flex import flex_document_attention
from model.attention.full.sdpa import sdpa_causal, sdpa_masked
from model.documents import document_mask


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
        p = self.reference_weights(q, k, scale, q_pos=q_pos, k_pos=k_pos)
        # the weights are materialised here anyway: sink ratio and density come free (the fast path skips them)
        stats = {**self.stats(scale), **ref.sink_and_density(p, k_pos)} if self.collect_stats else {}
        return AttnOut(ref.weighted_values(p, v, q.dtype), stats=stats)

    def reference_weights(self, q: Tensor, k: Tensor, scale: float | Tensor, *, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """[B, H, Tq, Tk] weights of the dense reference: ``naive.weights`` (Focal: its own naive)."""
        return naive.weights(q, k, q_pos, k_pos, scale)

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
            return AttnOut(naive.masked_attention(q, k, v, mask, scale))
        return AttnOut(sdpa_masked(q, k, v, mask, scale=scale))

    def document_attention(self, q: Tensor, k: Tensor, v: Tensor, *, hidden: Tensor, documents: Tensor) -> AttnOut:
        """Within-document causal attention: the dense masked reference, SDPA with the boolean
        mask as the fast path, FlexAttention (a document block mask, fully masked blocks skipped)
        on CUDA."""
        scale = 1.0 / math.sqrt(self.spec.head_dim)
        if self.impl == "reference":
            return AttnOut(naive.document_attention(q, k, v, documents, scale))
        if flex_supports(q):
            return AttnOut(flex_document_attention(q, k, v, documents, scale=scale))
        return AttnOut(sdpa_masked(q, k, v, document_mask(documents)[:, None], scale=scale))

    def gpu_paths(self) -> dict[str, GpuPath]:
        paths = super().gpu_paths()

        def documents(q: Tensor, k: Tensor, v: Tensor, hidden: Tensor, positions: Tensor) -> tuple[Tensor, ...]:
            docs = (positions // 37).expand(q.shape[0], -1)  # packed documents of 37 tokens
            return (self(q, k, v, hidden=hidden, positions=positions, documents=docs).output,)

        return {**paths, "documents": documents} if self.supports_documents else paths

    def _use_flash_attn(self, q: Tensor, cache: KVCache | None) -> bool:
        if getattr(self.cfg, "backend", "auto") == "sdpa" or not HAS_FLASH_ATTN or cache is not None:
            return False
        return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
