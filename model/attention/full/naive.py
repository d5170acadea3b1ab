"""Full attention's dense reference as plain functions: causal softmax attention (Vaswani et al. eq. 1,
``softmax(Q K^T * scale) V``), and its within-document form. Materialises the [B, H, Tq, Tk] weights."""

from __future__ import annotations

from torch import Tensor

from model.attention.common import reference as ref
from model.documents import document_mask


def weights(q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor, scale: float | Tensor) -> Tensor:
    """[B, H, Tq, Tk] softmax over keys k_pos[j] <= q_pos[i] of q_i . k_j * scale (a float, or a per-query
    [B, 1, Tq, 1] tensor); grouped KV heads are repeated to the query heads."""
    return ref.masked_softmax(ref.scores(q, k, scale), ref.causal_mask(q_pos, k_pos))


def attention(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, k_pos: Tensor, scale: float | Tensor) -> Tensor:
    """[B, H, Tq, D] causal softmax attention in q's dtype."""
    return ref.weighted_values(weights(q, k, q_pos, k_pos, scale), v, q.dtype)


def masked_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> Tensor:
    """Softmax attention under an explicit boolean mask (broadcast to [B, H, Tq, Tk]; True: may attend)."""
    return ref.weighted_values(ref.masked_softmax(ref.scores(q, k, scale), mask), v, q.dtype)


def document_attention(q: Tensor, k: Tensor, v: Tensor, documents: Tensor, scale: float) -> Tensor:
    """Within-document causal attention of a packed row: query i sees key j <= i of the same document
    (``documents``: [B, T] document index of each token)."""
    return masked_attention(q, k, v, document_mask(documents)[:, None], scale)
