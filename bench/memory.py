"""Measuring helpers for the benchmarks: peak memory of a call (CUDA allocator or the CPU resident set: ``PeakMemory``,
from ``core.memory``, which the trainer shares), median timing, and the bytes a KV cache has allocated. See
``bench.attention``'s docstring for the CPU method."""

from __future__ import annotations

import statistics
import sys
import time
from array import array
from collections.abc import Callable
from typing import Any

import torch

from core.memory import PeakMemory, fix_malloc_for_rss
from model.attention import KVCache

__all__ = ["PeakMemory", "cache_nbytes", "fix_malloc_for_rss", "measure"]


def measure(fn: Callable[[], Any], device: str, repeat: int) -> tuple[float, int | None]:
    """(median seconds of ``repeat`` runs after one warm-up, peak bytes on CUDA; None on CPU, see ``cpu_peaks``)."""
    fn()
    times, peaks = [], []
    for _ in range(repeat):
        with PeakMemory(device if device == "cuda" else "none") as mem:
            t0 = time.perf_counter()
            fn()
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        peaks.append(mem.peak)
    measured = [p for p in peaks if p is not None]
    return statistics.median(times), (None if len(measured) < len(peaks) else int(statistics.median(measured)))


def cache_nbytes(cache: KVCache) -> int:
    """Bytes of every storage reachable from a layer's cache (raw keys / values and ``extra``: tensors, containers and
    objects' attributes), each storage once: what the cache has allocated, capacity included."""
    seen: dict[int, int] = {}
    visited: set[int] = set()

    def visit(x: object) -> None:
        if isinstance(x, torch.Tensor):
            storage = x.untyped_storage()
            seen[storage.data_ptr() or id(storage)] = storage.nbytes()
        elif isinstance(x, array):  # host-side int arrays (Focus's group member lists): their buffer, capacity included
            seen[id(x)] = sys.getsizeof(x)
        elif id(x) in visited:
            return
        elif isinstance(x, dict):
            visited.add(id(x))
            for value in x.values():
                visit(value)
        elif isinstance(x, list | tuple):
            visited.add(id(x))
            for value in x:
                visit(value)
        elif hasattr(x, "__dict__"):
            visited.add(id(x))
            visit(vars(x))

    visit([cache.k, cache.v, cache.extra])
    return sum(seen.values())
