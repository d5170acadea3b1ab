"""Focus soft mode (training): pairs outside the window get the gate of their assignments. ``cpu`` the blockwise
exact path on the fused CPU kernel (values and gradients, memory O(T * block)); ``triton`` the fused
flash-attention kernels (the GPU form: the gate's gradients reduced per tile); ``flex`` the FlexAttention
``score_mod`` (the GPU form without triton). The dense reference is ``naive.soft_attention``."""

from model.attention.focus.soft.cpu import cpu_soft_attention, soft_dtypes
from model.attention.focus.soft.flex import flex_soft_attention

__all__ = ["cpu_soft_attention", "flex_soft_attention", "soft_dtypes"]
