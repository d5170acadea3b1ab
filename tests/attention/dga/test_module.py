"""Dynamic Group Attention: limits that equal full attention, the appendix D mask against a
brute-force construction, causality of the chunked selection, the grouped KV caches."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from core.errors import ConfigError
from model.attention import KVCache, LayerSpec, build_attention
from model.attention.common import reference as ref
from model.attention.common.base import kv_cache_nbytes
from model.attention.dga import cpu, flex, naive
from model.attention.dga.config import DGAConfig, focal_count

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


def masks(module, comp, pos):
    """Appendix D's dense masks (raw keys, aggregates) of ``comp`` for queries and keys at ``pos``."""
    cfg = module.cfg
    return naive.masks(comp.focal_pos, comp.members, pos, pos, selection=cfg.selection, chunk_size=cfg.chunk_size)


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


PARTS_CASES = [
    dict(selection="causal", chunk_size=8, group_size=2, gamma=0.2, sample_recent=2, sample_random=3),
    dict(selection="causal", chunk_size=7, group_size=3, gamma=0.15, sample_recent=1, sample_random=2),
    dict(selection="causal", chunk_size=8, group_size=4, gamma=0.5, sample_recent=3, sample_random=1),
    dict(selection="sequence", group_size=2, gamma=0.2, sample_recent=2, sample_random=3),
    dict(selection="sequence", group_size=3, gamma=0.3, sample_recent=2, sample_random=3),
]


@pytest.mark.parametrize("impl", ["auto", "gathered"])
@pytest.mark.parametrize("t", [37, 40])
@pytest.mark.parametrize("options", PARTS_CASES, ids=lambda o: f"{o['selection']}-m{o['group_size']}-g{o['gamma']}")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_parts_form_equals_the_dense_reference(options, t, impl, dtype, monkeypatch):
    """The memory-linear parts form (cpu.py; impl "auto" on the CPU) and the gathered form against the dense
    float64 reference: values and gradients for q, k, v, batch 2, GQA, T a multiple of no block (37) or of the chunk
    (40). float64 within 1e-10; float32 within 1e-5 of each tensor's largest magnitude (the float32 reference itself
    is off by about 5e-6 of it). Small groups of chunks and sequence blocks exercise the staircase masks and several
    blocks."""
    monkeypatch.setattr(cpu, "COMPRESSED_ROWS", 16)
    monkeypatch.setattr(cpu, "SEQUENCE_BLOCK", 8)
    calls = []
    forward = cpu._FWD
    monkeypatch.setattr(cpu, "_FWD", lambda *a, **kw: calls.append(1) or forward(*a, **kw))
    weight = torch.randn(2, 4, t, 8, generator=torch.Generator().manual_seed(t), dtype=torch.float64)
    results = []
    for path, dt in (("reference", torch.float64), (impl, dtype)):
        module = dga(**options).to(dt)
        q, k, v, hidden = (x.to(dt).requires_grad_(True) for x in inputs(t=t, seed=t))
        out = run(module, q, k, v, hidden, path)
        (out.output * weight.to(dt)).sum().backward()
        results.append([x.detach().double() for x in (out.output, q.grad, k.grad, v.grad, out.stats["key_ratio"])])
    for name, want, got in zip(("output", "dq", "dk", "dv", "key_ratio"), *results):
        atol = 1e-10 if dtype == torch.float64 else 1e-5 * float(want.abs().max())
        torch.testing.assert_close(got, want, atol=atol, rtol=0, msg=lambda m, name=name: f"{name}: {m}")
    assert bool(calls) == (impl == "auto"), "the CPU training forward takes the parts form"


def feed(module, q, k, v, hidden, cache, calls):
    """Run the cached module over consecutive calls of the given lengths; the outputs, concatenated."""
    outs, p = [], cache.length
    for t in calls:
        positions = torch.arange(p, p + t)
        sl = slice(p, p + t)
        outs.append(
            module(q[:, :, sl], k[:, :, sl], v[:, :, sl], hidden=hidden[:, sl], positions=positions, cache=cache).output
        )
        p += t
    return torch.cat(outs, 2)


@pytest.mark.parametrize(
    "calls",
    [[13] + [1] * 47, [1] * 60, [3, 20, 1, 1, 9, 1, 8, 16, 1], [60], [7, 7, 7, 39]],
    ids=["prefill-then-decode", "decode-only", "mixed-chunks", "one-prefill", "short-chunks"],
)
def test_causal_grouped_cache_decode_equals_the_uncached_forward_and_is_smaller(calls):
    module = dga(selection="causal", chunk_size=8, **SMALL)
    q, k, v, hidden = inputs(t=60)
    full = run(module, q, k, v, hidden, "auto").output
    cache = KVCache(2, 2, 8, 60, dtype=torch.float64, device="cpu")
    torch.testing.assert_close(feed(module, q, k, v, hidden, cache, calls), full, atol=1e-12, rtol=1e-10)
    assert cache.length == 60 and cache.k.numel() == 0 and cache.v.numel() == 0, "the raw max_len buffers are freed"
    size = module.cache_size(cache)
    # the last query (59, chunk 7) needed chunks 0..5 folded: 6 * (2 focal + 3 groups); raw keys and queries
    # are held from its window (chunk 6, position 48) on
    entries, held = 6 * 5, 60 - 48
    # preallocated once from max_len: every entry the cache can reach, plus 2C + 1 raw keys and queries
    # (batch 2, 4 query heads, head dim 8, float64)
    nbytes = (2 * (entries + 2 * 8 + 1) + (2 * 8 + 1)) * 2 * 4 * 8 * 8
    assert size == {"full_kv_slots": 60, "dga_kv_slots": entries + held, "dga_query_slots": held, "bytes": nbytes}
    assert kv_cache_nbytes(cache) == nbytes


def test_causal_cache_allocates_under_a_quarter_of_full_attention():
    """The bench's configuration (C = 128, m = 16, gamma = 0.1, no GQA) at an 8K context: allocated bytes,
    measured from the tensors the caches hold, and the decoded tokens against the uncached forward."""
    spec = LayerSpec(d_model=64, n_heads=4, n_kv_heads=4, head_dim=16, max_seq_len=8200, layer_idx=0, n_layers=1)
    module = build_attention("dga", DGAConfig(chunk_size=128, group_size=16), spec).double()
    ctx, total = 8192, 8200
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 4, total, 16, generator=g, dtype=torch.float64) for _ in range(3))
    hidden = torch.zeros(1, total, 64, dtype=torch.float64)
    cache = KVCache(1, 4, 16, total, dtype=torch.float64, device="cpu")
    full_cache = KVCache(1, 4, 16, total, dtype=torch.float64, device="cpu")
    full_cache.append(k, v)
    with torch.no_grad():
        decoded = feed(module, q, k, v, hidden, cache, [3000, 2000, 3192] + [1] * 8)[:, :, ctx:]
        # the uncached fast path's composition for the last queries only: every chunk compressed from the
        # whole sequence's inputs, then each query's visible entries and raw window
        _, (ck, cv, avail) = module._compress_causal(q, k, v, 0, module._needed_chunks(total - 1))
        uncached = module._attend_window(q[:, :, ctx:], torch.arange(ctx, total), k, v, ck, cv, avail)[0]
    torch.testing.assert_close(decoded, uncached, atol=1e-12, rtol=1e-10)
    assert kv_cache_nbytes(full_cache) == 2 * 4 * total * 16 * 8
    ratio = kv_cache_nbytes(cache) / kv_cache_nbytes(full_cache)
    assert ratio <= 0.25, ratio
    assert module.cache_size(cache)["bytes"] == kv_cache_nbytes(cache)


def test_kv_cache_nbytes_counts_each_storage_once():
    cache = KVCache(2, 3, 4, 10, dtype=torch.float32, device="cpu")
    assert kv_cache_nbytes(cache) == 2 * (2 * 3 * 10 * 4 * 4)
    cache.extra["views"] = {"k": cache.k[:, :, :2], "both": [cache.v[:, 1:], torch.zeros(5, dtype=torch.float64)]}
    assert kv_cache_nbytes(cache) == 2 * (2 * 3 * 10 * 4 * 4) + 5 * 8


def paper_decode_reference(module, q, k, v, prompt_len):
    """Prefill-then-decode, recomputed from the raw history per (batch, head) with plain lists:
    prompt compressed by the sequence form, then every generated token kept raw until m' of them,
    when the top m'-m by the last query's score stay focal and the other m fold into one group."""
    cfg = module.cfg
    m = cfg.group_size
    m_fold = math.ceil(round(cfg.decode_fold * m, 9))
    scale = 1 / math.sqrt(q.shape[-1])
    kx, vx = ref.expand_kv(k, q.shape[1]), ref.expand_kv(v, q.shape[1])
    comp = module._compress_sequence(q[:, :, :prompt_len], kx[:, :, :prompt_len], vx[:, :, :prompt_len])[0]
    b, h, t_all, d = q.shape
    out = torch.zeros(b, h, t_all - prompt_len, d, dtype=q.dtype)
    folds = 0
    for bi in range(b):
        for hi in range(h):
            keys = [kx[bi, hi, p] for p in comp.focal_pos[bi, hi, 0].tolist()] + list(comp.agg_k[bi, hi, 0])
            values = [vx[bi, hi, p] for p in comp.focal_pos[bi, hi, 0].tolist()] + list(comp.agg_v[bi, hi, 0])
            buffer = []
            for t in range(prompt_len, t_all):
                buffer.append(t)
                kk = torch.stack(keys + [kx[bi, hi, j] for j in buffer])
                vv = torch.stack(values + [vx[bi, hi, j] for j in buffer])
                out[bi, hi, t - prompt_len] = torch.softmax(kk @ q[bi, hi, t] * scale, 0) @ vv
                if len(buffer) == m_fold:
                    s = {j: float(kx[bi, hi, j] @ q[bi, hi, t]) * scale for j in buffer}
                    focal = sorted(sorted(buffer, key=lambda j: -s[j])[: m_fold - m])
                    group = [j for j in buffer if j not in focal]
                    w = torch.softmax(torch.tensor([s[j] for j in group], dtype=q.dtype), 0)
                    keys += [kx[bi, hi, j] for j in focal] + [sum(wi * kx[bi, hi, j] for wi, j in zip(w, group))]
                    values += [vx[bi, hi, j] for j in focal] + [sum(wi * vx[bi, hi, j] for wi, j in zip(w, group))]
                    buffer = []
                    folds += 1
    return out, folds // (b * h)


@pytest.mark.parametrize("m,fold", [(2, 1.1), (3, 1.5), (4, 1.1)])
def test_sequence_grouped_cache_decode_equals_prefill_then_decode_reference(m, fold):
    module = dga(selection="sequence", group_size=m, gamma=0.2, sample_recent=2, sample_random=3, decode_fold=fold)
    prompt, total = 15, 40
    q, k, v, hidden = inputs(t=total, seed=m)
    cache = KVCache(2, 2, 8, total, dtype=torch.float64, device="cpu")
    pre = module(
        q[:, :, :prompt],
        k[:, :, :prompt],
        v[:, :, :prompt],
        hidden=hidden[:, :prompt],
        positions=torch.arange(prompt),
        cache=cache,
    ).output
    torch.testing.assert_close(
        pre,
        run(module, q[:, :, :prompt], k[:, :, :prompt], v[:, :, :prompt], hidden[:, :prompt], "reference").output,
        atol=1e-12,
        rtol=1e-10,
    )
    outs = []
    for t in range(prompt, total):
        outs.append(
            module(
                q[:, :, t : t + 1],
                k[:, :, t : t + 1],
                v[:, :, t : t + 1],
                hidden=hidden[:, t : t + 1],
                positions=torch.arange(t, t + 1),
                cache=cache,
            ).output
        )
    expected, folds = paper_decode_reference(module, q, k, v, prompt)
    assert folds >= 3
    torch.testing.assert_close(torch.cat(outs, 2), expected, atol=1e-12, rtol=1e-10)
    m_fold = math.ceil(round(fold * m, 9))
    r = focal_count(prompt, 0.2, 1, m)
    size = module.cache_size(cache)
    pending = (total - prompt) % m_fold
    slots = r + (prompt - r) // m + folds * (m_fold - m + 1) + pending
    assert size["dga_kv_slots"] == slots
    assert cache.k.numel() == 0 and cache.v.numel() == 0, "the raw max_len buffers are freed"
    assert size["bytes"] == kv_cache_nbytes(cache) == 2 * slots * 2 * 4 * 8 * 8  # k and v, [2, 4, slots, 8] float64


def test_sequence_cache_must_start_with_a_prefill():
    module = dga(selection="sequence", **SMALL)
    q, k, v, hidden = inputs(t=4)
    cache = KVCache(2, 2, 8, 8, dtype=torch.float64, device="cpu")
    cache.length = 2
    with pytest.raises(ValueError, match="prefill"):
        module(q[:, :, :2], k[:, :, :2], v[:, :, :2], hidden=hidden[:, :2], positions=torch.arange(2, 4), cache=cache)


@pytest.mark.parametrize("selection", ["causal", "sequence"])
def test_flex_mask_mod_equals_the_reference_forward(selection):
    """CPU FlexAttention has no backward: the mask_mod composition is checked forward-only here
    (eager flex); on CUDA it is the fast path and the shared suite compares values and gradients."""
    module = dga(selection=selection, chunk_size=8, **SMALL)
    q, k, v, hidden = inputs(t=37)
    kx, vx = ref.expand_kv(k, 4), ref.expand_kv(v, 4)
    pos = torch.arange(37)
    comp, (ck, cv, avail) = module._compress_uncached(q, kx, vx, 36)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = flex.attention(
            q,
            kx,
            vx,
            comp.focal_pos,
            comp.members,
            ck,
            cv,
            avail,
            pos,
            selection=selection,
            chunk_size=8,
            entries_per_chunk=module._entries_per_chunk(),
            scale=module.scale,
        )
    torch.testing.assert_close(out, run(module, q, k, v, hidden, "reference").output, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("t,c,e,n", [(37, 8, 5, 15), (64, 8, 3, 18), (50, 7, 4, 0), (29, 16, 6, 6)])
def test_causal_flex_block_lists_cover_every_visible_pair(t, c, e, n):
    """The CUDA causal form's block mask comes from block arithmetic: every visible pair lies in a listed block,
    and a block marked full holds no invisible pair (checked against the pairwise rule, block size 4)."""
    block = 4
    n_pad = -(-n // block) * block
    listed, full = flex.causal_flex_blocks(t, n, n_pad, c, e, torch.device("cpu"), block=block)
    p = torch.arange(t)[:, None]
    kv = torch.arange(n_pad + t)[None, :]
    r = kv - n_pad
    visible = torch.where(kv < n_pad, (kv < n) & ((kv // e + 2) * c <= p), (r >= 0) & (r <= p) & (r // c >= p // c - 1))
    q_blk, k_blk = p // block, kv // block
    for i in range(listed.shape[0]):
        for j in range(listed.shape[1]):
            pairs = visible[(q_blk[:, 0] == i)][:, k_blk[0] == j]
            if pairs.any():
                assert listed[i, j], (i, j)
            if full[i, j]:
                assert pairs.all() and pairs.shape[1] == block, (i, j)  # a last, partial query block may be full
    assert full.sum() > 0 and (listed & ~full).sum() > 0 and not listed.all()


@pytest.mark.slow
def test_causal_flex_form_traces_without_a_graph_break():
    """The CUDA causal form (block mask from arithmetic, FlexAttention) as dynamo sees it, traced on CPU without
    gradients (FlexAttention has no CPU backward under dynamo): one graph, no break (about 7 s of CPU)."""
    module = dga(selection="causal", chunk_size=8, **SMALL).float()
    q, k, v, _ = (x.float() for x in inputs(t=37))
    kx, vx = ref.expand_kv(k, 4), ref.expand_kv(v, 4)
    _, (ck, cv, _) = module._compress_uncached(q, kx, vx, 36)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        explained = torch._dynamo.explain(flex.causal_attention)(
            q,
            kx,
            vx,
            ck,
            cv,
            torch.arange(37),
            chunk_size=8,
            entries_per_chunk=module._entries_per_chunk(),
            scale=module.scale,
        )
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1


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


@pytest.mark.parametrize("q0", [8, 16, 32])
def test_causal_parts_at_an_offset_are_the_whole_sequences_rows(q0):
    """``cpu.CausalPlan(q0=...)`` (context parallelism: a chunk's queries against the keys before and in it) gives the
    whole-sequence plan's rows from q0 on, values and gradients of q, k, v and the entries, float64."""
    t, c, e = 48, 8, 3
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, t, 4, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(3))
    ck, cv = (torch.randn(1, 2, e * (t // c), 4, generator=gen, dtype=torch.float64, requires_grad=True) for _ in "kv")
    w = torch.randn(1, 2, t, 4, generator=gen, dtype=torch.float64)
    w[:, :, :q0] = 0  # only the rows the offset call computes
    whole = cpu.parts_attention(q, k, v, ck, cv, cpu.CausalPlan(t, c, e, torch.float64), 0.5)
    expect = torch.autograd.grad((whole * w).sum(), (q, k, v, ck, cv))
    part = cpu.parts_attention(q[:, :, q0:], k, v, ck, cv, cpu.CausalPlan(t - q0, c, e, torch.float64, q0=q0), 0.5)
    grads = torch.autograd.grad((part * w[:, :, q0:]).sum(), (q, k, v, ck, cv))
    torch.testing.assert_close(part, whole[:, :, q0:], rtol=1e-12, atol=1e-12)
    for g, x in zip(grads, expect, strict=True):
        torch.testing.assert_close(g, x, rtol=1e-12, atol=1e-12)
