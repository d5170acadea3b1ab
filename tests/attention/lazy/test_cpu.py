"""Lazy attention's blockwise CPU path (model/attention/lazy/cpu.py) against the dense reference: values and
gradients (q, k, v, distance-bias table, tau), float64 within 1e-10 and float32 within 1e-5, on inputs from a fixed
seed list; causal, chunked prefill, GQA, batch 2, T not a multiple of the block; and no T x T tensor anywhere."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from model.attention import LayerSpec, build_attention
from model.attention.lazy import LazyAttention, LazyConfig, cpu, naive

SEEDS = (0, 1, 2)
TAUS = {
    "negative": [-1.0, -0.5, -2.0, -0.05],
    "mixed": [-1.0, 0.7, -0.3, 1.0],  # 1.0: the first query's only weight sits exactly on the threshold
    "positive": [1.0, 0.4, 0.05, 2.0],
    "large": [30.0, 8.0, 50.0, 12.0],  # most weights are zero
}
F64 = dict(atol=1e-10, rtol=1e-10)
F32 = dict(atol=1e-5, rtol=1e-5)


def lazy_module(tau, *, seed: int, max_distance: int = 16, bias_init: str = "zeros", dtype=torch.float64):
    spec = LayerSpec(32, 4, 2, 8, max_seq_len=512, layer_idx=0, n_layers=1)
    module = build_attention("lazy", LazyConfig(max_distance=max_distance, bias_init=bias_init), spec)
    with torch.no_grad():
        if bias_init == "zeros":
            module.distance_bias.normal_(0, 2.0, generator=torch.Generator().manual_seed(100 + seed))
        module.tau.copy_(torch.tensor(tau))
    return module.to(dtype)


def qkv(t: int, seed: int, dtype, batch: int = 2, q_scale: float = 4.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, 4, t, 8, generator=g, dtype=torch.float64) * q_scale
    k, v = (torch.randn(batch, 2, t, 8, generator=g, dtype=torch.float64) for _ in range(2))
    return q.to(dtype), k.to(dtype), v.to(dtype)


def both_paths(module: LazyAttention, q, k, v, q_from: int, block: int):
    """Outputs and gradients (q, k, v, bias table, tau) of the blockwise path and the reference (``naive.py``)."""
    tk = k.shape[2]
    q = q[:, :, q_from:]
    q_pos, k_pos = torch.arange(q_from, tk), torch.arange(tk)
    w = torch.randn(q.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64).to(q.dtype)
    results = []
    for path in ("blockwise", "reference"):
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        module.zero_grad()
        if path == "blockwise":
            out = cpu.elastic_blockwise(
                *leaves, module.distance_bias, module.tau, 1.0 / math.sqrt(q.shape[-1]), block=block
            )
        else:  # the dense reference as plain functions (what the module's reference path calls)
            out = naive.attention(
                *leaves, q_pos, k_pos, module.distance_bias, module.tau, 1.0 / math.sqrt(q.shape[-1]), module.table - 1
            )
        (out * w).sum().backward()
        grads = [x.grad for x in leaves] + [module.distance_bias.grad.clone(), module.tau.grad.clone()]
        results.append((out.detach(), grads))
    return results


def assert_paths_equal(results, tol):
    (out, grads), (ref, ref_grads) = results
    assert ref.abs().max() > 0
    torch.testing.assert_close(out, ref, **tol)
    for name, got, want in zip(("q", "k", "v", "distance_bias", "tau"), grads, ref_grads):
        torch.testing.assert_close(got, want, **tol, msg=lambda m, name=name: f"grad {name}: {m}")


SHAPES = [(37, 0, 8), (40, 0, 10), (37, 0, 37), (37, 21, 8), (37, 25, 5), (70, 0, 16)]
SHAPE_IDS = ["37-block8", "40-block10-divides", "37-one-block", "37-chunk-block8", "37-chunk-block5", "70-block16"]


@pytest.mark.parametrize("taus", list(TAUS))
@pytest.mark.parametrize("seed,t,q_from,block", [(SEEDS[i % 3], *s) for i, s in enumerate(SHAPES)], ids=SHAPE_IDS)
def test_blockwise_equals_the_reference_in_float64(seed, taus, t, q_from, block):
    """Training (q_from = 0) and chunked prefill (queries q_from.. on the t keys), blocks that divide T and that do
    not; the bias table (16) is shorter than most contexts: distances past it read its last entry."""
    module = lazy_module(TAUS[taus], seed=seed)
    assert_paths_equal(both_paths(module, *qkv(t, seed, torch.float64), q_from, block), F64)


@pytest.mark.parametrize("seed,bias_init,max_distance", [(0, "alibi", 0), (1, "alibi", 9), (2, "zeros", 0)])
def test_blockwise_with_alibi_and_table_lengths(seed, bias_init, max_distance):
    """ALiBi slopes or a random (as if learned) table, longer than the context (0: model.max_seq_len) or shorter."""
    module = lazy_module(TAUS["mixed"], seed=seed, max_distance=max_distance, bias_init=bias_init)
    assert_paths_equal(both_paths(module, *qkv(53, seed, torch.float64), 0, 12), F64)


def test_large_tau_zeroes_most_weights_and_still_matches():
    module = lazy_module(TAUS["large"], seed=0)
    q, k, v = qkv(60, 0, torch.float64)
    positions = torch.arange(60)
    a = module.weights(q, k, positions, positions)
    assert (a == 0).double().mean() > 0.9
    assert_paths_equal(both_paths(module, q, k, v, 0, 16), F64)


@pytest.mark.parametrize("seed", SEEDS)
def test_blockwise_in_float32(seed):
    module = lazy_module(TAUS["mixed"], seed=seed, dtype=torch.float32)
    assert_paths_equal(both_paths(module, *qkv(70, seed, torch.float32, q_scale=2.0), 6, 16), F32)


def test_bf16_autocast_trains_through_the_blockwise_path():
    """Under CPU autocast the projections give bf16 q, k, v: computed in float32, returned in bf16 with bf16
    gradients, close to the reference run in float32 on the same rounded inputs."""
    module = lazy_module(TAUS["mixed"], seed=0, dtype=torch.float32)
    q, k, v = (x.to(torch.bfloat16) for x in qkv(40, 0, torch.float64, q_scale=2.0))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = module(*leaves, hidden=None, positions=torch.arange(40)).output
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert all(x.grad.dtype == torch.bfloat16 for x in leaves) and module.tau.grad.dtype == torch.float32
    ref = module.reference(
        *(x.float() for x in (q, k, v)), hidden=None, q_pos=torch.arange(40), k_pos=torch.arange(40), cache=None
    )
    torch.testing.assert_close(out.float(), ref.output, atol=2e-2, rtol=2e-2)


def test_cpu_picks_the_blockwise_path_and_impl_reference_forces_the_dense_one(monkeypatch):
    module = lazy_module(TAUS["mixed"], seed=0)
    q, k, v = qkv(20, 0, torch.float64)
    assert module.has_fast_path(q, None) and not module.has_fast_path(q[:, :, :1], None)  # decode: reference
    calls = []
    original = cpu.ElasticBlockwise.apply
    monkeypatch.setattr(cpu.ElasticBlockwise, "apply", lambda *a: calls.append(1) or original(*a))
    module(q, k, v, hidden=None, positions=torch.arange(20))
    assert calls == [1]
    module.impl = "reference"
    module(q, k, v, hidden=None, positions=torch.arange(20))
    assert calls == [1]


def test_fast_path_statistics_equal_the_dense_weights():
    """Sink ratio (weight on key 0) and density (on the others), as training logs them (attn/lazy/*)."""
    module = lazy_module(TAUS["mixed"], seed=1)
    module.collect_stats = True
    q, k, v = qkv(45, 1, torch.float64)
    positions = torch.arange(45)
    stats = module(q, k, v, hidden=None, positions=positions).stats
    a = module.weights(q, k, positions, positions)
    assert set(stats) == {"sink_ratio", "density", "tau"}
    torch.testing.assert_close(stats["sink_ratio"], a[..., 0].mean(), **F64)
    torch.testing.assert_close(stats["density"], a[..., 1:].sum(-1).mean(), **F64)


class LargestTensor(TorchDispatchMode):
    """The largest number of elements of any tensor an aten op returns."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(
        self, func: Callable[..., object], types: object, args: tuple = (), kwargs: dict | None = None
    ) -> object:
        out = func(*args, **(kwargs or {}))
        for x in out if isinstance(out, tuple | list) else (out,):
            if isinstance(x, torch.Tensor):
                self.largest = max(self.largest, x.numel())
        return out


@pytest.mark.slow  # the dispatch mode's first use costs seconds
def test_no_tensor_grows_with_t_squared(monkeypatch):
    """Forward and backward at T = 256 with 32-row blocks and small chunks: every tensor stays within
    O(T * (D + block)) elements per (batch, head), far below one T x T score matrix."""
    monkeypatch.setattr(cpu, "CHUNK_ELEMENTS", 1 << 13)
    t, batch, heads = 256, 1, 4
    module = lazy_module(TAUS["mixed"], seed=0, max_distance=0, dtype=torch.float32)
    q, k, v = (x.requires_grad_() for x in qkv(t, 0, torch.float32, batch=batch))
    with LargestTensor() as seen:
        out = cpu.elastic_blockwise(q, k, v, module.distance_bias, module.tau, 0.125, block=32)
        out.sum().backward()
    assert seen.largest <= batch * heads * t * 8 < batch * heads * t * t // 16, seen.largest
