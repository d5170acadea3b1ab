"""Pre-scoring of the keys (Algorithm 1), the fast forms: k-means / k-median closeness (``cluster_scores``) and
leverage scores (``leverage_scores``). ``naive.cluster_scores_dense`` is the clustering's dense reference."""

from __future__ import annotations

import torch
from torch import Tensor

_CHUNK_ELEMS = 1 << 20  # float64 elements of one chunk's temporaries (8 MiB): bounds the scoring's memory


def _row_chunks(n_rows: int, per_row: int) -> range:
    """Starts of row chunks holding about ``_CHUNK_ELEMS`` elements of ``per_row`` each."""
    return range(0, n_rows, max(1, _CHUNK_ELEMS // max(per_row, 1)))


def _sq_dist_to(x: Tensor, c: Tensor) -> Tensor:
    """||x_t - c||^2 per row: x [N, T, D], c [N, D] -> [N, T], the exact difference form, chunked over T."""
    step = max(1, _CHUNK_ELEMS // max(x.shape[0] * x.shape[2], 1))
    return torch.cat([(x[:, i : i + step] - c[:, None]).square().sum(-1) for i in range(0, x.shape[1], step)], 1)


def _farthest_point_init(x: Tensor, n: int) -> Tensor:
    """[N, T, D] -> [N, n, D]: first point, then repeatedly the point farthest from those chosen."""
    centers = [x[:, 0]]
    dist = _sq_dist_to(x, x[:, 0])
    for _ in range(1, n):
        nxt = x.gather(1, dist.argmax(-1)[:, None, None].expand(-1, 1, x.shape[-1]))[:, 0]
        centers.append(nxt)
        dist = torch.minimum(dist, _sq_dist_to(x, nxt))
    return torch.stack(centers, 1)


def _nearest_l2(x: Tensor, c: Tensor) -> Tensor:
    """Nearest centre of each row in squared L2: [N, T] indices. ||c||^2 - 2 x.c by one matmul ([N, T, n], not
    the [N, T, n, D] differences); ||x||^2 is the same for every centre of a row, so it is left out."""
    return (c.square().sum(-1)[:, None, :] - 2.0 * (x @ c.transpose(1, 2))).argmin(-1)


def _nearest_l1(x: Tensor, c: Tensor) -> Tensor:
    """Nearest centre of each row in L1: [N, T] indices, exact differences chunked over T."""
    n, t, d = x.shape
    k = c.shape[1]
    return torch.cat(
        [
            (x[:, i : i + step, None, :] - c[:, None]).abs().sum(-1).argmin(-1)
            for step in [max(1, _CHUNK_ELEMS // max(n * k * d, 1))]
            for i in range(0, t, step)
        ],
        1,
    )


def _cluster_medians(x: Tensor, sorted_x: Tensor, order: Tensor, assign: Tensor, count: Tensor) -> Tensor:
    """Coordinate-wise lower median of each cluster's members: [N, n, D] (NaN where a cluster is empty), as
    ``nanmedian`` gives it, from the keys sorted once per coordinate: a stable sort of their cluster ids lays
    each cluster's values out in ascending order, and the median is its ((count - 1) // 2)-th."""
    cid = assign.gather(1, order.flatten(1)).view_as(order)  # [N, T, D] cluster of each sorted value
    by_cluster = sorted_x.gather(1, torch.sort(cid, dim=1, stable=True).indices)
    start = torch.cumsum(count, 1) - count  # [N, n] first slot of each cluster
    pick = (start + (count - 1).clamp(min=0) // 2).long()
    med = by_cluster.gather(1, pick[..., None].expand(-1, -1, x.shape[-1]).clamp(max=x.shape[1] - 1))
    return torch.where(count[..., None] > 0, med, torch.nan)


def cluster_scores(keys: Tensor, n_clusters: int, iters: int, *, median: bool = False) -> Tensor:
    """k-means (or k-median) closeness scores per key: keys [B, H, T, D] -> [B, H, T] (higher = keep).

    ``cluster_scores_dense`` is the reference; this holds no [T, n_clusters, D] differences: assignment by a
    matmul (k-means) or chunked exact L1 (k-median), centroid sums by ``scatter_add``, medians by sorting."""
    b, h, t, d = keys.shape
    flat = keys.reshape(b * h, t, d)
    x = torch.empty(b * h, t, d, dtype=torch.float64, device=keys.device)
    step = _row_chunks(t, b * h * d).step
    for i in range(0, t, step):  # normalised chunk by chunk: no whole float64 copy beside x
        x[:, i : i + step] = torch.nn.functional.normalize(flat[:, i : i + step].to(torch.float64), dim=-1)
    n = min(n_clusters, t)
    centers = _farthest_point_init(x, n)
    nearest = _nearest_l1 if median else _nearest_l2
    if median and iters > 0:
        sorted_x, order = x.sort(dim=1)  # once: the keys do not move, only their clusters do
    for _ in range(iters):
        assign = nearest(x, centers)  # [N, T]
        count = torch.zeros(b * h, n, dtype=x.dtype, device=x.device).scatter_add_(
            1, assign, torch.ones_like(assign, dtype=x.dtype)
        )
        if median:
            new = _cluster_medians(x, sorted_x, order, assign, count)
        else:
            sums = torch.zeros_like(centers).scatter_add_(1, assign[..., None].expand(-1, -1, d), x)
            new = sums / count.clamp(min=1)[..., None]
        centers = torch.where(count[..., None] > 0, new, centers)  # an empty cluster keeps its centre
    # the score is the exact distance to the nearest centre (the reference's value, not the matmul form's)
    dist = []
    for i in range(0, t, step):
        xi = x[:, i : i + step]
        diff = xi - centers.gather(1, nearest(xi, centers)[..., None].expand(-1, -1, d))
        dist.append(diff.abs().sum(-1) if median else diff.square().sum(-1))
    return -torch.cat(dist, 1).reshape(b, h, t)


def leverage_scores(keys: Tensor, eps: float) -> Tensor:
    """Leverage score of each key row: rowsum((K G^-1) * K) with G = K^T K + eps I, per (batch, head)."""
    k = keys.to(torch.float64)
    g = k.transpose(-1, -2) @ k + eps * torch.eye(k.shape[-1], dtype=k.dtype, device=k.device)
    kg = torch.linalg.solve(g, k.transpose(-1, -2)).transpose(-1, -2)  # K G^-1 (G symmetric)
    return (kg * k).sum(-1)
