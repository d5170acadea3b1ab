"""Paper pins for ``focus`` (papers/focus-sinkhorn-centroid-attention.md, sections 2.1, 3.6, E.4; SPEC 3.2).

- Eq. 2: group scores ``S = (h W_g) C^T / tau`` [B, T, K].
- Section 3.6, Algorithm 1: log-domain Sinkhorn, N times: subtract a logsumexp over tokens (every group
  the same mass), then over groups (every row sums to 1). ``sequence`` scope: over the whole sequence
  (the paper's); ``prefix`` (default): token i's group normaliser over tokens <= i only. ``softmax``:
  a softmax over groups (the collapsing baseline).
- E.4.8 (default gate): outside the window (i - j >= w) add ``log sigmoid(lam (g_i . g_j - 0.5))`` to the
  logit; eq. 4 (``gate = "multiplicative"``): multiply the logit by ``sigmoid(lam g_i . g_j)``.
- E.4 hard inference: token i attends j iff j <= i and (i - j < w or their top-k group sets intersect).

Every expectation is written here in float64 from those formulas and compared on the dense reference and
on the default path for the device, values and gradients (q, k, v and the routing parameters).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from model.attention import LayerSpec, build_attention
from model.attention.focus import FocusConfig
from tests.attention.pins import IMPLS, assert_matches, causal, expected, qkv, randn, repeat_kv, run_module

H, D, T, K, W = 4, 8, 14, 4, 3
SPEC = LayerSpec(d_model=16, n_heads=H, n_kv_heads=2, head_dim=D, max_seq_len=32, layer_idx=0, n_layers=1)
ROUTING = ("w_g.weight", "centroids", "lam")


def sinkhorn(s, iters, scope):
    """Algorithm 1 in the log domain; ``prefix`` replaces the token logsumexp by a running one."""
    log = s
    for _ in range(iters):
        if scope == "sequence":
            log = log - torch.logsumexp(log, dim=1, keepdim=True)
        else:
            log = log - torch.logcumsumexp(log, dim=1)  # token i's group mass over tokens <= i
        log = log - torch.logsumexp(log, dim=-1, keepdim=True)
    return log.exp()


def assignments(x, w_g, centroids, cfg):
    s = (x @ w_g.T) @ centroids.T / cfg.tau  # eq. 2
    if cfg.assignment == "softmax":
        return torch.softmax(s, -1)
    return sinkhorn(s, cfg.sinkhorn_iters, cfg.sinkhorn_scope)


def focus(cfg, seed=0):
    torch.manual_seed(seed)
    module = build_attention("focus", cfg, SPEC).double()
    with torch.no_grad():
        module.lam.fill_(3.0)
    return module.eval()


def soft_formula(cfg, x):
    def formula(q, k, v, w_g, centroids, lam):
        g = assignments(x, w_g, centroids, cfg)
        s = q @ repeat_kv(k, H).transpose(-1, -2) / math.sqrt(D)
        affinity = (g @ g.transpose(-1, -2))[:, None]  # [B, 1, T, T]
        i = torch.arange(T)
        distant = (i[:, None] - i[None, :]) >= cfg.window
        if cfg.gate == "additive":
            s = torch.where(distant, s + F.logsigmoid(lam * (affinity - 0.5)), s)
        else:
            s = torch.where(distant, s * torch.sigmoid(lam * affinity), s)
        return torch.softmax(s.masked_fill(~causal(T), -math.inf), -1) @ repeat_kv(v, H)

    return formula


SOFT = {
    "default": {},
    "multiplicative": {"gate": "multiplicative"},
    "sequence": {"sinkhorn_scope": "sequence"},
    "softmax": {"assignment": "softmax"},
    "d_group=d_model,tau=0.5": {"d_group": 0, "tau": 0.5, "n_groups": 8, "sinkhorn_iters": 3},
}


@pytest.mark.parametrize("case", list(SOFT))
@pytest.mark.parametrize("impl", IMPLS)
def test_soft_gate_over_sinkhorn_assignments(case, impl):
    """Eq. 2 + Algorithm 1 (both scopes, or softmax) + the E.4.8 / eq. 4 gate outside the window, values and
    gradients to q, k, v, W_g, C and lambda. The default config (K = 4, tau = 0.1, 10 iterations, prefix
    scope, additive gate) with a window of 3 so that most pairs are gated."""
    cfg = FocusConfig(window=W, **SOFT[case])
    module = focus(cfg)
    q, k, v = qkv(2, H, 2, T, D, seed=1, scale=2.0)
    x = randn(2, T, 16, seed=2, scale=2.0)
    routing = [p.detach().clone() for p in (module.w_g.weight, module.centroids, module.lam)]
    want = expected(soft_formula(cfg, x), q, k, v, routing)
    g = assignments(x, *routing[:2], cfg)
    assert g.max() - g.min() > 0.3, "assignments must not be uniform (else the gate is one constant)"
    assert_matches(run_module(module, q, k, v, impl=impl, hidden=x, params=ROUTING), want, f"focus {case}/{impl}")


def test_sinkhorn_scopes_balance_groups_as_algorithm_1():
    """Algorithm 1's fixed point (sequence scope, many iterations): rows sum to 1 and every group holds T / K.
    The module's assignments (read through its statistics: the largest argmax share) follow the scope given."""
    s = randn(1, T, K, seed=3, scale=3.0)
    g = sinkhorn(s, 200, "sequence")
    torch.testing.assert_close(g.sum(-1), torch.ones(1, T, dtype=torch.float64))
    torch.testing.assert_close(g.sum(1), torch.full((1, K), T / K, dtype=torch.float64), atol=1e-6, rtol=0)
    prefix = sinkhorn(s, 10, "prefix")
    torch.testing.assert_close(prefix[:, :5], sinkhorn(s[:, :5], 10, "prefix"), atol=1e-12, rtol=0)  # causal


def hard_formula(bits_q, top_k):
    def formula(q, k, v):
        share = (bits_q[:, :, None, :] & bits_q[:, None, :, :]).any(-1)  # [B, T, T] share a group
        i = torch.arange(T)
        allowed = causal(T) & (((i[:, None] - i[None, :]) < W) | share)
        s = q @ repeat_kv(k, H).transpose(-1, -2) / math.sqrt(D)
        return torch.softmax(s.masked_fill(~allowed[:, None], -math.inf), -1) @ repeat_kv(v, H)

    return formula


@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("scope", ["prefix", "sequence"])
@pytest.mark.parametrize("impl", IMPLS)
def test_hard_mode_attends_the_window_and_shared_top_k_groups(top_k, scope, impl):
    """E.4: each token's groups are its top-k assignments; i attends j iff j <= i and (i - j < w or a group is
    shared). Checked against the mask built here from the formula's own assignments."""
    cfg = FocusConfig(window=W, mode="hard", top_k=top_k, sinkhorn_scope=scope)
    module = focus(cfg, seed=4)
    x = randn(2, T, 16, seed=5, scale=2.0)
    g = assignments(x, module.w_g.weight.detach(), module.centroids.detach(), cfg)
    # ties go to the lower group index (under the prefix scope token 0's assignment is uniform: all tie)
    top = torch.sort(g, dim=-1, descending=True, stable=True).indices[..., :top_k]
    bits = torch.zeros(2, T, K, dtype=torch.bool).scatter_(-1, top, True)
    i = torch.arange(T)
    share = (bits[:, :, None] & bits[:, None]).any(-1)
    distant_kept = (share & causal(T) & ((i[:, None] - i[None, :]) >= W)).sum()
    distant = (causal(T) & ((i[:, None] - i[None, :]) >= W)).sum() * 2
    assert 0 < distant_kept < distant, "the input must keep some distant pairs and drop others"
    q, k, v = qkv(2, H, 2, T, D, seed=6, scale=2.0)
    got = run_module(module, q, k, v, impl=impl, hidden=x)
    assert_matches(got, expected(hard_formula(bits, top_k), q, k, v), f"focus hard k={top_k} {scope}/{impl}")
