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
