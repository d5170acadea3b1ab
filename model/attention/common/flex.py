"""FlexAttention access shared by the variants' fast paths."""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Hashable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import Tensor

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

T = TypeVar("T")

MIN_HEAD_DIM = 16  # FlexAttention's compiled kernels need a head dimension of at least 16


def flex_available() -> bool:
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


_FORCED = False  # gpu_paths_forced(): the CPU compile-clean tests take the GPU paths (FlexAttention, eager)


@contextlib.contextmanager
def gpu_paths_forced() -> Iterator[None]:
    """Within it ``flex_supports`` answers as on CUDA for CPU tensors too, so a CPU test traces a variant's GPU path
    (FlexAttention runs eagerly on CPU: ``flex_attention_fn`` compiles only CUDA calls). Tests only."""
    global _FORCED
    before, _FORCED = _FORCED, True
    try:
        yield
    finally:
        _FORCED = before


def gpu_paths_active(x: torch.Tensor) -> bool:
    """Whether a forward on ``x`` takes the variants' GPU paths: on CUDA, or on CPU inside ``gpu_paths_forced``."""
    return x.is_cuda or _FORCED


def flex_supports(q: torch.Tensor) -> bool:
    """Whether a variant's compiled FlexAttention path can take these queries (CUDA, head_dim >= 16); otherwise the
    variant takes its reference path. A variant chooses its GPU path through this (not ``q.is_cuda``), so that
    ``gpu_paths_forced`` reaches it."""
    return (q.is_cuda or _FORCED) and q.shape[-1] >= MIN_HEAD_DIM and flex_available()


_COMPILED: dict[str, Callable[..., Any]] = {}


def _flex_call(*args: Any, **kwargs: Any) -> Any:
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention(*args, **kwargs)


def flex_attention_fn(compiled: bool, site: str) -> Callable[..., Any]:
    """FlexAttention, compiled on CUDA (the fused kernel); eager elsewhere (a dense fallback used by tests).

    Called eagerly on CUDA: one compiled function per call ``site``, with dynamic shapes: dynamo's recompile budget
    (8) is per code object, and a single shared wrapper compiled per length ran out across call sites, grad modes and
    lengths, after which dynamo runs FlexAttention eagerly (dense T x T scores: 64 GiB at T = 65,536). So each site
    gets its own copy of the caller's code object. Called while torch.compile traces (a compiled transformer block):
    plain ``flex_attention``, which the enclosing graph compiles into its fused kernel; building the per-site function
    there is a graph break (dynamo cannot trace ``FunctionType``), which split every compiled block on the GPU
    (tests/attention/test_compiled_block.py holds the traced case)."""
    from torch.nn.attention.flex_attention import flex_attention

    if not compiled or torch.compiler.is_compiling():
        return flex_attention
    fn = _COMPILED.get(site)
    if fn is None:
        code = _flex_call.__code__.replace(co_name=f"flex_{site}")
        caller = types.FunctionType(code, _flex_call.__globals__, f"flex_{site}")
        fn = _COMPILED[site] = torch.compile(caller, dynamic=True)
    return fn


_CACHE: dict[Hashable, Any] = {}
MAX_CACHED_BLOCK_MASKS = 64


def cached_structure(key: Hashable, build: Callable[[], T]) -> T:
    """A shape-only structure (a block mask, or the tensors of one) built once per ``key`` (shape, device, ...) and
    shared by every layer and call; built afresh while torch.compile traces (a dict keyed by the lengths would
    specialise them: a recompile each), so a compiled function takes such a structure as an input instead. The
    oldest entry goes when the cache is full."""
    if torch.compiler.is_compiling():
        return build()
    value = _CACHE.get(key)
    if value is None:
        if len(_CACHE) >= MAX_CACHED_BLOCK_MASKS:
            _CACHE.pop(next(iter(_CACHE)))
        value = _CACHE[key] = build()
    return value


def cached_block_mask(key: Hashable, build: Callable[[], BlockMask]) -> BlockMask:
    """A block mask built once per ``key`` (``cached_structure``).

    Build it without a data-dependent ``mask_mod`` (the cache would keep that layer's tensors alive); a caller that
    needs one takes a shallow copy and sets ``mask_mod`` on it.
    """
    return cached_structure(key, build)


def causal_block_mask(tq: int, tk: int, device: torch.device | str, block: int = 128) -> BlockMask:
    """Causal BlockMask for queries at positions [tk - tq, tk) over keys [0, tk), built from block arithmetic (no
    dense mask), with the blocks wholly below the diagonal marked full; cached per shape and shared by layers."""

    def build() -> BlockMask:
        from torch.nn.attention.flex_attention import BlockMask

        start = tk - tq
        nq, nk = (tq + block - 1) // block, (tk + block - 1) // block
        qb = torch.arange(nq, device=device)
        first = start + qb * block  # first query position of each block
        last = torch.clamp(start + (qb + 1) * block - 1, max=tk - 1)
        n_full = (first + 1) // block  # key blocks ending at or before the first query position
        n_partial = last // block - n_full + 1
        r = torch.arange(nk, device=device)[None, :]
        full_idx = torch.where(r < n_full[:, None], r, 0)
        partial_idx = torch.where(r < n_partial[:, None], n_full[:, None] + r, 0).clamp(max=nk - 1)

        def causal(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return kv_idx <= q_idx + start

        return BlockMask.from_kv_blocks(
            n_partial[None, None].int(),
            partial_idx[None, None].int(),
            n_full[None, None].int(),
            full_idx[None, None].int(),
            BLOCK_SIZE=block,
            mask_mod=causal,
            seq_lengths=(tq, tk),
        )

    return cached_block_mask(("causal", tq, tk, block, str(device)), build)
