"""Shared inputs and builders of the DGA tests (``test_module.py``, ``test_cpu.py``, ``test_flex.py``,
``test_cache.py``)."""

from __future__ import annotations

import math

import torch

from model.attention import LayerSpec, build_attention
from model.attention.common import reference as ref
from model.attention.dga.config import DGAConfig

SPEC = LayerSpec(d_model=32, n_heads=4, n_kv_heads=2, head_dim=8, max_seq_len=128, layer_idx=0, n_layers=1)
SMALL = dict(group_size=2, gamma=0.2, sample_recent=2, sample_random=3)


def inputs(t=37, seed=0, b=2):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, 4, t, 8, generator=g, dtype=torch.float64) * 2
    k = torch.randn(b, 2, t, 8, generator=g, dtype=torch.float64) * 2
    v = torch.randn(b, 2, t, 8, generator=g, dtype=torch.float64)
    return q, k, v, torch.zeros(b, t, 32, dtype=torch.float64)


def dga(**options):
    module = build_attention("dga", DGAConfig(**options), SPEC).double()
    module.collect_stats = True
    return module


def full_attention(q, k, v):
    pos = torch.arange(q.shape[2])
    return ref.weighted_values(
        ref.masked_softmax(ref.scores(q, k, 1 / math.sqrt(8)), ref.causal_mask(pos, pos)), v, q.dtype
    )


def run(module, q, k, v, hidden, impl):
    module.impl = impl
    return module(q, k, v, hidden=hidden, positions=torch.arange(q.shape[2]))
