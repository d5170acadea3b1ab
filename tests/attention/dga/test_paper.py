"""Paper pins for ``dga`` (papers/dynamic-group-attention-dga.txt, section 5, eq. 14-17, appendix D; SPEC 3.5).

Written out here per (batch, query head), in float64:

- Eq. 17: ``A~ = softmax(Q~ K^T / sqrt(d))`` over the sampled queries Q~ (here every query is sampled:
  ``sample_recent`` covers the unit, ``sample_random = 0``), causally masked.
- Eq. 16: importance ``s_j = sum_i A~_ij / ||A~_.j||_0``: the mean over the sampled queries that see key j
  (not the sum, which favours early keys).
- Focal tokens: the top-r importances, r = max(ceil(gamma n), min_focal) plus the remainder that keeps
  every group full (section 5.1); the rest, in position order, form groups of m.
- Eq. 14: a group's key/value ``sum_j P_j k_j`` with ``P = softmax(q_last k_G^T / sqrt(d))``, q_last the
  query of the group's last member.
- Eq. 15 / appendix D, ``selection = "sequence"`` (the paper's form): query i attends focal keys <= i, the
  aggregates of groups whose last member is <= i, and the raw members <= i of the group still open at i.
- ``selection = "causal"`` (default): the same per chunk of C tokens, importance from the queries of
  chunks c and c + 1 over their 2C keys, chunk c's focal keys and aggregates seen from chunk c + 2 on,
  chunks j - 1 and j raw.
"""

from __future__ import annotations

import math

import pytest
import torch

from model.attention import LayerSpec, build_attention
from model.attention.dga import DGAConfig
from tests.attention.pins import IMPLS, assert_matches, expected, qkv, repeat_kv, run_module

H, D, T = 2, 8, 20
SPEC = LayerSpec(d_model=16, n_heads=H, n_kv_heads=1, head_dim=D, max_seq_len=32, layer_idx=0, n_layers=1)


def compress(q, k, v, unit, window, sampled, r, m):
    """One unit (key positions ``unit``), importance over the keys ``window`` from the queries ``sampled``.
    Returns (focal positions, groups of positions, aggregated keys [g, D], aggregated values [g, D])."""
    scale = 1 / math.sqrt(D)
    with torch.no_grad():
        a = (q[sampled] @ k[window].T * scale).masked_fill(window[None, :] > sampled[:, None], -math.inf)
        a = torch.softmax(a, -1)  # eq. 17
        seen = (window[None, :] <= sampled[:, None]).sum(0)
        importance = a.sum(0) / seen  # eq. 16: the mean over the queries that see the key
        importance = importance[: len(unit)]  # the unit's keys lead the window
        focal = unit[importance.topk(r).indices].sort().values
    chosen = set(focal.tolist())
    rest = [p for p in unit.tolist() if p not in chosen]
    groups = [rest[i : i + m] for i in range(0, len(rest), m)]
    agg_k, agg_v = [], []
    for grp in groups:
        p = torch.softmax(q[grp[-1]] @ k[grp].T * scale, -1)  # eq. 14, the last member's query
        agg_k.append(p @ k[grp])
        agg_v.append(p @ v[grp])
    return focal, groups, agg_k, agg_v


def attend(q, k, v, allowed_raw, agg, agg_seen):
    """softmax over [raw keys; aggregates] with the given visibility; [T, D]."""
    scale = 1 / math.sqrt(D)
    keys = torch.cat([k, torch.stack(agg[0])]) if agg[0] else k
    values = torch.cat([v, torch.stack(agg[1])]) if agg[0] else v
    mask = torch.cat([allowed_raw, agg_seen], 1) if agg[0] else allowed_raw
    s = (q @ keys.T * scale).masked_fill(~mask, -math.inf)
    return torch.softmax(s, -1) @ values


def sequence_form(q, k, v, r, m):
    pos = torch.arange(T)
    focal, groups, ak, av = compress(q, k, v, pos, pos, pos, r, m)
    raw = torch.zeros(T, T, dtype=torch.bool)
    raw[:, focal] = True
    for grp in groups:  # eq. 15: members of the group still open at i (first <= i < last), up to i
        for i in range(grp[0], grp[-1]):
            raw[i, grp] = True
    raw &= pos[None, :] <= pos[:, None]
    seen = torch.tensor([[grp[-1] <= i for grp in groups] for i in range(T)], dtype=torch.bool).reshape(T, -1)
    return attend(q, k, v, raw, (ak, av), seen)


def causal_form(q, k, v, r, m, c):
    pos = torch.arange(T)
    raw = (pos[None, :] <= pos[:, None]) & (pos[None, :] // c >= pos[:, None] // c - 1)  # chunks j - 1 and j
    ak, av, seen = [], [], []
    for unit in range((T - 1) // c - 1):  # chunks some query sees compressed (from chunk unit + 2 on)
        keys = torch.arange(unit * c, (unit + 1) * c)
        span = torch.arange(unit * c, (unit + 2) * c)
        focal, groups, gk, gv = compress(q, k, v, keys, span, span, r, m)
        visible = pos >= (unit + 2) * c
        raw[visible[:, None] & (pos[None, :] == focal[:, None, None]).any(0)] = True
        ak += gk
        av += gv
        seen += [visible] * len(groups)
    return attend(q, k, v, raw, (ak, av), torch.stack(seen, 1))


def formula(selection, r, m, c):
    def dga(q, k, v):
        k, v = repeat_kv(k, H), repeat_kv(v, H)
        outs = []
        for b in range(q.shape[0]):
            for h in range(H):
                args = (q[b, h], k[b, h], v[b, h], r, m)
                outs.append(sequence_form(*args) if selection == "sequence" else causal_form(*args, c))
        return torch.stack(outs).reshape(q.shape)

    return dga


# (m, gamma, C, r by hand): r = max(ceil(gamma n), 1) plus (n - r) mod m (section 5.1's full groups)
SEQUENCE = {"m2": (2, 0.2, 0, 4), "m3-remainder": (3, 0.15, 0, 5)}  # n = T = 20: ceil(4)=4; ceil(3)=3, + 17 mod 3
CAUSAL = {"m2": (2, 0.2, 6, 2), "m3-remainder": (3, 0.15, 7, 4)}  # n = C: ceil(1.2)=2; ceil(1.05)=2, + 5 mod 3


@pytest.mark.parametrize(
    "selection,case", [("sequence", name) for name in SEQUENCE] + [("causal", name) for name in CAUSAL]
)
@pytest.mark.parametrize("impl", IMPLS)
def test_dga_is_focal_plus_aggregated_groups_eq14_to_17(selection, case, impl):
    """The whole of section 5 on a 20-token input, values and gradients (aggregation weights carry gradients
    to q and k; the focal choice is discrete)."""
    m, gamma, c, r = (SEQUENCE if selection == "sequence" else CAUSAL)[case]
    options = dict(group_size=m, gamma=gamma, min_focal=1, sample_recent=64, sample_random=0)
    if c:
        options["chunk_size"] = c
    module = build_attention("dga", DGAConfig(selection=selection, **options), SPEC).double()
    q, k, v = qkv(2, H, 1, T, D, seed=11, scale=2.0)
    want = expected(formula(selection, r, m, c), q, k, v)
    assert_matches(run_module(module, q, k, v, impl=impl), want, f"dga {selection} {case}/{impl}")


@pytest.mark.parametrize("impl", IMPLS)
def test_dga_default_config_on_a_short_input_is_full_attention(impl):
    """Default config (chunks of 128): under 2C = 256 tokens nothing is compressed yet, every query sees its
    own and the previous chunk raw, so DGA equals causal softmax attention."""
    module = build_attention("dga", DGAConfig(), SPEC).double()
    q, k, v = qkv(1, H, 1, T, D, seed=12, scale=2.0)

    def full(q, k, v):
        s = (q @ repeat_kv(k, H).transpose(-1, -2) / math.sqrt(D)).masked_fill(
            torch.ones(T, T, dtype=torch.bool).triu(1), -math.inf
        )
        return torch.softmax(s, -1) @ repeat_kv(v, H)

    assert_matches(run_module(module, q, k, v, impl=impl), expected(full, q, k, v), f"dga default/{impl}")
