"""``LazyAttention``, the module: the distance-bias table and tau as parameters, and the choice of path.

- ``reference``: the dense weights (``naive.py``); decode and chunks shorter than ``MIN_ROWS`` take it on CPU.
- CPU fast path (``cpu.py``): the same two passes over block diagonals of the score matrix with a recomputing
  backward (a ``torch.autograd.Function``), exact, memory linear in T; from ``MIN_ROWS`` queries (training, prefill,
  chunked prefill); decode and shorter chunks take the reference, which is O(Tq * Tk) there. Sink ratio and density
  come from its weights (a row sum per block, on logging steps).
- Triton fast path (``triton.py``): fused forward and backward kernels, on CUDA where triton imports.
- FlexAttention path (``flex.py``): two FlexAttention passes, on CUDA without triton, and wherever
  ``gpu_paths_forced()`` sends CPU tensors (the compile tests trace it: the Triton path takes CUDA tensors only).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from model.attention.common import reference as ref
from model.attention.common.base import Attention, AttnOut, KVCache, LayerSpec
from model.attention.common.flex import flex_supports
from model.attention.common.triton import triton_fits
from model.attention.lazy import naive
from model.attention.lazy import triton as lazy_triton
from model.attention.lazy.config import LazyConfig, alibi_slopes
from model.attention.lazy.cpu import MIN_ROWS, elastic_blockwise, kernel_dtypes
from model.attention.lazy.flex import elastic_flex


class LazyAttention(Attention):
    description = "Lazy attention: distance bias + Elastic-Softmax; a large RoPE base, as the paper trains with"

    @classmethod
    def launch_overrides(cls, family: str) -> dict[str, Any]:
        return {"model.rope.theta": 500000.0} if family == "llama" else {}

    no_weight_decay = ("distance_bias", "tau")

    @classmethod
    def attention_ops(cls) -> tuple[Any, ...]:
        """The fused Triton forward too: selective activation checkpointing keeps its outputs."""
        return (*super().attention_ops(), torch.ops.lazy_triton.forward.default)

    def __init__(self, cfg: LazyConfig, spec: LayerSpec):
        super().__init__(cfg, spec)
        self.table = cfg.max_distance or spec.max_seq_len
        self.distance_bias = nn.Parameter(torch.zeros(spec.n_heads, self.table))
        self.tau = nn.Parameter(torch.full((spec.n_heads,), float(cfg.tau_init)))
        self.reset_parameters()

    def head_sharded_parameters(self) -> dict[str, int]:
        return {"distance_bias": 0, "tau": 0}  # one row per head: split with the heads under tensor parallelism

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.tau.fill_(float(self.cfg.tau_init))
            if self.cfg.bias_init == "alibi":
                distances = torch.arange(self.table, dtype=torch.float32, device=self.distance_bias.device)
                self.distance_bias.copy_(alibi_slopes(self.spec.n_heads).to(distances.device)[:, None] * distances)
            else:
                self.distance_bias.zero_()

    def bias(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """[H, Tq, Tk] bias for each query/key distance, clamped to the table."""
        return naive.bias(q_pos, k_pos, self.distance_bias, self.table - 1)

    def weights(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """Elastic-Softmax weights [B, H, Tq, Tk], dense."""
        scale = 1.0 / math.sqrt(self.spec.head_dim)
        return naive.weights(q, k, q_pos, k_pos, self.distance_bias, self.tau, scale, self.table - 1)

    def reference(
        self, q: Tensor, k: Tensor, v: Tensor, *, hidden: Tensor, q_pos: Tensor, k_pos: Tensor, cache: KVCache | None
    ) -> AttnOut:
        a = self.weights(q, k, q_pos, k_pos)
        stats: dict[str, Tensor] = {}
        if self.collect_stats:
            stats = {**ref.sink_and_density(a, k_pos), "tau": self.tau.mean().detach()}
        return AttnOut(ref.weighted_values(a, v, q.dtype), stats=stats)

    def has_fast_path(self, q: Tensor, cache: KVCache | None) -> bool:
        return self.triton_supports(q) or flex_supports(q) or self.blockwise_supports(q)

    @staticmethod
    def triton_supports(q: Tensor) -> bool:
        """CUDA tensors where triton imports (``triton.py``) and its kernels have tiles that fit the device at this
        head dim (else FlexAttention, with one warning: ``common/triton.py``); CPU tensors never, also under
        ``gpu_paths_forced``."""
        if not (q.is_cuda and q.dtype in kernel_dtypes() and lazy_triton.available()):
            return False
        kernels = lazy_triton._LAUNCHED
        return triton_fits(lazy_triton.tile_configs, kernels, q.device, q.shape[-1], q.dtype, "lazy", "FlexAttention")

    @staticmethod
    def blockwise_supports(q: Tensor) -> bool:
        """CPU, from MIN_ROWS queries (decode and short chunks take the reference: O(Tq * Tk) is small there)."""
        # not while torch.compile traces (compile on CPU: the dense reference, as before the blockwise path)
        cpu = q.device.type == "cpu" and not torch.compiler.is_compiling()
        return cpu and q.dtype in kernel_dtypes() and q.shape[2] >= MIN_ROWS

    def fast(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        hidden: Tensor | None,
        q_pos: Tensor,
        k_pos: Tensor,
        cache: KVCache | None,
    ) -> AttnOut:
        """Queries are at positions ``Tk - Tq .. Tk - 1`` and keys at ``0 .. Tk - 1``, which is what the base
        class passes (training, prefill, decode): the Triton kernels on CUDA, else two FlexAttention passes where
        ``flex_supports`` (CUDA without triton; CPU tensors under ``gpu_paths_forced``), else blockwise on CPU."""
        if self.triton_supports(q):
            return self.triton(q, k, v, hidden=hidden, q_pos=q_pos, k_pos=k_pos, cache=cache)
        if flex_supports(q):  # first: gpu_paths_forced() traces the GPU path on CPU tensors
            return self.flex(q, k, v, hidden=hidden, q_pos=q_pos, k_pos=k_pos, cache=cache)
        return self.blockwise(q, k, v, hidden=hidden, q_pos=q_pos, k_pos=k_pos, cache=cache)

    def blockwise(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        hidden: Tensor | None,
        q_pos: Tensor,
        k_pos: Tensor,
        cache: KVCache | None,
    ) -> AttnOut:
        """Exact two-pass Elastic-Softmax over block diagonals, memory linear in T (``cpu.py``)."""
        stats: dict[str, Tensor] | None = {} if self.collect_stats else None
        out = elastic_blockwise(q, k, v, self.distance_bias, self.tau, 1.0 / math.sqrt(self.spec.head_dim), stats=stats)
        if stats is not None:
            stats = {name: value.detach() for name, value in stats.items()} | {"tau": self.tau.mean().detach()}
        return AttnOut(out, stats=stats or {})

    def flex(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        hidden: Tensor | None,
        q_pos: Tensor,
        k_pos: Tensor,
        cache: KVCache | None,
    ) -> AttnOut:
        """Two FlexAttention passes (``flex.py``)."""
        scale = 1.0 / math.sqrt(self.spec.head_dim)
        out = elastic_flex(q, k, v, self.distance_bias, self.tau, q_pos, scale, self.table - 1)
        # sink ratio and density need the dense weights: the reference path and eval.run attention_stats give them
        stats = {"tau": self.tau.mean().detach()} if self.collect_stats else {}
        return AttnOut(out, stats=stats)

    def triton(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        hidden: Tensor | None,
        q_pos: Tensor,
        k_pos: Tensor,
        cache: KVCache | None,
    ) -> AttnOut:
        """Fused Triton kernels, forward and backward (``triton.py``); queries at ``Tk - Tq .. Tk - 1``."""
        scale = 1.0 / math.sqrt(self.spec.head_dim)
        out = lazy_triton.elastic_triton(q, k, v, self.distance_bias, self.tau, scale, self.table - 1)
        stats = {"tau": self.tau.mean().detach()} if self.collect_stats else {}
        return AttnOut(out, stats=stats)
