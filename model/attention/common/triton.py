"""What the variants' Triton kernels share (``lazy/triton.py``, ``focus/soft/triton.py``): whether triton can run,
the interpreter mode, jitting a module's kernel functions once per mode, and the small launch helpers.

``triton`` is imported lazily: the package imports without it. Kernels are plain functions of their module, jitted
on first use over a namespace whose helper names are the jitted helpers of the same mode (``TRITON_INTERPRET=1``
runs them on CPU tensors, the tests; the mode is fixed when a function is jitted).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

_AVAILABLE = importlib.util.find_spec("triton") is not None  # once: a compiled block's trace reads it


def available() -> bool:
    return _AVAILABLE


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def jit_kernels(namespace: Mapping[str, Any], names: tuple[str, ...], cache: dict[bool, dict[str, Any]]) -> dict:
    """``names`` of ``namespace`` (a kernel module's globals), jitted once per interpreter mode into ``cache``."""
    mode = interpreting()
    if mode not in cache:
        import triton

        jitted = {}
        scope = dict(namespace)
        for name in names:
            fn = namespace[name]
            # a fresh function over a namespace whose helper names are the jitted helpers of this mode
            copy = type(fn)(fn.__code__, scope, name, fn.__defaults__, fn.__closure__)
            copy.__annotations__ = fn.__annotations__
            copy.__module__, copy.__qualname__, copy.__doc__ = fn.__module__, fn.__qualname__, fn.__doc__
            jitted[name] = scope[name] = triton.jit(copy)
        cache[mode] = jitted
    return cache[mode]


def padded(n: int) -> int:
    """A tile dimension for ``n``: the next power of two, at least 16 (``tl.dot``'s minimum)."""
    return max(16, 1 << (n - 1).bit_length())


def strides(*tensors: Tensor) -> list[int]:
    """The first three strides of each tensor ([B, H, T, ...] layouts), as kernel arguments."""
    return [s for t in tensors for s in t.stride()[:3]]


def precision(q: Tensor) -> str:
    """``ieee`` dots for float32 / float64 inputs; bf16 / fp16 inputs use the tensor cores as they are."""
    return "ieee" if q.dtype in (torch.float32, torch.float64) else "tf32"


def warps(bd: int) -> int:
    return 4 if bd <= 64 else 8  # registers for [BLOCK, 128] float32 accumulators; to tune on the GPU


def acc_dtype(q: Tensor) -> torch.dtype:
    """Accumulators in float32, float64 for float64 inputs (the interpreter tests)."""
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def last_contiguous(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()
