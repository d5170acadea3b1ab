"""Dynamic Group Attention's grouped KV caches (``cached.py``): causal decode equals the uncached forward and
allocates a fraction of full attention's bytes; sequence-form decode equals the paper's prefill-then-decode rule."""

from __future__ import annotations

import math

import pytest
import torch

from model.attention import KVCache, LayerSpec, build_attention
from model.attention.common import reference as ref
from model.attention.common.base import kv_cache_nbytes
from model.attention.dga.config import DGAConfig, focal_count
from tests.attention.dga.helpers import SMALL, dga, inputs, run


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
    # (batch 2, 4 query heads, head dim 8, float64), and the static decode step's three int64 counts
    nbytes = (2 * (entries + 2 * 8 + 1) + (2 * 8 + 1)) * 2 * 4 * 8 * 8 + 3 * 8
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
