"""The torch APIs this project uses that are newer than the oldest torch it runs on, each with its fallback.

The GPU machines run a fixed image (torch 2.11, Python 3.12) while the pinned CPU build is newer; a symbol that a
later torch added or renamed is imported here, once, with the older spelling as the fallback, so that every module
imports on both. ``POST_2_11`` names each guarded symbol (module, attribute): tests/test_torch_compat.py imports
every package with each of them removed from torch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from torch.distributed import _functional_collectives as _fc
from torch.distributed.tensor import _redistribute

# torch >= 2.12 names the autograd all-gather all_gather_single_autograd; torch 2.11 has the same collective (an
# all_gather_single whose backward is a reduce_scatter) as all_gather_tensor_autograd
all_gather_single_autograd: Callable[..., Any] = (
    getattr(_fc, "all_gather_single_autograd", None) or _fc.all_gather_tensor_autograd
)

# a newer DTensor merges consecutive same-type collectives of a redistribute (and warns where it cannot); this context
# turns that pass off. Whether the GPU image's torch 2.11 has it is unchecked; without it there is no pass to skip
disable_redistribute_transform_optimization: Callable[..., Any] = (
    getattr(_redistribute, "disable_redistribute_transform_optimization", None) or contextlib.nullcontext
)

POST_2_11: tuple[tuple[str, str], ...] = (
    ("torch.distributed._functional_collectives", "all_gather_single_autograd"),
    ("torch.distributed.tensor._redistribute", "disable_redistribute_transform_optimization"),
)

__all__ = ["POST_2_11", "all_gather_single_autograd", "disable_redistribute_transform_optimization"]
