"""Paper pins for ``prescored_hyper`` (papers/prescored-hyperattention.txt, sections 2-4; SPEC 3.6).

- HyperAttention (Han et al., Algorithm 2 / the paper's section 2): a non-causal block's row is estimated
  from its sorted-LSH block (weight 1) plus s residual columns drawn uniformly from the n keys, weighted
  n / s: an unbiased estimate of the row's remaining softmax mass. Causal by recursive halving; below
  ``min_seq_len`` queries a diagonal block is exact causal attention.
- Pre-scoring (Algorithm 1): only the top ``top_k`` keys by score enter the HyperAttention blocks; scores
  are leverage scores ``k_j^T (K^T K + eps I)^-1 k_j`` or closeness to the k-means / k-median centres;
  fewer than ``min_keys`` survivors: plain HyperAttention over all keys.

The weights are read from the module's output: with q = 0 every score is 0 and with one-hot values
(v_j = e_j) query i's output is w_ij / sum_j w_ij, and the diagonal key i (exact block, weight 1) gives
the normaliser, so ``out_i[j] / out_i[i]`` is the weight w_ij itself.
"""

from __future__ import annotations

import math

import pytest
import torch

from model.attention import LayerSpec, build_attention
from model.attention.prescored_hyper import PrescoredHyperConfig
from tests.attention.pins import F64, IMPLS, assert_matches, causal, expected, qkv, repeat_kv, run_module

T = 16
SPEC = LayerSpec(d_model=16, n_heads=1, n_kv_heads=1, head_dim=T, max_seq_len=32, layer_idx=0, n_layers=1)
# 16 queries: exact causal blocks for queries 0-7 and 8-15, and one non-causal HyperAttention block (queries 8-15
# against keys 0-7, n = 8 keys in LSH blocks of 4 queries)
SMALL = dict(block_size=4, min_seq_len=8, lsh_bits=3)


def weights(module, k, impl):
    """[T, T] w_ij / w_ii read from the output (q = 0, v = identity)."""
    module.impl = impl
    q = torch.zeros(1, 1, T, T, dtype=torch.float64)
    v = torch.eye(T, dtype=torch.float64)[None, None]
    out = module(q, k, v, hidden=torch.zeros(1, T, 16, dtype=torch.float64), positions=torch.arange(T)).output[0, 0]
    return out / out.diagonal()[:, None]


def hyper(seed=0, **options):
    return build_attention("prescored_hyper", PrescoredHyperConfig(seed=seed, **{**SMALL, **options}), SPEC).double()


@pytest.mark.parametrize("impl", IMPLS)
def test_exact_limit_is_causal_softmax(impl):
    """Section 3 / SPEC 3.6: with every key kept and every column sampled (n / s = 1) the estimate is exact
    causal attention, values and gradients; the default config below ``min_seq_len`` (2048) likewise."""
    q, k, v = qkv(1, 1, 1, T, T, seed=1, scale=0.5)

    def full(q, k, v):
        s = (q @ k.transpose(-1, -2) / math.sqrt(T)).masked_fill(~causal(T), -math.inf)
        return torch.softmax(s, -1) @ v

    want = expected(full, q, k, v)
    for module in (hyper(top_k=64, sample_size=64), build_attention("prescored_hyper", PrescoredHyperConfig(), SPEC)):
        assert_matches(run_module(module.double(), q, k, v, impl=impl), want, f"prescored exact/{impl}")


@pytest.mark.parametrize("impl", IMPLS)
def test_residual_columns_weigh_n_over_s(impl):
    """HyperAttention's residual estimate: in the non-causal block every weight is 0, 1 (the query's LSH block)
    or n / s = 8 / 2 = 4 (a sampled column outside the block), exactly s columns are sampled per row and the
    exact blocks weigh 1."""
    _, k, _ = qkv(1, 1, 1, T, T, seed=2)
    w = weights(hyper(top_k=64, sample_size=2), k, impl)
    exact = causal(T) & ((torch.arange(T)[:, None] // 8) == (torch.arange(T)[None, :] // 8))
    torch.testing.assert_close(w[exact], torch.ones(int(exact.sum()), dtype=torch.float64), **F64)
    block = w[8:, :8]
    is_one, is_four = (block - 1).abs() < 1e-9, (block - 4).abs() < 1e-9
    assert bool((is_one | is_four | (block.abs() < 1e-12)).all()), f"weights other than 0, 1, n/s:\n{block}"
    assert bool(is_four.any()), "some residual column must be sampled outside the query's block"
    assert bool((is_four.sum(-1) <= 2).all()) and bool((is_one.sum(-1) >= 1).all())


@pytest.mark.parametrize("impl", IMPLS)
def test_recursive_halving_is_exact_up_to_min_seq_len(impl):
    """Causal HyperAttention by recursive halving: a block of at most ``min_seq_len`` (8) queries is exact causal
    attention (every weight 1), halved no further; the 8 later queries estimate keys 0-7 from single-key LSH blocks
    (``block_size = 1``) plus one residual column of weight n / s = 8."""
    _, k, _ = qkv(1, 1, 1, T, T, seed=8)
    w = weights(hyper(top_k=64, sample_size=1, block_size=1), k, impl)
    diagonal = causal(T) & ((torch.arange(T)[:, None] // 8) == (torch.arange(T)[None, :] // 8))
    torch.testing.assert_close(w[diagonal], torch.ones(int(diagonal.sum()), dtype=torch.float64), **F64)
    block = w[8:, :8]
    values = {round(x, 9) for x in block.flatten().tolist()}
    assert values <= {0.0, 1.0, 8.0} and 8.0 in values, f"non-causal block weights: {sorted(values)}"
    assert bool(((block - 1).abs() < 1e-9).sum(-1).eq(1).all()), "each query's LSH block holds one key"


@pytest.mark.parametrize("impl", IMPLS)
def test_estimate_is_unbiased_over_residual_samples(impl):
    """The residual columns make the estimate unbiased: over the seeds (which redraw the LSH and the samples)
    each non-causal weight has mean P(in block) + P(out) (s / n)(n / s) = 1. 120 seeds; weights are in
    {0, 1, 4}, so the mean of each key's weight is within 4 standard errors of 1 (and a weight of 1 instead of
    n / s would give 0.625)."""
    _, k, _ = qkv(1, 1, 1, T, T, seed=3)
    n_seeds = 120
    total = torch.zeros(8, 8, dtype=torch.float64)
    sq = torch.zeros(8, 8, dtype=torch.float64)
    for seed in range(n_seeds):
        w = weights(hyper(seed=seed, top_k=64, sample_size=2), k, impl)[8:, :8]
        total += w
        sq += w * w
    mean = total / n_seeds
    stderr = ((sq / n_seeds - mean**2).clamp(min=0) / n_seeds).sqrt()
    assert bool(((mean - 1).abs() <= 4 * stderr.clamp(min=0.05)).all()), f"mean weights:\n{mean}"
    assert abs(mean.mean().item() - 1) < 0.06


def kept(module, k, impl):
    """Kept keys among 0-7, read from the non-causal block with every column sampled (weight 1 each)."""
    w = weights(module, k, impl)[8:, :8]
    return set(torch.nonzero((w > 0.5).any(0)).flatten().tolist())


@pytest.mark.parametrize("impl", IMPLS)
def test_leverage_scoring_keeps_the_top_leverage_keys(impl):
    """Algorithm 1 with leverage scores l_j = k_j^T (K^T K + eps I)^-1 k_j (the hat matrix's diagonal, not the
    squared norm): the 8 kept keys are the top 8 by l."""
    _, k, _ = qkv(1, 1, 1, T, 4, seed=4)
    k = torch.nn.functional.pad(k, (0, T - 4)) * torch.linspace(0.5, 3.0, T)[:, None]  # norms unlike leverage
    kk = k[0, 0]
    lev = torch.einsum("td,de,te->t", kk, torch.linalg.inv(kk.T @ kk + 1e-6 * torch.eye(T, dtype=kk.dtype)), kk)
    top = set(lev.topk(8).indices.tolist())
    assert top != set(kk.norm(dim=-1).topk(8).indices.tolist()), "leverage and norms must disagree on this input"
    module = hyper(scoring="leverage", top_k=8, min_keys=4, sample_size=64)
    assert kept(module, k, impl) == {j for j in top if j < 8}


@pytest.mark.parametrize("scoring", ["kmeans", "kmedian"])
@pytest.mark.parametrize("impl", IMPLS)
def test_cluster_scoring_keeps_the_planted_heavy_groups(scoring, impl):
    """Section 3.2's model: three tight groups of 4 similar keys (directions e0, e1, e2) and 4 diffuse keys near
    e0 but off it. k-means / k-median with 3 centres keeps the keys closest to their centre: the 12 grouped
    keys survive ``top_k = 12`` and the diffuse ones (positions 1, 3, 5, 7) go."""
    g = torch.Generator().manual_seed(5)
    rows = []
    diffuse = {1, 3, 5, 7}
    groups = iter([0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2])
    for j in range(T):
        x = torch.zeros(T, dtype=torch.float64)
        if j in diffuse:
            x[0], x[4 + j // 2] = 0.8, 0.6
        else:
            x[next(groups)] = 1.0
            x += 1e-3 * torch.randn(T, generator=g, dtype=torch.float64)
        rows.append(x)
    k = torch.stack(rows)[None, None]
    module = hyper(scoring=scoring, top_k=12, min_keys=4, sample_size=64, n_clusters=3, kmeans_iters=10)
    assert kept(module, k, impl) == {0, 2, 4, 6}


@pytest.mark.parametrize("impl", IMPLS)
def test_too_few_survivors_fall_back_to_plain_hyperattention(impl):
    """Algorithm 1's fallback: ``top_k`` below ``min_keys`` keeps every key (here all 8 of the block)."""
    _, k, _ = qkv(1, 1, 1, T, T, seed=6)
    assert kept(hyper(scoring="leverage", top_k=4, min_keys=6, sample_size=64), k, impl) == set(range(8))
    assert len(kept(hyper(scoring="leverage", top_k=6, min_keys=6, sample_size=64), k, impl)) < 8


def test_gqa_heads_share_the_kept_keys_of_their_kv_head():
    """Pre-scoring is per KV head: two query heads on one KV head see the same kept keys and, in the exact limit,
    each is causal softmax attention over the shared keys."""
    spec = LayerSpec(d_model=16, n_heads=2, n_kv_heads=1, head_dim=8, max_seq_len=32, layer_idx=0, n_layers=1)
    module = build_attention("prescored_hyper", PrescoredHyperConfig(top_k=64, sample_size=64, **SMALL), spec)
    q, k, v = qkv(1, 2, 1, T, 8, seed=7)

    def full(q, k, v):
        s = (q @ repeat_kv(k, 2).transpose(-1, -2) / math.sqrt(8)).masked_fill(~causal(T), -math.inf)
        return torch.softmax(s, -1) @ repeat_kv(v, 2)

    assert_matches(run_module(module.double(), q, k, v, impl="auto"), expected(full, q, k, v), "prescored gqa")
