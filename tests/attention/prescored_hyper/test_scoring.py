"""Pre-scored HyperAttention's key scorers (Algorithm 1): planted heavy keys are recovered, true leverage scores,
clustering per batch row and head, and the chunked clustering against its dense reference (``naive``)."""

from __future__ import annotations

import pytest
import torch

from model.attention import LayerSpec, build_attention
from model.attention.prescored_hyper import PrescoredHyperConfig, cluster_scores, leverage_scores, naive
from model.attention.prescored_hyper import scoring as scorers

SCORINGS = ["kmeans", "kmedian", "leverage"]


def planted_keys(n=512, d=16, groups=4, per=8, sigma=0.05, seed=0):
    """Section 3.2's model: a few tight groups of keys along orthonormal directions u_i, the rest
    noise in the orthogonal complement; every row unit-normalised (row-norm regularity)."""
    g = torch.Generator().manual_seed(seed)
    basis, _ = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
    rows = torch.empty(n, d, dtype=torch.float64)
    perm = torch.randperm(n, generator=g)
    heavy = perm[: groups * per]
    for i in range(groups):
        rows[heavy[i * per : (i + 1) * per]] = basis[:, i] + sigma * torch.randn(
            per, d, generator=g, dtype=torch.float64
        )
    noise = perm[groups * per :]
    rows[noise] = torch.randn(len(noise), d - groups, generator=g, dtype=torch.float64) @ basis[:, groups:].T
    return torch.nn.functional.normalize(rows, dim=-1), heavy


@pytest.mark.parametrize("scoring", SCORINGS)
def test_planted_heavy_keys_are_recovered(scoring):
    spec = LayerSpec(d_model=64, n_heads=1, n_kv_heads=1, head_dim=16, max_seq_len=512, layer_idx=0, n_layers=1)
    m = build_attention("prescored_hyper", PrescoredHyperConfig(scoring=scoring, top_k=32), spec).double()
    recalls = []
    for seed in range(4):
        keys, heavy = planted_keys(seed=seed)
        kept = m.kept_keys(keys[None, None])[0, 0]
        recalls.append(len(set(kept.tolist()) & set(heavy.tolist())) / len(heavy))
    assert min(recalls) >= 0.95, recalls


def test_leverage_scores_are_the_hat_matrix_diagonal_not_squared_norms():
    k = torch.randn(3, 2, 40, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    k[0, 0, 7] *= 10  # a long row: a squared norm would rank it far above the rest
    lev = leverage_scores(k, 1e-9)
    for b in range(3):
        for h in range(2):
            kk = k[b, h]
            hat = kk @ torch.linalg.inv(kk.T @ kk + 1e-9 * torch.eye(8, dtype=torch.float64)) @ kk.T
            torch.testing.assert_close(lev[b, h], hat.diagonal(), atol=1e-10, rtol=1e-8)
    assert (lev <= 1 + 1e-9).all() and abs(lev.sum(-1) - 8).max() < 1e-6  # trace of a rank-8 projection
    assert lev[0, 0, 7] < 1.0


def test_clustering_is_independent_per_batch_row_and_head():
    k = torch.randn(2, 3, 50, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    for median in (False, True):
        batched = cluster_scores(k, 5, 6, median=median)
        for b in range(2):
            for h in range(3):
                torch.testing.assert_close(
                    batched[b, h], cluster_scores(k[b : b + 1, h : h + 1], 5, 6, median=median)[0, 0]
                )


@pytest.mark.parametrize("median", [False, True], ids=["kmeans", "kmedian"])
@pytest.mark.parametrize("chunk", [1 << 20, 40])  # 40: every chunked loop runs many chunks
def test_chunked_clustering_gives_the_dense_clusters_and_scores(median, chunk, monkeypatch):
    """Same farthest-point start, same Lloyd assignments, same scores as the dense [T, n, D] reference: on
    fixed seeds, float32 and float64 keys, duplicated keys, more centres than keys, no iteration."""
    monkeypatch.setattr(scorers, "_CHUNK_ELEMS", chunk)
    g = torch.Generator().manual_seed(11)
    cases = [
        (torch.randn(2, 3, 97, 8, generator=g, dtype=torch.float64), 5, 6),
        (torch.randn(1, 2, 300, 16, generator=g), 16, 10),
        (torch.randn(1, 1, 7, 4, generator=g, dtype=torch.float64), 16, 3),
        (torch.randn(1, 2, 50, 8, generator=g, dtype=torch.float64), 4, 0),
    ]
    dup = torch.randn(1, 2, 120, 8, generator=g, dtype=torch.float64)
    dup[:, :, :60] = dup[:, :, :1]  # half the keys one point: ties everywhere
    cases.append((dup, 6, 5))
    for keys, n, iters in cases:
        fast = cluster_scores(keys, n, iters, median=median)
        dense = naive.cluster_scores_dense(keys, n, iters, median=median)
        torch.testing.assert_close(fast, dense, atol=1e-10, rtol=0)
        t = keys.shape[2]
        assert torch.equal(fast.topk(t // 3).indices, dense.topk(t // 3).indices)
