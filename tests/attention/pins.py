"""Shared pieces of the paper pins (``tests/attention/<variant>/test_paper.py``).

A pin computes its expected values in plain float64 tensor code written from the paper's equations,
never with the product's helpers; this module holds only what every pin repeats: the paths a module is
run on, a fixed output projection for gradients, and causal softmax attention over explicit logits.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

# ``reference``: the dense path; ``auto``: the default fast path for this device (the same call a model makes).
IMPLS = ("reference", "auto")
F64 = dict(atol=1e-10, rtol=1e-9)


def randn(*shape: int, seed: int, scale: float = 1.0) -> Tensor:
    return scale * torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def qkv(b: int, hq: int, hkv: int, t: int, d: int, seed: int, scale: float = 1.0) -> tuple[Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = scale * torch.randn(b, hq, t, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, hkv, t, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, hkv, t, d, generator=g, dtype=torch.float64)
    return q, k, v


def repeat_kv(x: Tensor, hq: int) -> Tensor:
    """GQA: query head h reads KV head h // (hq / hkv)."""
    return x.repeat_interleave(hq // x.shape[1], dim=1)


def causal(tq: int, tk: int | None = None) -> Tensor:
    """[Tq, Tk] True where key j <= query i (queries are the last Tq positions)."""
    tk = tq if tk is None else tk
    i = torch.arange(tk - tq, tk)[:, None]
    return torch.arange(tk)[None, :] <= i


def softmax_attention(logits: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    """sum_j softmax_j(logits_ij) v_j over the allowed j, written out (max-shifted exp over the masked sum)."""
    s = logits.masked_fill(~mask, -math.inf)
    e = torch.exp(s - s.amax(-1, keepdim=True))
    return (e / e.sum(-1, keepdim=True)) @ v


def projection(shape: Sequence[int], seed: int = 99) -> Tensor:
    """A fixed random direction: gradients are of (out * w).sum()."""
    return randn(*shape, seed=seed)


def run_module(
    module: nn.Module,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    impl: str,
    hidden: Tensor | None = None,
    params: Sequence[str] = (),
) -> tuple[Tensor, list[Tensor]]:
    """(output, [grad q, grad k, grad v, grad of each named parameter]) of ``module`` on the ``impl`` path."""
    module.impl = impl
    module.zero_grad(set_to_none=True)
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    if hidden is None:
        hidden = torch.zeros(q.shape[0], q.shape[2], module.spec.d_model, dtype=q.dtype)
    out = module(*leaves, hidden=hidden, positions=torch.arange(q.shape[2])).output
    (out * projection(out.shape)).sum().backward()
    named = dict(module.named_parameters())
    return out.detach(), [x.grad for x in leaves] + [named[p].grad for p in params]


def expected(
    fn: Callable[..., Tensor], q: Tensor, k: Tensor, v: Tensor, extra: Sequence[Tensor] = ()
) -> tuple[Tensor, list[Tensor]]:
    """(fn(q, k, v, *extra), its gradients) by autograd through the pin's own float64 formula."""
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, *extra)]
    out = fn(*leaves)
    (out * projection(out.shape)).sum().backward()
    return out.detach(), [x.grad for x in leaves]


def assert_matches(got: tuple[Tensor, list[Tensor]], want: tuple[Tensor, list[Tensor]], what: str, **tol) -> None:
    tol = tol or F64
    torch.testing.assert_close(got[0], want[0], **tol, msg=lambda m: f"{what}: output: {m}")
    for i, (g, w) in enumerate(zip(got[1], want[1], strict=True)):
        torch.testing.assert_close(g, w, **tol, msg=lambda m, i=i: f"{what}: gradient {i}: {m}")
