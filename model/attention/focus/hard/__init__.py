"""Focus hard mode (inference): each token attends its window and the tokens that share one of its
top-k groups. The dense mask (the reference) is ``naive.hard_mask``; ``group_sparse`` holds its exact disjoint
decomposition as batched tensor operations (any device); ``cpu`` the sorted-group decomposition on the fused CPU
kernel (values and gradients) with ``rows`` choosing what one kernel call reads; ``flex`` the CUDA form; ``decode``
the KV-cache step over per-group member lists and ``decode_host`` its CPU assignment on host floats."""

from model.attention.focus.hard.cpu import cpu_hard_attention, cpu_kernel_dtypes
from model.attention.focus.hard.decode import GroupLists, cpu_decode_hard_attention, decode_hard_attention
from model.attention.focus.hard.decode_host import HostDecode
from model.attention.focus.hard.flex import flex_hard_attention
from model.attention.focus.hard.group_sparse import hard_attention

__all__ = [
    "GroupLists",
    "HostDecode",
    "cpu_decode_hard_attention",
    "cpu_hard_attention",
    "cpu_kernel_dtypes",
    "decode_hard_attention",
    "flex_hard_attention",
    "hard_attention",
]
