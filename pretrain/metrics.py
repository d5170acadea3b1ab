"""Throughput, MFU and memory figures for the step log."""

from __future__ import annotations

import resource
import sys

import torch

# Dense bf16 peak FLOP/s (no sparsity) by device-name substring, first match wins (so the H100 PCIe and NVL
# come before the SXM's plain "H100"); the values torchtitan's get_peak_flops uses where it lists the device.
# MFU is omitted where the device is unknown (torchtitan would assume an A100).
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("H100 NVL", 835e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),  # SXM ("NVIDIA H100 80GB HBM3")
    ("H200", 989e12),
    ("B200", 2.25e15),
    ("A100", 312e12),
    ("MI300X", 1300e12),
    ("MI325X", 1300e12),
    ("MI250X", 191.5e12),
    ("L40S", 362e12),
    ("A10G", 125e12),
    ("L4", 121e12),
    ("4090", 165e12),
)


def peak_flops_for_name(name: str) -> float | None:
    """The dense bf16 peak of a device named ``name`` (``torch.cuda.get_device_name``), None if unknown."""
    return next((value for key, value in PEAK_BF16_FLOPS if key in name), None)


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    return peak_flops_for_name(torch.cuda.get_device_name(device))


def memory_gib(device: torch.device) -> float:
    """Peak accelerator memory allocated, or the process's peak resident set on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1024**3
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (1024**3 if sys.platform == "darwin" else 1024**2)
