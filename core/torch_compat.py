"""The torch APIs this project uses that are newer than the oldest torch it runs on, each with its fallback.

The GPU machines run a fixed image (torch 2.11, Python 3.12) while the pinned CPU build is newer; a symbol that a
later torch added or renamed is imported here, once, with the older spelling as the fallback, so that every module
imports on both. ``POST_2_11`` names each guarded symbol (module, attribute): tests/test_torch_compat.py
imports every package with each of them removed from torch.
"""

from __future__ import annotations

try:  # torch >= 2.12: the autograd all-gather under its current name
    from torch.distributed._functional_collectives import all_gather_single_autograd
except ImportError:  # torch 2.11: the same collective (all_gather_single with a backward of reduce_scatter)
    from torch.distributed._functional_collectives import (  # type: ignore[no-redef]  # older name, same signature
        all_gather_tensor_autograd as all_gather_single_autograd,
    )

POST_2_11: tuple[tuple[str, str], ...] = (("torch.distributed._functional_collectives", "all_gather_single_autograd"),)

__all__ = ["POST_2_11", "all_gather_single_autograd"]
