"""What the variants' Triton kernels share (``lazy/triton.py``, ``focus/soft/triton.py``): whether triton can run,
the interpreter mode, jitting a module's kernel functions once per mode, the small launch helpers, and the launch
parameters per target (issue 47).

Targets. A kernel module answers ``tile_configs(kernel, capability, bd, dtype)``: the ``TileConfig`` candidates in
preference order for one kernel on one compute capability (``None``: the interpreter), from its own per-kernel table
read by ``family_tiles``: one row per target family (``FAMILIES``: sm_80, sm_86-89, sm_90, sm_100+; pre-Ampere has
no row), each sized for the family's opt-in shared memory per block (``FamilyLimits.smem``) and checked there ahead
of time by tests/attention/test_triton_targets.py (every candidate compiled for the family's target, no GPU; the
defaults per target: docs/triton-targets.md).
``launch_tiles`` launches the first candidate the device takes (triton raises ``OutOfResources``, before launching
anything, when a compiled kernel asks for more shared memory than the device's opt-in maximum; the next candidate
is tried) and remembers the choice per (kernel, device, bd, dtype, candidates). ``tiles_unsupported`` says why
nothing would fit (no row for the capability or the head dim, or a device with less shared memory than its family's
row is sized for): the variants' ``triton_supports`` then answer False and the variant takes its FlexAttention /
blockwise path, with one warning (``warn_fallback``). The choice is made in the custom op, outside any traced graph;
the variants' question is a constant to dynamo (``torch.compiler.assume_constant_result``).

``triton`` is imported lazily: the package imports without it. Kernels are plain functions of their module, jitted
on first use over a namespace whose helper names are the jitted helpers of the same mode (``TRITON_INTERPRET=1``
runs them on CPU tensors, the tests; the mode is fixed when a function is jitted).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

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


def acc_dtype(q: Tensor) -> torch.dtype:
    """Accumulators in float32, float64 for float64 inputs (the interpreter tests)."""
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def last_contiguous(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


# ---------------------------------------------------------------------------------------------------------------------
# launch parameters per target (issue 47)


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """A kernel's launch parameters: query rows (``BLOCK_M``) and keys (``BLOCK_N``) per tile, warps,
    software-pipelining stages."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int

    def options(self) -> dict[str, int]:
        """triton's launch options."""
        return {"num_warps": self.num_warps, "num_stages": self.num_stages}


@dataclasses.dataclass(frozen=True)
class FamilyLimits:
    """A target family: its capabilities ``[low, high)``, the opt-in shared memory per block its row is sized for,
    and the capability its row is compiled for ahead of time (tests/attention/test_triton_targets.py compiles 80, 86
    and 90; sm_100+'s is nominal, not compiled there)."""

    name: str
    low: tuple[int, int]
    high: tuple[int, int]
    smem: int
    target: int


FAMILIES = (
    FamilyLimits("sm_80", (8, 0), (8, 1), 166_912, 80),  # A100: 163 KB per block
    FamilyLimits("sm_86-89", (8, 1), (9, 0), 101_376, 86),  # RTX 30xx / 40xx, L4, L40: 99 KB per block
    FamilyLimits("sm_90", (9, 0), (10, 0), 232_448, 90),  # H100 / H200: 227 KB per block
    # B200 has sm_90's 227 KB, RTX 50xx (sm_120) sm_86's 99 KB: the row is sized for the smaller (its first
    # candidates, sm_90's, are taken where they fit)
    FamilyLimits("sm_100+", (10, 0), (99, 0), 101_376, 100),
)
INTERPRETER_TILES = TileConfig(16, 16, 4, 1)  # TRITON_INTERPRET (the tests): small tiles keep the interpreter fast

# A kernel module's table for one family: padded head dim (64 / 128) -> kernel -> candidates, the first the default
KernelRows = Mapping[int, Mapping[str, tuple[TileConfig, ...]]]


def family(cap: tuple[int, int]) -> FamilyLimits | None:
    """The target family of a compute capability; None before Ampere (no bf16 tensor-core dots)."""
    return next((f for f in FAMILIES if f.low <= cap < f.high), None)


def sm100_rows(sm90: KernelRows, sm86: KernelRows) -> dict[int, dict[str, tuple[TileConfig, ...]]]:
    """The sm_100+ row: sm_90's candidates, then sm_86-89's (B200 has sm_90's 227 KB per block, RTX 50xx sm_86's
    99 KB; the launcher takes the first the device has the shared memory for, so the row fits both)."""
    return {bd: {k: tuple(dict.fromkeys(sm90[bd][k] + sm86[bd][k])) for k in sm90[bd]} for bd in sm90}


def family_tiles(
    rows: Mapping[str, KernelRows],
    wide: Mapping[str, tuple[TileConfig, ...]],
    kernel: str,
    cap: tuple[int, int] | None,
    bd: int,
    dtype: torch.dtype,
) -> list[TileConfig]:
    """``kernel``'s candidates from a module's table ``rows`` (family name -> ``KernelRows``, sized for 2-byte
    inputs) for head dim ``bd`` (padded) on ``cap``: the interpreter's small tile for None; none for a capability
    without a family or a head dim over 128 (the caller falls back); ``wide[kernel]`` for float32 / float64 inputs
    (ieee dots on the CUDA cores, tiles of twice the bytes: a correctness path, not a fast one)."""
    if cap is None:
        return [INTERPRETER_TILES]
    fam = family(cap)
    if fam is None or bd > 128:
        return []
    if dtype.itemsize > 2:
        return list(wide[kernel])
    return list(rows[fam.name][64 if bd <= 64 else 128][kernel])


def capability(device: torch.device) -> tuple[int, int] | None:
    """The CUDA compute capability of ``device``; None on CPU and under the interpreter."""
    if device.type != "cuda" or interpreting():
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return int(major), int(minor)


def max_shared_mem(device: torch.device) -> int:
    """The device's opt-in shared memory per block (what triton checks a compiled kernel against)."""
    from triton.runtime import driver

    index = device.index if device.index is not None else torch.cuda.current_device()
    return int(driver.active.utils.get_device_properties(index)["max_shared_mem"])


class NoTileConfig(RuntimeError):
    """Every candidate asked for more than the device has (``tiles_unsupported`` should have said so first)."""


_CHOICES: dict[tuple[Any, ...], TileConfig] = {}
R = TypeVar("R")


def launch_tiles(
    kernel: str,
    device: torch.device,
    bd: int,
    dtype: torch.dtype,
    candidates: Sequence[TileConfig],
    launch: Callable[[TileConfig], R],
) -> R:
    """``launch(config)`` with the first candidate the device takes: a candidate whose compiled kernel asks for more
    shared memory (or threads) than the device has raises triton's ``OutOfResources`` before anything runs, and the
    next is tried. The choice is kept per (kernel, device, bd, dtype, candidates)."""
    key = (kernel, device.type, device.index, bd, dtype, tuple(candidates))
    chosen = _CHOICES.get(key)
    if chosen is not None:
        return launch(chosen)
    if not available() or interpreting():  # the interpreter has no resource limits
        result = launch(candidates[0])
        _CHOICES[key] = candidates[0]
        return result
    from triton.runtime.errors import OutOfResources

    refused = []
    for config in candidates:
        try:
            result = launch(config)
        except OutOfResources as e:
            refused.append(f"{config}: {e}")
            continue
        _CHOICES[key] = config
        return result
    raise NoTileConfig(f"{kernel} at head dim {bd}, {dtype}: no candidate fits {device}: " + "; ".join(refused))


def clear_choices() -> None:
    """Forget the launchers' choices (tests)."""
    _CHOICES.clear()


_UNSUPPORTED: dict[tuple[Any, ...], str | None] = {}


def tiles_unsupported(
    tile_configs: Callable[[str, tuple[int, int] | None, int, torch.dtype], list[TileConfig]],
    kernels: Sequence[str],
    device: torch.device,
    bd: int,
    dtype: torch.dtype,
) -> str | None:
    """Why ``kernels`` (launched with ``tile_configs``' candidates) cannot run on ``device`` at head dim ``bd``, or
    None: a capability or head dim without candidates, or a device with less opt-in shared memory per block than its
    family's row is sized for. Cached per question (one device query per process)."""
    key = (tile_configs, tuple(kernels), device.type, device.index, bd, dtype)
    if key not in _UNSUPPORTED:
        _UNSUPPORTED[key] = _why_not(tile_configs, kernels, device, bd, dtype)
    return _UNSUPPORTED[key]


def _why_not(
    tile_configs: Callable[[str, tuple[int, int] | None, int, torch.dtype], list[TileConfig]],
    kernels: Sequence[str],
    device: torch.device,
    bd: int,
    dtype: torch.dtype,
) -> str | None:
    cap = capability(device)
    if cap is None:
        return None
    missing = [k for k in kernels if not tile_configs(k, cap, bd, dtype)]
    if missing:
        return f"no tile configuration for sm_{cap[0]}{cap[1]} at head dim {bd} ({', '.join(missing)})"
    fam = family(cap)
    smem = max_shared_mem(device)
    if fam is not None and smem < fam.smem:
        return f"sm_{cap[0]}{cap[1]} offers {smem} B of shared memory per block, its tiles are sized for {fam.smem} B"
    return None


def forget_support() -> None:
    """Forget ``tiles_unsupported``'s answers (tests)."""
    _UNSUPPORTED.clear()


@torch.compiler.assume_constant_result  # a constant to dynamo: the variants ask it inside compiled blocks
def triton_fits(
    tile_configs: Callable[[str, tuple[int, int] | None, int, torch.dtype], list[TileConfig]],
    kernels: tuple[str, ...],
    device: torch.device,
    head_dim: int,
    dtype: torch.dtype,
    what: str,
    fallback: str,
) -> bool:
    """Whether ``kernels`` have tiles that fit ``device`` at ``head_dim`` (``tiles_unsupported``); where they do not,
    one warning that ``what`` takes ``fallback`` instead."""
    reason = tiles_unsupported(tile_configs, kernels, device, padded(head_dim), dtype)
    if reason is not None:
        warn_fallback(what, reason, fallback)
    return reason is None


_WARNED: set[str] = set()


def warn_fallback(what: str, reason: str, fallback: str) -> None:
    """One warning line per process and reason: ``what`` falls back to ``fallback``."""
    line = f"{what}: the Triton kernels do not run here ({reason}); using {fallback}"
    if line not in _WARNED:
        _WARNED.add(line)
        warnings.warn(line, RuntimeWarning, stacklevel=3)
