"""Dynamic Group Attention: limits that equal full attention, the appendix D mask (``naive.masks``) against a
brute-force construction, causality of the chunked selection, config errors. The CPU parts form, FlexAttention and
the grouped KV caches have their own files."""

from __future__ import annotations

import pytest
import torch

from core.errors import ConfigError
from model.attention.common import reference as ref
from model.attention.dga import naive
from model.attention.dga.config import DGAConfig, focal_count
from tests.attention.dga.helpers import SMALL, dga, full_attention, inputs, run


def masks(module, comp, pos):
    """Appendix D's dense masks (raw keys, aggregates) of ``comp`` for queries and keys at ``pos``."""
    cfg = module.cfg
    return naive.masks(comp.focal_pos, comp.members, pos, pos, selection=cfg.selection, chunk_size=cfg.chunk_size)


@pytest.mark.parametrize("impl", ["reference", "auto"])
@pytest.mark.parametrize("selection", ["causal", "sequence"])
@pytest.mark.parametrize("limit", [dict(gamma=1.0), dict(group_size=1)])
def test_all_focal_or_groups_of_one_equal_full_attention(limit, selection, impl):
    options = {**SMALL, "chunk_size": 8, "selection": selection, **limit}
    q, k, v, hidden = inputs()
    out = run(dga(**options), q, k, v, hidden, impl)
    torch.testing.assert_close(out.output, full_attention(q, k, v), atol=1e-12, rtol=1e-10)


def test_the_default_settings_do_drop_keys():
    q, k, v, hidden = inputs(t=37)
    for selection in ("causal", "sequence"):
        module = dga(selection=selection, chunk_size=8, **SMALL)
        ratio = run(module, q, k, v, hidden, "auto").stats["key_ratio"]
        assert ratio < 0.9, (selection, ratio)  # averaged over all queries; the first chunks are uncompressed
        assert not torch.allclose(run(module, q, k, v, hidden, "reference").output, full_attention(q, k, v))


def test_focal_count_rounds_the_remainder_into_focal_tokens():
    assert focal_count(128, 0.1, 1, 16) == 16  # 13 focal leaves 115 = 7*16 + 3: the 3 become focal
    assert focal_count(40, 0.1, 1, 4) == 4  # 0.1*40 is 4 despite float rounding
    assert focal_count(8, 0.2, 1, 2) == 2
    assert focal_count(10, 0.01, 5, 4) == 6
    assert focal_count(5, 1.0, 0, 3) == 5


def _sequence_algorithm2(t, focal, groups):
    """Appendix D, Algorithm 2, literally (with the causal meaning of M^n: a group's aggregate is
    visible once all of its members are at or before the query). Returns M0_foc, M^n, and the
    complementary mask expanded to raw non-focal columns."""
    m0 = torch.tril(torch.ones(t, t, dtype=torch.long))
    nonfocal = [p for g in groups for p in g]
    mn = torch.tensor([[int(all(p <= i for p in g)) for g in groups] for i in range(t)], dtype=torch.long).reshape(
        t, len(groups)
    )
    m = len(groups[0]) if groups else 1
    phi = m0[:, nonfocal] - mn.repeat_interleave(m, dim=1)
    comp = torch.zeros(t, t, dtype=torch.long)
    for i in range(t):
        for z, g in enumerate(groups):
            if min(g) <= i <= max(g):
                for slot, p in enumerate(g):
                    comp[i, p] = phi[i, z * m + slot]
    assert (phi >= 0).all()
    return m0[:, focal], mn, comp[:, nonfocal]


@pytest.mark.parametrize("t,m,gamma", [(12, 2, 0.2), (17, 3, 0.3), (20, 4, 0.1)])
def test_sequence_mask_equals_algorithm_2(t, m, gamma):
    module = dga(selection="sequence", group_size=m, gamma=gamma, sample_recent=2, sample_random=3)
    q, k, v, _ = inputs(t=t, seed=t)
    kx, vx = ref.expand_kv(k, 4), ref.expand_kv(v, 4)
    comp = module._compress_sequence(q, kx, vx)[0]
    pos = torch.arange(t)
    raw, agg = masks(module, comp, pos)
    for b in range(2):
        for h in range(4):
            focal = comp.focal_pos[b, h, 0].tolist()
            groups = comp.members[b, h, 0].tolist()
            assert sorted(focal + [p for g in groups for p in g]) == list(range(t))
            assert all(g == sorted(g) for g in groups) and [p for g in groups for p in g] == sorted(
                p for g in groups for p in g
            )
            m0_foc, mn, comp_mask = _sequence_algorithm2(t, focal, groups)
            nonfocal = [p for g in groups for p in g]
            assert torch.equal(raw[b, h][:, focal].long(), m0_foc)
            assert torch.equal(agg[b, h].long(), mn)
            assert torch.equal(raw[b, h][:, nonfocal].long(), comp_mask)


@pytest.mark.parametrize(
    "selection,c,m,gamma,t", [("causal", 8, 2, 0.2, 37), ("causal", 7, 3, 0.15, 30), ("sequence", 8, 2, 0.2, 23)]
)
def test_every_past_token_is_represented_exactly_once(selection, c, m, gamma, t):
    """Brute force over (query, key): each key at or before the query is seen exactly once, raw or
    inside one visible aggregate, and no visible aggregate holds a token after the query."""
    module = dga(selection=selection, chunk_size=c, group_size=m, gamma=gamma, sample_recent=1, sample_random=2)
    q, k, v, _ = inputs(t=t, seed=1)
    kx, vx = ref.expand_kv(k, 4), ref.expand_kv(v, 4)
    comp = module._compress_uncached(q, kx, vx, t - 1)[0]
    pos = torch.arange(t)
    raw, agg = masks(module, comp, pos)
    for b in range(2):
        for h in range(4):
            groups = comp.members[b, h].reshape(-1, m).tolist()
            for i in range(t):
                seen = [0] * t
                for j in range(t):
                    seen[j] += int(raw[b, h, i, j])
                for gi, g in enumerate(groups):
                    if agg[b, h, i, gi]:
                        assert max(g) <= i, "a visible aggregate holds a future token"
                        for p in g:
                            seen[p] += 1
                assert seen == [1] * (i + 1) + [0] * (t - i - 1), (b, h, i, seen)
                if selection == "causal":  # chunk j sees its own and the previous chunk raw, all of it
                    assert all(raw[b, h, i, j] for j in range(max(0, (i // c - 1) * c), i + 1))


def test_causal_chunks_compress_with_the_configured_shares():
    module = dga(selection="causal", chunk_size=16, group_size=4, gamma=0.25, sample_recent=3, sample_random=4)
    q, k, v, _ = inputs(t=64)
    comp = module._compress_uncached(q, ref.expand_kv(k, 4), ref.expand_kv(v, 4), 63)[0]
    # queries of chunk 3 see chunks 0 and 1 compressed: 4 focal + 3 groups of 4 each
    assert comp.focal_pos.shape == (2, 4, 2, 4) and comp.members.shape == (2, 4, 2, 3, 4)
    assert (comp.focal_pos[:, :, 1] // 16 == 1).all() and (comp.members[:, :, 1] // 16 == 1).all()


@pytest.mark.parametrize("impl", ["reference", "auto"])
def test_causal_selection_is_causal_and_the_sequence_form_leaks(impl):
    q, k, v, hidden = inputs(t=40)
    for selection, leaks in (("causal", False), ("sequence", True)):
        module = dga(selection=selection, chunk_size=8, **SMALL)
        base = run(module, q, k, v, hidden, impl).output
        worst = 0.0
        for t in (20, 30, 39):
            q2, k2 = q.clone(), k.clone()
            q2[:, :, t] += 3.0
            k2[:, :, t] -= 3.0
            out = run(module, q2, k2, v, hidden, impl).output
            worst = max(worst, (out[:, :, :t] - base[:, :, :t]).abs().max().item())
        assert (worst > 1e-6) == leaks, (selection, worst)


def test_gradients_reach_queries_through_the_group_weights():
    module = dga(selection="causal", chunk_size=8, **SMALL)
    q, k, v, hidden = inputs(t=33)
    q.requires_grad_(True)
    run(module, q, k, v, hidden, "auto").output[:, :, -1].sum().backward()
    # the last query's own gradient, plus those of earlier groups' last tokens (aggregation weights)
    touched = (q.grad.abs().sum(-1) > 0).any(0).any(0)
    assert touched[-1] and touched[:16].any()


@pytest.mark.parametrize(
    "options,key",
    [
        (dict(selection="chunked"), "selection"),
        (dict(gamma=0.0), "gamma"),
        (dict(gamma=1.5), "gamma"),
        (dict(group_size=0), "group_size"),
        (dict(sample_recent=0), "sample_recent"),
        (dict(chunk_size=8, group_size=16), "chunk_size"),
        (dict(decode_fold=0.9), "decode_fold"),
    ],
)
def test_bad_options_are_one_line_config_errors(options, key):
    with pytest.raises(ConfigError, match=f"model.attention.dga.{key}") as err:
        DGAConfig(**options).validate("model.attention.dga.")
    assert "\n" not in str(err.value)


def test_bfloat16_compression_equals_float64_within_bfloat16_rounding():
    """The aggregation matmuls run in the inputs' dtype (bf16 on the GPU, no float32 copies of the gathered members),
    the group softmax in float32: on the same bf16-rounded inputs the selection equals float64's exactly and the
    aggregated keys and values are within bf16 rounding of it (|error| <= 3e-2 on values of scale 2; issue 36,
    item 4)."""
    q, k, v, _ = inputs(t=150)
    k, v = ref.expand_kv(k, 4), ref.expand_kv(v, 4)
    q, k, v = (x.bfloat16() for x in (q, k, v))
    module = dga(chunk_size=16, **SMALL)
    low = module.float()._compress_causal(q, k, v, 0, 6)[0]  # module parameters do not enter compression
    wide = module._compress_causal(q.double(), k.double(), v.double(), 0, 6)[0]
    assert torch.equal(low.focal_pos, wide.focal_pos) and torch.equal(low.members, wide.members)
    assert low.agg_k.dtype == torch.bfloat16
    for got, want in ((low.agg_k, wide.agg_k), (low.agg_v, wide.agg_v)):
        torch.testing.assert_close(got.double(), want, atol=3e-2, rtol=2e-2)


def test_causal_training_forward_compiles_in_one_graph_on_the_cpu():
    """Compiled on the CPU (``train.compile``: the gathered path, not the fused kernel) the causal form reads its
    query span from the shapes, not from ``q_pos`` (a host read broke the graph once per block and layer), and keeps
    the kept rows by a slice rather than a mask; output and statistics equal the eager call's."""
    import torch._dynamo

    q, k, v, hidden = inputs(t=37)
    module = dga(selection="causal", chunk_size=8, **SMALL)
    eager = run(module, q, k, v, hidden, "gathered")  # sets module.impl for the compiled calls too
    torch._dynamo.reset()

    def call(q, k, v, hidden, positions):
        return module(q, k, v, hidden=hidden, positions=positions)

    explained = torch._dynamo.explain(call)(q, k, v, hidden, torch.arange(q.shape[2]))
    assert explained.graph_break_count == 0, explained.break_reasons
    torch._dynamo.reset()
    compiled = torch.compile(call, backend="eager")(q, k, v, hidden, torch.arange(q.shape[2]))
    torch.testing.assert_close(compiled.output, eager.output, atol=0, rtol=0)
    torch.testing.assert_close(compiled.stats["key_ratio"], eager.stats["key_ratio"], atol=0, rtol=0)
