"""Tests that pin each paper's defining choice, one mutation each (issue 19, item 1).

Every test states in its docstring the one-line mutation of the product code it was run against
and seen to fail. The checks go through public entry points (a module's ``forward`` on both
paths, ``sinkhorn_prefix``) and compare with planted inputs whose answer follows from the paper's
formula, computed here independently (full softmax attention, a softmax over two scores, a
closed form), rather than re-running the line under test.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from model.attention import LayerSpec, build_attention
from model.attention.dga import DGAConfig
from model.attention.focus import FocusConfig
from model.attention.focus.sinkhorn import sinkhorn_prefix
from model.attention.lazy import LazyConfig
from tests.attention.test_suite import random_inputs

# ---- DGA (papers/dynamic-group-attention-dga.txt, section 5, eq. 14, 16-17) --------------------
# One head of width 32 so that values can be one-hot per token (T = 21 <= 32). Chunks of 7 with
# groups of 2 and gamma = 0.01 give exactly one focal token per selection unit (the chunk in the
# causal form, the sequence in the paper's form) and groups {1, 2}, {3, 4}, {5, 6}, ... behind it.
# In the causal form chunk 0 (positions 0..6) is compressed and read by the queries 14..20; in the
# sequence form every group is read from its last member on. Every query is sampled for importance.
DGA_SPEC = LayerSpec(d_model=32, n_heads=1, n_kv_heads=1, head_dim=32, max_seq_len=64, layer_idx=0, n_layers=1)
DGA_T = 21
DGA_OPTIONS = dict(group_size=2, gamma=0.01, min_focal=1, chunk_size=7, sample_recent=64, sample_random=0)
SINK = 12.0  # query component on the sink direction: q . k_sink / sqrt(d) = 12.7
KEY = 6.0  # key length on a planted direction


def _dga(selection: str, impl: str):
    module = build_attention("dga", DGAConfig(selection=selection, **DGA_OPTIONS), DGA_SPEC).double()
    module.impl = impl
    return module


def _run(module, q, k, v):
    hidden = torch.zeros(q.shape[0], q.shape[2], DGA_SPEC.d_model, dtype=q.dtype)
    return module(q, k, v, hidden=hidden, positions=torch.arange(q.shape[2])).output


def _e(i: int) -> torch.Tensor:
    return F.one_hot(torch.tensor(i), DGA_SPEC.head_dim).double()


def _sink_inputs(seed: int = 0):
    """Token 0's key is a sink every query attends, except query 1, which attends nothing in particular."""
    g = torch.Generator().manual_seed(seed)
    d = DGA_SPEC.head_dim
    q = 0.05 * torch.randn(1, 1, DGA_T, d, generator=g, dtype=torch.float64)
    k = 0.05 * torch.randn(1, 1, DGA_T, d, generator=g, dtype=torch.float64)
    v = torch.randn(1, 1, DGA_T, d, generator=g, dtype=torch.float64)
    k[0, 0, 0] += KEY * _e(0)
    q[0, 0, :] += SINK * _e(0)
    q[0, 0, 1] -= SINK * _e(0)  # query 1 does not look at the sink
    return q, k, v


@pytest.mark.parametrize("impl", ["reference", "auto"])
@pytest.mark.parametrize("selection", ["causal", "sequence"])
def test_dga_keeps_the_most_important_token_raw(selection, impl):
    """DGA makes the *most* important tokens focal (eq. 16-17: top-gamma importance), so a key that
    holds nearly all the attention mass stays raw and DGA's output equals full attention's.

    Mutation caught: inverting the selection in ``DynamicGroupAttention.compress``
    (``importance.topk(r, dim=-1)`` -> ``importance.topk(r, dim=-1, largest=False)``). The sink then
    becomes a non-focal token grouped with token 1, whose query (the aggregation query, eq. 14)
    is indifferent to it, so the aggregate blurs the sink's value with token 1's for every later query.
    """
    q, k, v = _sink_inputs()
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    out = _run(_dga(selection, impl), q, k, v)
    # Outside the sink, full attention's weights are about T * exp(-12.7) ~ 6e-5: DGA must match to that order.
    err = (out - full).abs().max().item()
    assert err < 1e-3, f"{selection}/{impl}: DGA differs from full attention by {err:.3g} on a one-sink input"


@pytest.mark.parametrize("impl", ["reference", "auto"])
@pytest.mark.parametrize("selection", ["causal", "sequence"])
def test_dga_group_aggregates_with_the_group_last_query(selection, impl):
    """Eq. 14: a group's key/value is ``sum_j P_j k_j`` with ``P = softmax(q_last k_G^T / sqrt(d))``,
    the query of the group's *last* member. Planted group {3, 4}: query 4 prefers key 3, query 3
    prefers key 4. Values are one-hot per token and the read-out query (20) is zero, so it attends
    every visible entry equally and its output's components 3 and 4 are proportional to P.

    Mutation caught: aggregating with the first member's query in ``DynamicGroupAttention.compress``
    (``q_last = ref.take_rows(q, members[..., -1] - q_base)`` -> ``members[..., 0]``), which gives
    P ~ (0.01, 0.99) instead of (0.99, 0.01).
    """
    q, k, _ = _sink_inputs()
    v = torch.eye(DGA_T, DGA_SPEC.head_dim, dtype=torch.float64)[None, None]
    k[0, 0, 3], k[0, 0, 4] = KEY * _e(1), KEY * _e(2)
    q[0, 0, 3] = SINK * _e(0) + 4.0 * _e(2)  # the first member's query prefers key 4
    q[0, 0, 4] = SINK * _e(0) + 4.0 * _e(1)  # the last member's query prefers key 3
    q[0, 0, -1] = 0.0  # read-out: uniform over what it sees
    scale = 1 / math.sqrt(DGA_SPEC.head_dim)
    p_last = torch.softmax(torch.stack([q[0, 0, 4] @ k[0, 0, 3], q[0, 0, 4] @ k[0, 0, 4]]) * scale, 0)
    p_first = torch.softmax(torch.stack([q[0, 0, 3] @ k[0, 0, 3], q[0, 0, 3] @ k[0, 0, 4]]) * scale, 0)
    assert p_last[0] > 0.95 and p_first[0] < 0.05  # the planted group tells the two choices apart

    read = _run(_dga(selection, impl), q, k, v)[0, 0, -1]
    assert read[3] + read[4] > 1e-3, "the read-out query must see group {3, 4}'s aggregate"
    torch.testing.assert_close(
        read[3] / (read[3] + read[4]),
        p_last[0],
        atol=1e-9,
        rtol=1e-9,
        msg=lambda m: (
            f"{selection}/{impl}: group {{3, 4}} is not aggregated with its last query's weights "
            f"(first query's would give {p_first[0].item():.4f}): {m}"
        ),
    )


# ---- Focus (papers/focus-sinkhorn-centroid-attention.md, eq. 2 and section 3.6) ----------------
FOCUS_SPEC = LayerSpec(d_model=32, n_heads=4, n_kv_heads=2, head_dim=8, max_seq_len=64, layer_idx=0, n_layers=1)


def _focus(tau: float, assignment: str, centroid_scale: float = 1.0, impl: str = "reference"):
    cfg = FocusConfig(tau=tau, assignment=assignment, window=2, n_groups=4, d_group=8)
    with torch.random.fork_rng():
        torch.manual_seed(0)  # the same w_g and centroids for every tau
        module = build_attention("focus", cfg, FOCUS_SPEC, impl=impl).double()
    with torch.no_grad():
        module.centroids.mul_(centroid_scale)
    module.collect_stats = True
    return module.eval()


def _focus_out(module, seed: int = 0):
    q, k, v, hidden = random_inputs(FOCUS_SPEC, 2, 24, torch.float64, seed)
    return module(q, k, v, hidden=hidden * 3, positions=torch.arange(24))


@pytest.mark.parametrize("impl", ["reference", "auto"])
@pytest.mark.parametrize("assignment", ["sinkhorn", "softmax"])
def test_focus_tau_divides_the_group_scores(assignment, impl):
    """Eq. 2: ``g_i = normalize(W_g h_i C^T / tau)``. Dividing by tau is the same as scaling the
    centroids by 1 / tau, so Focus at tau = 0.1 must equal Focus at tau = 1 with centroids x 10,
    and must differ from Focus at tau = 1 with the same centroids.

    Mutation caught: dropping the division in ``centroid_scores`` (what ``FocusAttention.group_scores`` calls:
    ``(...) @ centroids.to(dtype).T) / tau`` -> without ``/ tau``); tau then
    has no effect and the rescaled-centroid twin no longer matches.
    """
    at_tau = _focus_out(_focus(0.1, assignment, impl=impl)).output
    rescaled = _focus_out(_focus(1.0, assignment, centroid_scale=10.0, impl=impl)).output
    untempered = _focus_out(_focus(1.0, assignment, impl=impl)).output
    torch.testing.assert_close(
        at_tau,
        rescaled,
        atol=1e-12,
        rtol=1e-10,
        msg=lambda m: f"tau = 0.1 differs from tau = 1 with centroids x 10: {m}",
    )
    assert (at_tau - untempered).abs().max() > 1e-3, "tau = 0.1 and tau = 1 give the same output"


@pytest.mark.parametrize("assignment", ["sinkhorn", "softmax"])
def test_focus_lower_tau_sharpens_assignments(assignment):
    """Section 3.6: a lower temperature gives sharper (more confident) assignments; tau = 0.1 is the
    paper's default. With the same weights, mean top-group probability at tau = 0.1 must exceed
    that at tau = 1 by a wide margin.

    Mutation caught: dropping ``/ self.cfg.tau`` in ``FocusAttention.group_scores`` (both
    temperatures then give identical assignments).
    """
    sharp = _focus_out(_focus(0.1, assignment)).stats["confidence"].item()
    soft = _focus_out(_focus(1.0, assignment)).stats["confidence"].item()
    assert sharp > soft + 0.1, (sharp, soft)


# Measured over 19,200 sequences (300 seeds x 64; scores N(0, 1) plus a per-sequence group offset N(0, 1);
# 10 iterations; K = 4 and 8): the largest group's mass is at most 1.23 x the balanced share T / K at
# T = 32 (1.17 at T = 8, 1.16 at T = 128, 1.09 at T = 512). Without the group normalisation (a softmax
# over groups) the worst of a batch of 32 such sequences is >= 2.2 x (K = 4) and >= 2.9 x (K = 8).
PREFIX_BALANCE_BOUND = 1.35


@pytest.mark.parametrize("k_groups", [4, 8])
@pytest.mark.parametrize("t", [32, 128])
def test_prefix_sinkhorn_keeps_group_masses_balanced(t, k_groups):
    """Section 3.6: Sinkhorn balances the groups (the collapse fix). The prefix scope normalises each
    group's mass over tokens <= i only, so balance is approximate; on unit-scale scores with a
    per-sequence preference for some groups, the largest group's mass stays within
    ``PREFIX_BALANCE_BOUND`` x T / K in every sequence (measured: <= 1.23).

    Mutation caught: removing the group (over-tokens) normalisation in ``sinkhorn_prefix``
    (deleting ``log = log - cum``), which leaves a softmax over groups; the preferred groups then take
    2.7-4.7 x their share in this batch.
    """
    g = torch.Generator().manual_seed(1)
    scores = torch.randn(32, t, k_groups, generator=g, dtype=torch.float64)
    scores = scores + torch.randn(32, 1, k_groups, generator=g, dtype=torch.float64)  # per-sequence group preference

    def worst(assign):
        return (assign.sum(1) * k_groups / t).max().item()

    assert worst(torch.softmax(scores, -1)) > 2.0, "the scores must need balancing (else the test is vacuous)"
    balanced = sinkhorn_prefix(scores, 10)[0]
    torch.testing.assert_close(balanced.sum(-1), torch.ones(32, t, dtype=torch.float64), atol=1e-12, rtol=0)
    assert worst(balanced) <= PREFIX_BALANCE_BOUND, f"largest group holds {worst(balanced):.3f} x T / K"


# ---- Lazy (papers/lazy-attention-elastic-softmax.md, eq. 5) -------------------------------------
LAZY_SPEC = LayerSpec(d_model=32, n_heads=4, n_kv_heads=2, head_dim=8, max_seq_len=16, layer_idx=0, n_layers=1)


@pytest.mark.parametrize("tau", [0.5, -1.0])
@pytest.mark.parametrize("impl", ["reference", "auto"])
def test_lazy_elastic_offset_is_spread_over_the_attended_keys(tau, impl):
    """Eq. 5: ``relu(softmax(s) - tau / n)`` with the offset "divided evenly across the attended
    tokens", n = i + 1 at 0-based position i. When every score ties (q = 0, zero distance bias),
    softmax is 1 / n, so each row keeps exactly (1 - tau) / n per key (tau <= 1): the output is
    (1 - tau) times the causal mean of the values, at every position including the first.

    Mutation caught: ``n = (q_pos + 1)`` -> ``n = q_pos`` in ``LazyAttention.weights`` (query 0 then
    divides by zero and every other row keeps 1 / (i + 1) - tau / i instead).
    """
    module = build_attention("lazy", LazyConfig(), LAZY_SPEC, impl=impl).double()
    with torch.no_grad():
        module.tau.fill_(tau)
    _, k, v, hidden = random_inputs(LAZY_SPEC, 2, 12, torch.float64, 0)
    q = torch.zeros(2, LAZY_SPEC.n_heads, 12, LAZY_SPEC.head_dim, dtype=torch.float64)
    out = module(q, k, v, hidden=hidden, positions=torch.arange(12)).output
    v = v.repeat_interleave(LAZY_SPEC.n_heads // LAZY_SPEC.n_kv_heads, dim=1)
    causal_mean = v.cumsum(2) / torch.arange(1, 13, dtype=torch.float64)[:, None]
    torch.testing.assert_close(out, (1 - tau) * causal_mean, atol=1e-12, rtol=1e-10)
