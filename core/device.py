"""Device and autocast dtype from the config's names (``auto`` picks CUDA when present)."""

from __future__ import annotations

import torch

from core.errors import ConfigError

SUPPORTED_TYPES = ("cpu", "cuda", "mps")


def available_devices() -> list[str]:
    """The device names this machine can run on, for error messages: auto, cpu, cuda, cuda:0 ..."""
    names = ["auto", "cpu"]
    if torch.cuda.is_available():
        names += ["cuda", *(f"cuda:{i}" for i in range(torch.cuda.device_count()))]
    if torch.backends.mps.is_available():
        names.append("mps")
    return names


def _parse(name: str) -> tuple[torch.device | None, str]:
    """(the device, "") or (None, what is wrong with the name)."""
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError, ValueError):
        return None, "is not a device name"
    if device.type not in SUPPORTED_TYPES:
        return None, "is not supported"
    return device, ""


def check_device_name(name: str, *, key: str = "train.device") -> None:
    """``name`` is ``auto`` or a device name of a supported type (cpu, cuda, cuda:N, mps), whether or
    not this machine has it: what config validation can check on a login node without GPUs."""
    if name != "auto":
        device, problem = _parse(name)
        if device is None:
            raise ConfigError(f"{key}: {name!r} {problem}; allowed: auto, cpu, cuda, cuda:N, mps")


def resolve_device(name: str, *, key: str = "train.device") -> torch.device:
    """``name`` as a device present on this machine; anything else is a one-line ``ConfigError``
    naming ``key`` (the option the name came from) and the devices that are available."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    available = ", ".join(available_devices())
    device, problem = _parse(name)
    if device is None:
        raise ConfigError(f"{key}: {name!r} {problem}; available here: {available}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"{key}: {name!r}: CUDA is not available on this machine; available here: {available}")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(
                f"{key}: {name!r}: this machine has {torch.cuda.device_count()} CUDA device(s); "
                f"available here: {available}"
            )
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"{key}: {name!r}: MPS is not available on this machine; available here: {available}")
    return device


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """None = full fp32. ``auto`` is bf16 autocast on CUDA and fp32 on CPU."""
    if precision == "bf16" or (precision == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return None
