"""Focus's Sinkhorn (model/attention/focus/sinkhorn.py): rows sum to one, the sequence scope balances the groups,
the prefix scope is causal and resumable, the fast logcumsumexp and the host-float decode step equal the library's.
"""

from __future__ import annotations

import math

import pytest
import torch

from model.attention.focus.hard.decode_host import HostDecode
from model.attention.focus.sinkhorn import (
    group_imbalance,
    logcumsumexp,
    scan_last,
    sinkhorn_prefix,
    sinkhorn_sequence,
    sinkhorn_token_host,
)


@pytest.mark.parametrize("scope", ["prefix", "sequence"])
def test_sinkhorn_rows_sum_to_one(scope):
    s = torch.randn(3, 50, 4, dtype=torch.float64) * 10
    a = sinkhorn_prefix(s, 10)[0] if scope == "prefix" else sinkhorn_sequence(s, 10)
    torch.testing.assert_close(a.sum(-1), torch.ones(3, 50, dtype=torch.float64), atol=1e-12, rtol=0)
    assert (a >= 0).all()


def test_sequence_sinkhorn_balances_groups_and_peaked_scores_need_more_iterations():
    g = torch.Generator().manual_seed(0)
    unit = torch.randn(4, 256, 4, generator=g, dtype=torch.float64)
    spread = [group_imbalance(sinkhorn_sequence(unit, n)).item() for n in (1, 2, 3, 5, 10)]
    assert all(b < a for a, b in zip(spread, spread[1:])), spread
    assert spread[-1] < 1e-6, "unit-scale scores: 10 iterations equalise the group masses"
    peaked = unit * 10  # scores as at tau = 0.1
    after10, after50 = (group_imbalance(sinkhorn_sequence(peaked, n)).item() for n in (10, 50))
    assert after10 > 0.05 and after50 < after10 / 10, (after10, after50)


def test_prefix_sinkhorn_is_causal_and_resumable():
    s = torch.randn(2, 30, 4, dtype=torch.float64) * 3
    full, state = sinkhorn_prefix(s, 10)
    # token i's assignment uses only tokens <= i
    s2 = s.clone()
    s2[:, 20] += 5.0
    torch.testing.assert_close(sinkhorn_prefix(s2, 10)[0][:, :20], full[:, :20], atol=0, rtol=0)
    assert (sinkhorn_prefix(s2, 10)[0][:, 20:] - full[:, 20:]).abs().max() > 1e-3
    # chunk by chunk with the carried state equals one pass
    a1, st1 = sinkhorn_prefix(s[:, :13], 10)
    a2, st2 = sinkhorn_prefix(s[:, 13:14], 10, st1)
    a3, st3 = sinkhorn_prefix(s[:, 14:], 10, st2)
    torch.testing.assert_close(torch.cat([a1, a2, a3], 1), full, atol=1e-13, rtol=0)
    torch.testing.assert_close(st3, state, atol=1e-12, rtol=0)


def test_fast_logcumsumexp_equals_the_library_scan_values_gradients_and_causality():
    """The CPU float32 path (float64 exp-cumsum-log) against ``torch.logcumsumexp`` in float64: values and gradients
    (the library's float32 backward is the less accurate of the two); a position never depends on later ones, also
    when a later value is out of the fast path's range (that suffix falls back to the library's scan)."""
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(3, 200, 6, generator=g) * 20).requires_grad_()
    x64 = x.detach().double().requires_grad_()
    fast, exact = logcumsumexp(x, 1), torch.logcumsumexp(x64, 1)
    torch.testing.assert_close(fast.double(), exact, atol=2e-5, rtol=1e-6)
    w = torch.randn(fast.shape, generator=g)
    (g_fast,) = torch.autograd.grad((fast * w).sum(), x)
    (g_exact,) = torch.autograd.grad((exact * w.double()).sum(), x64)
    (g_lib,) = torch.autograd.grad((torch.logcumsumexp(x, 1) * w).sum(), x)
    torch.testing.assert_close(g_fast.double(), g_exact, atol=1e-5, rtol=1e-5)
    assert (g_fast.double() - g_exact).abs().max() <= (g_lib.double() - g_exact).abs().max()
    with torch.no_grad():
        base = logcumsumexp(x, 1)
        y = x.detach().clone()
        y[1, 120, 2] = 500.0  # out of range: positions >= 120 of that column take the library's scan
        out = logcumsumexp(y, 1)
        torch.testing.assert_close(out[:, :120], base[:, :120], atol=0, rtol=0)
        torch.testing.assert_close(out[1, 120:], torch.logcumsumexp(y, 1)[1, 120:], atol=0, rtol=0)
        assert out[1, 120, 2] == torch.logcumsumexp(y, 1)[1, 120, 2] and out[1, 125, 2] > 499


def test_prefix_sinkhorn_float32_matches_float64():
    s = torch.randn(2, 300, 8, dtype=torch.float64) * 10  # scores as at tau = 0.1
    a64, st64 = sinkhorn_prefix(s, 10)
    a32, st32 = sinkhorn_prefix(s.float(), 10)
    torch.testing.assert_close(a32.double(), a64, atol=1e-5, rtol=0)
    torch.testing.assert_close(st32.double(), st64, atol=1e-4, rtol=1e-6)


def test_host_token_sinkhorn_equals_the_tensor_prefix_sinkhorn():
    """Decoding's host-float Sinkhorn of one token against ``sinkhorn_prefix`` in float64 (peaked scores, as at
    tau = 0.1, after 300 earlier tokens); a non-finite score gives None (the tensor path takes over), and a state
    with a non-finite mass never goes to the host."""
    s = torch.randn(2, 301, 8, dtype=torch.float64) * 10
    full, full_state = sinkhorn_prefix(s, 10)
    _, state = sinkhorn_prefix(s[:, :300], 10)
    for b in range(2):
        token = sinkhorn_token_host(s[b, 300].tolist(), state[b].tolist())
        assert token is not None
        assignment, masses = token
        torch.testing.assert_close(torch.tensor(assignment, dtype=torch.float64), full[b, 300], atol=1e-13, rtol=0)
        torch.testing.assert_close(torch.tensor(masses, dtype=torch.float64), full_state[b], atol=1e-11, rtol=0)
    bad = s[0, 300].tolist()
    bad[3] = math.inf
    assert sinkhorn_token_host(bad, state[0].tolist()) is None
    assert HostDecode.accepts(state, torch.float64) and not HostDecode.accepts(state.float(), torch.float64)
    state[1, 4, 2] = math.nan
    assert not HostDecode.accepts(state, torch.float64)


def test_the_device_scan_runs_along_the_last_dimension(monkeypatch):
    """Off the CPU (here the meta device stands for CUDA) the prefix scan over tokens is computed along the last
    dimension: CUDA scans any other dimension serially per column (issue 37, item 2)."""
    dims = []
    real = torch.logcumsumexp

    def recording(x, dim):
        dims.append((dim % x.dim(), x.dim()))
        return real(x, dim)

    monkeypatch.setattr(torch, "logcumsumexp", recording)
    assign, state = sinkhorn_prefix(torch.randn(2, 300, 8, device="meta"), iters=3)
    assert assign.shape == (2, 300, 8) and state.shape == (2, 3, 8)
    assert dims and all(dim == ndim - 1 for dim, ndim in dims), dims


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_last_dimension_scan_equals_the_library_scan(dtype):
    """Values and gradients of ``scan_last`` over dimension 1 against ``torch.logcumsumexp`` in float64."""
    x = torch.randn(2, 257, 5, dtype=dtype, requires_grad=True)
    got = scan_last(x, 1)
    wide = x.detach().double().requires_grad_()
    want = torch.logcumsumexp(wide, 1)
    weights = torch.randn_like(want)
    (gx,) = torch.autograd.grad((got * weights.to(dtype)).sum(), x)
    (wx,) = torch.autograd.grad((want * weights).sum(), wide)
    tol = 1e-12 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(got.double(), want.detach(), atol=tol, rtol=tol)
    torch.testing.assert_close(gx.double(), wx, atol=tol, rtol=tol)
