"""FlexAttention access shared by the variants' fast paths."""

from __future__ import annotations

import torch

_COMPILED = None


def flex_available() -> bool:
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def flex_attention_fn(compiled: bool):
    """FlexAttention, compiled on CUDA (the fused kernel); eager elsewhere (a dense fallback used by tests)."""
    global _COMPILED
    from torch.nn.attention.flex_attention import flex_attention

    if not compiled:
        return flex_attention
    if _COMPILED is None:
        _COMPILED = torch.compile(flex_attention, dynamic=False)
    return _COMPILED


_BLOCK_MASKS: dict = {}
MAX_CACHED_BLOCK_MASKS = 64


def cached_block_mask(key, build):
    """A block mask built once per ``key`` (shape, device, ...) and shared by every layer and call.

    Build it without a data-dependent ``mask_mod`` (the cache would keep that layer's tensors alive); a caller that
    needs one takes a shallow copy and sets ``mask_mod`` on it. The oldest entry goes when the cache is full.
    """
    mask = _BLOCK_MASKS.get(key)
    if mask is None:
        if len(_BLOCK_MASKS) >= MAX_CACHED_BLOCK_MASKS:
            _BLOCK_MASKS.pop(next(iter(_BLOCK_MASKS)))
        mask = _BLOCK_MASKS[key] = build()
    return mask


def causal_block_mask(tq: int, tk: int, device, block: int = 128):
    """Causal BlockMask for queries at positions [tk - tq, tk) over keys [0, tk), built from block arithmetic (no
    dense mask), with the blocks wholly below the diagonal marked full; cached per shape and shared by layers."""

    def build():
        from torch.nn.attention.flex_attention import BlockMask

        start = tk - tq
        nq, nk = (tq + block - 1) // block, (tk + block - 1) // block
        qb = torch.arange(nq, device=device)
        first = start + qb * block  # first query position of each block
        last = torch.clamp(start + (qb + 1) * block - 1, max=tk - 1)
        n_full = (first + 1) // block  # key blocks ending at or before the first query position
        n_partial = last // block - n_full + 1
        r = torch.arange(nk, device=device)[None, :]
        full_idx = torch.where(r < n_full[:, None], r, 0)
        partial_idx = torch.where(r < n_partial[:, None], n_full[:, None] + r, 0).clamp(max=nk - 1)

        def causal(b, h, q_idx, kv_idx):
            return kv_idx <= q_idx + start

        return BlockMask.from_kv_blocks(
            n_partial[None, None].int(),
            partial_idx[None, None].int(),
            n_full[None, None].int(),
            full_idx[None, None].int(),
            BLOCK_SIZE=block,
            mask_mod=causal,
            seq_lengths=(tq, tk),
        )

    return cached_block_mask(("causal", tq, tk, block, str(device)), build)
