"""Focus hard mode (inference): each token attends its window and the tokens that share one of its
top-k groups. The dense mask (the reference) is ``naive.hard_mask``; ``group_sparse`` holds its exact disjoint
decomposition as batched tensor operations (any device); ``cpu`` the sorted-group decomposition on the fused CPU
kernel (values and gradients) with ``rows`` choosing what one kernel call reads; ``flex`` the CUDA form; ``decode``
the CPU's KV-cache step over per-group member lists and ``decode_host`` its assignment on host floats;
``decode_device`` the GPU's step (static shapes, no host synchronisation) over the group page tables of
``decode_pages``, its attention the split-KV kernel of ``decode_triton`` on CUDA."""

from model.attention.focus.hard.cpu import cpu_hard_attention, cpu_kernel_dtypes
from model.attention.focus.hard.decode import GroupLists, cpu_decode_hard_attention, decode_hard_attention
from model.attention.focus.hard.decode_device import device_decode_step
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
    "device_decode_step",
    "flex_hard_attention",
    "hard_attention",
]
