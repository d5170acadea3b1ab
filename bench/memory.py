"""Measuring helpers for the benchmarks: peak memory of a call (CUDA allocator or the CPU resident set), median
timing, and the bytes a KV cache has allocated. See ``bench.attention``'s docstring for the CPU method."""

from __future__ import annotations

import ctypes
import re
import statistics
import sys
import time
from array import array
from collections.abc import Callable
from typing import Any

import torch

from model.attention import KVCache


def fix_malloc_for_rss() -> bool:
    """glibc: every allocation >= 64 KiB gets its own mmap, returned to the system when freed (no dynamic threshold)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(-3, 64 * 1024))  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        match = re.search(rf"^{key}:\s+(\d+)", f.read(), re.M)
    if match is None:  # a kernel without this field: unmeasurable, as an unreadable file is
        raise OSError(f"/proc/self/status has no {key}")
    return int(match.group(1))


class PeakMemory:
    """Peak bytes added during the ``with`` block (see the module docstring); ``peak`` is None where unmeasurable."""

    def __init__(self, device: str):
        self.device = device
        self.peak: int | None = None
        self.base: int | None = None

    def __enter__(self) -> PeakMemory:
        if self.device not in ("cuda", "cpu"):
            return self
        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
            return self
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM to the current VmRSS
            self.base = _status_kib("VmRSS") * 1024
        except OSError:
            self.base = None
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device not in ("cuda", "cpu"):
            return
        if self.device == "cuda":
            torch.cuda.synchronize()
            assert self.base is not None  # set by __enter__ on CUDA
            self.peak = torch.cuda.max_memory_allocated() - self.base
        elif self.base is not None:
            self.peak = max(0, _status_kib("VmHWM") * 1024 - self.base)


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
