"""``full``'s fast path (SDPA on the CPU) against its plain-function reference ``naive``, in float64:
values and gradients of q, k, v, for a whole sequence, a chunk of queries onto longer keys, and packed documents."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from model.attention import LayerSpec, build_attention
from model.attention.full import FullConfig, naive

SPEC = LayerSpec(d_model=32, n_heads=4, n_kv_heads=2, head_dim=8, max_seq_len=32, layer_idx=0, n_layers=1)
SCALE = 1.0 / math.sqrt(8)
F64 = dict(atol=1e-12, rtol=1e-10)


def _inputs(tq: int, tk: int, seed: int) -> list[Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, tq, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, tk, 8, generator=g, dtype=torch.float64) for _ in range(2))
    return [x.requires_grad_() for x in (q, k, v)]


def _value_and_grads(fn, inputs: list[Tensor]) -> tuple[Tensor, tuple[Tensor, ...]]:
    out = fn(*inputs)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=out.dtype)
    return out.detach(), torch.autograd.grad((out * w).sum(), inputs)


def _assert_same(got: tuple[Tensor, tuple[Tensor, ...]], want: tuple[Tensor, tuple[Tensor, ...]]) -> None:
    torch.testing.assert_close(got[0], want[0], **F64)
    for name, a, b in zip("qkv", got[1], want[1]):
        torch.testing.assert_close(a, b, **F64, msg=lambda m, name=name: f"grad {name}: {m}")


@pytest.mark.parametrize("tq,tk", [(13, 13), (5, 13), (1, 13)], ids=["sequence", "chunk", "decode"])
def test_sdpa_path_matches_naive(tq, tk):
    """The queries are the last tq of tk positions (tq < tk: chunked prefill or decode onto earlier keys)."""
    module = build_attention("full", FullConfig(backend="sdpa"), SPEC).double()
    q_pos, k_pos = torch.arange(tk - tq, tk), torch.arange(tk)
    hidden = torch.zeros(2, tq, SPEC.d_model, dtype=torch.float64)
    inputs = _inputs(tq, tk, seed=tq)

    def fast(q, k, v):
        return module.fast(q, k, v, hidden=hidden, q_pos=q_pos, k_pos=k_pos, cache=None).output

    _assert_same(
        _value_and_grads(fast, inputs),
        _value_and_grads(lambda q, k, v: naive.attention(q, k, v, q_pos, k_pos, SCALE), inputs),
    )


def test_document_sdpa_path_matches_naive():
    """Packed documents of lengths 5, 1, 7 (CPU: SDPA with the boolean document mask)."""
    module = build_attention("full", FullConfig(backend="sdpa"), SPEC).double()
    docs = torch.tensor([0] * 5 + [1] + [2] * 7).expand(2, -1)
    hidden = torch.zeros(2, 13, SPEC.d_model, dtype=torch.float64)
    inputs = _inputs(13, 13, seed=3)

    def fast(q, k, v):
        return module(q, k, v, hidden=hidden, positions=torch.arange(13), documents=docs).output

    _assert_same(
        _value_and_grads(fast, inputs),
        _value_and_grads(lambda q, k, v: naive.document_attention(q, k, v, docs, SCALE), inputs),
    )
