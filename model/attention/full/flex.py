"""Full attention's FlexAttention path: within-document causal attention with a block mask, so that fully
masked blocks (keys of other documents) are skipped. Compiled on CUDA, eager elsewhere."""

from __future__ import annotations

from torch import Tensor

from model.attention.common.flex import flex_attention_fn


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
