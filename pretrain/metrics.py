"""Throughput, MFU and memory figures for the step log."""

from __future__ import annotations

import resource
import sys

import torch

# Dense bf16 peak FLOP/s (no sparsity) by device-name substring; MFU is omitted where unknown.
PEAK_BF16_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "A10G": 125e12,
    "L40S": 362e12,
    "L4": 121e12,
    "4090": 165e12,
    "V100": 125e12,
}


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, value in PEAK_BF16_FLOPS.items():
        if key in name:
            return value
    return None


def memory_gib(device: torch.device) -> float:
    """Peak accelerator memory allocated, or the process's peak resident set on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1024**3
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (1024**3 if sys.platform == "darwin" else 1024**2)
