"""``focal``'s fast path (full's SDPA path with the temperature as its scale) against the plain-function
reference ``naive``, in float64: values and gradients of q, k, v and w_tau, for the constant and learned modes."""

from __future__ import annotations

import pytest
import torch

from model.attention import LayerSpec, build_attention
from model.attention.focal import FocalConfig, naive

SPEC = LayerSpec(d_model=24, n_heads=4, n_kv_heads=2, head_dim=16, max_seq_len=32, layer_idx=0, n_layers=1)
T = 11
F64 = dict(atol=1e-12, rtol=1e-10)


CASES = {
    "constant": {},
    "learned-query": {"mode": "learned"},
    "learned-prefix": {"mode": "learned", "scope": "prefix_mean"},
    "learned-sequence": {"mode": "learned", "scope": "sequence_mean"},
}


@pytest.mark.parametrize("options", CASES.values(), ids=CASES.keys())
def test_sdpa_path_matches_naive(options):
    cfg = FocalConfig(**options)
    module = build_attention("focal", cfg, SPEC).double()
    g = torch.Generator().manual_seed(0)
    if module.w_tau is not None:
        with torch.no_grad():  # some taus clip, some do not
            module.w_tau.copy_(torch.randn(SPEC.d_model, generator=g, dtype=torch.float64))
    q = torch.randn(2, 4, T, 16, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 2, T, 16, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    hidden = torch.randn(2, T, SPEC.d_model, generator=g, dtype=torch.float64)
    w = torch.randn(2, 4, T, 16, generator=g, dtype=torch.float64)
    pos = torch.arange(T)
    leaves = [q, k, v] + ([module.w_tau] if module.w_tau is not None else [])

    def naive_out():
        if cfg.mode == "constant":
            scale = naive.constant_scale(cfg.t, SPEC.head_dim)
        else:
            offset = naive.tau_offset(SPEC.head_dim, cfg.tau_min, cfg.tau_max)
            tau, _ = naive.learned_tau(
                hidden, module.w_tau, pos, scope=cfg.scope, offset=offset, tau_min=cfg.tau_min, tau_max=cfg.tau_max
            )
            scale = (1.0 / tau)[:, None, :, None]
        return naive.attention(q, k, v, pos, pos, scale)

    module.impl = "auto"  # the CPU's fast path: SDPA
    fast = module(q, k, v, hidden=hidden, positions=pos).output
    want = naive_out()
    torch.testing.assert_close(fast, want, **F64)
    got_grads = torch.autograd.grad((fast * w).sum(), leaves)
    want_grads = torch.autograd.grad((want * w).sum(), leaves)
    for i, (a, b) in enumerate(zip(got_grads, want_grads)):
        torch.testing.assert_close(a, b, **F64, msg=lambda m, i=i: f"grad {i}: {m}")
