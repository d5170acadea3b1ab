"""Peak memory of a block of code: the CUDA allocator's peak, or on the CPU the growth of the process's peak
resident set (Linux ``VmHWM``, reset through ``/proc/self/clear_refs``). ``bench.memory`` (the benchmarks) and the
trainer's per-step measurement (``FOCUSED_PRETRAIN_PEAK_MEMORY``, ``pretrain.loop``) measure the same way."""

from __future__ import annotations

import ctypes
import re

import torch


def fix_malloc_for_rss() -> bool:
    """glibc: every allocation >= 64 KiB gets its own mmap, returned to the system when freed (no dynamic threshold),
    so the resident set follows the live tensors."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(-3, 64 * 1024))  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False


def status_kib(key: str) -> int:
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
            self.base = status_kib("VmRSS") * 1024
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
            self.peak = max(0, status_kib("VmHWM") * 1024 - self.base)
