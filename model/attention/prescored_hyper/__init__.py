"""Pre-scored HyperAttention (papers/prescored-hyperattention.txt, sections 2-4): approximate
attention for long inputs and evaluation.

1. Pre-scoring (Algorithm 1), per batch row and KV head, without gradient:
   - ``kmeans``: Lloyd iterations (vectorised over batch and heads, farthest-point start) on the
     unit-normalised keys (the paper's row-norm regularity; its appendix B shows k-means on raw
     norms can be captured by a few large keys); a key's score is its closeness to its centroid
     (``-||k - c||^2``): the keys closest to the centroids are kept, so tight groups of similar
     keys (the planted heavy keys of section 3.2) survive and the diffuse bulk goes.
   - ``kmedian``: the same with L1 assignment and coordinate-wise median centroids, score ``-||k - c||_1``.
   - ``leverage``: true leverage scores ``rowsum((K G^-1) * K)``, ``G = K^T K + eps I`` (not the
     squared row norm).
   The top ``top_k`` keys are kept and *gathered* (the attention below only touches them).
   When fewer than ``min_keys`` would survive (``top_k = 0`` included), it falls back to plain
   HyperAttention over all keys (Algorithm 2).
2. HyperAttention on the kept keys: causal by recursive halving of the queries: a half attends
   the previous half's kept keys non-causally, and itself recursively; below ``min_seq_len``
   queries a diagonal block is exact causal attention over *all* its keys (so every query sees
   its neighbourhood). A non-causal block is approximated by sorted-LSH block-diagonal
   attention (angular LSH, buckets in Gray-code order, equal-count blocks) plus ``sample_size``
   residual columns drawn uniformly from the kept keys outside the query's block, weighted
   ``n/s`` (an unbiased estimate of the rest of the row), merged by logsumexp.

The approximation is one weighted softmax: query i's output is
``sum_j w_ij e^{s_ij} v_j / sum_j w_ij e^{s_ij}`` with ``w_ij`` in {0, 1, n/s} fixed by the plan
(selection, hashes, samples: discrete, seeded, no gradient). ``reference`` materialises that
T x T weighted softmax; ``fast`` computes it block by block (gathered keys, LSH blocks, sampled
columns, logsumexp merges). Both give the *exact* gradient of the approximate output with
respect to q, k, v at the fixed plan; the plan's discrete choices have zero derivative almost
everywhere, so these are not gradients of exact attention (except in the limit below).

With ``top_k`` and ``sample_size`` at least the number of keys every weight is 1 and the output
is exact causal attention (the ``exact`` suite case). The approximation reads later tokens (the
key selection and the LSH block ranks use the whole call), so the approximate cases are marked
non-causal in the suite. With a KV cache, the cached past is one non-causal block: for a single
decoded query that block is exact attention over the kept past keys.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from core.errors import check_choice, check_min, check_range
from model.attention.common import reference as ref
from model.attention.common.base import (
    Attention,
    AttnOut,
    GpuPath,
    KVCache,
    LayerSpec,
    SuiteCase,
    VariantConfig,
    register_attention,
)

SCORINGS = ("kmeans", "kmedian", "leverage")
_EMPTY = -1e4  # logsumexp of a row with no key: exp(_EMPTY - real lse) is 0 in every float type


@dataclass
class PrescoredHyperConfig(VariantConfig):
    scoring: str = "kmeans"  # kmeans | kmedian | leverage
    top_k: int = 2048  # keys kept per batch row and KV head; >= the key count keeps all
    min_keys: int = 32  # fewer survivors than this: plain HyperAttention over all keys (top_k = 0: always)
    n_clusters: int = 16  # more centroids than heavy groups: Lloyd from a farthest-point start then isolates them
    kmeans_iters: int = 10  # Lloyd iterations of the k-means / k-median scoring
    leverage_eps: float = 1e-6  # ridge term of the leverage scores
    block_size: int = 256  # queries per LSH block
    sample_size: int = 256  # residual columns per non-causal block
    min_seq_len: int = 2048  # exact causal attention below this many queries
    lsh_bits: int = 7  # hash bits of the LSH that sorts keys into blocks
    seed: int = 0  # seed of the LSH and the sampled columns

    def validate(self, prefix: str) -> None:
        key = prefix
        check_choice(key + "scoring", self.scoring, SCORINGS)
        check_min(key + "top_k", self.top_k, 0, note=" (0 = no pre-scoring: plain HyperAttention)")
        check_min(key + "min_keys", self.min_keys, 0)
        check_min(key + "n_clusters", self.n_clusters, 1)
        check_min(key + "kmeans_iters", self.kmeans_iters, 0)
        check_min(key + "leverage_eps", self.leverage_eps, 0.0, strict=True)
        check_min(key + "block_size", self.block_size, 1)
        check_min(key + "sample_size", self.sample_size, 0)
        check_min(key + "min_seq_len", self.min_seq_len, 1)
        check_range(key + "lsh_bits", self.lsh_bits, 1, 16)


# ---- pre-scoring --------------------------------------------------------------------------
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


def cluster_scores_dense(keys: Tensor, n_clusters: int, iters: int, *, median: bool = False) -> Tensor:
    """Reference of ``cluster_scores``: [N, T, n, D] differences, one-hot centroid updates, masked ``nanmedian``."""
    b, h, t, d = keys.shape
    x = torch.nn.functional.normalize(keys.reshape(b * h, t, d).to(torch.float64), dim=-1)
    n = min(n_clusters, t)
    centers = [x[:, 0]]
    first = (x - x[:, :1]).square().sum(-1)
    for _ in range(1, n):
        nxt = x.gather(1, first.argmax(-1)[:, None, None].expand(-1, 1, d))[:, 0]
        centers.append(nxt)
        first = torch.minimum(first, (x - nxt[:, None]).square().sum(-1))
    c0 = torch.stack(centers, 1)

    def distances(c: Tensor) -> Tensor:  # [N, T, n]
        diff = x[:, :, None, :] - c[:, None, :, :]
        return diff.abs().sum(-1) if median else diff.square().sum(-1)

    for _ in range(iters):
        assign = distances(c0).argmin(-1)  # [N, T]
        onehot = torch.nn.functional.one_hot(assign, n).to(x.dtype)  # [N, T, n]
        count = onehot.sum(1)  # [N, n]
        if median:
            member = onehot.transpose(1, 2)[..., None] > 0  # [N, n, T, 1]
            vals = torch.where(member, x[:, None], torch.nan)
            new = vals.nanmedian(dim=2).values
        else:
            new = onehot.transpose(1, 2) @ x / count.clamp(min=1)[..., None]
        c0 = torch.where(count[..., None] > 0, new, c0)
    return -distances(c0).min(-1).values.reshape(b, h, t)


def leverage_scores(keys: Tensor, eps: float) -> Tensor:
    """Leverage score of each key row: rowsum((K G^-1) * K) with G = K^T K + eps I, per (batch, head)."""
    k = keys.to(torch.float64)
    g = k.transpose(-1, -2) @ k + eps * torch.eye(k.shape[-1], dtype=k.dtype, device=k.device)
    kg = torch.linalg.solve(g, k.transpose(-1, -2)).transpose(-1, -2)  # K G^-1 (G symmetric)
    return (kg * k).sum(-1)


def _in_row_chunks(
    fn: Callable[[int, int], tuple[Tensor, Tensor]], n: int, per_row: int, dim: int = 2
) -> tuple[Tensor, Tensor]:
    """``fn(i, j)`` -> (out, lse) of rows [i, j) along ``dim``, over chunks of about ``_CHUNK_ELEMS`` score
    entries, concatenated: the scores of a long piece never exist at once (one call when it fits)."""
    step = max(1, _CHUNK_ELEMS // max(per_row, 1))
    if step >= n:
        return fn(0, n)
    parts = [fn(i, min(n, i + step)) for i in range(0, n, step)]
    return torch.cat([o for o, _ in parts], dim), torch.cat([l_ for _, l_ in parts], dim)


# ---- the plan: pieces of one weighted softmax ------------------------------------------------
@dataclass
class ExactPiece:
    qs: int  # query rows [qs, qe)
    qe: int
    klo: int  # key positions [klo, khi), causal
    khi: int


@dataclass
class HyperPiece:
    qs: int
    qe: int
    kidx: Tensor  # [B, Hkv, K'] key positions (a slice of the kept keys), valid where kvalid
    kvalid: Tensor  # [B, Hkv, K']
    qblock: Tensor  # [B, H, nq] LSH block of each query (rows qs..qe-1)
    qorder: Tensor  # [B, H, nq] queries in (bucket rank, position) order
    kblock: Tensor  # [B, Hkv, K'] LSH block of each key, -1 where invalid
    korder: Tensor  # [B, Hkv, K'] valid keys in (bucket rank, position) order first
    kstart: Tensor  # [B, Hkv, nb + 1] where each block starts in korder
    nb: int
    samples: Tensor  # [B, H, s] residual columns (indices into K')
    svalid: Tensor  # [B, H, s]
    log_w: Tensor  # [B, H] log(n / s) of a sampled column


@register_attention("prescored_hyper", PrescoredHyperConfig)
class PrescoredHyperAttention(Attention):
    description = (
        "pre-scored HyperAttention: an approximation for long inputs; train with full attention and "
        "evaluate with this variant (docs/prescored_hyper.md)"
    )
    trainable = False  # an inference-time approximation (train with full attention)
    projections: Tensor  # buffers
    gray_rank: Tensor

    def __init__(self, cfg: PrescoredHyperConfig, spec: LayerSpec):
        super().__init__(cfg, spec)
        self.scale = 1.0 / math.sqrt(spec.head_dim)
        g = torch.Generator().manual_seed(cfg.seed)
        self.register_buffer("projections", torch.randn(spec.head_dim, cfg.lsh_bits, generator=g), persistent=False)
        gray_rank = torch.empty(2**cfg.lsh_bits, dtype=torch.long)
        for i in range(2**cfg.lsh_bits):
            gray_rank[i ^ (i >> 1)] = i  # bucket code -> its place in the Gray sequence (neighbours differ in one bit)
        self.register_buffer("gray_rank", gray_rank, persistent=False)

    @classmethod
    def suite_cases(cls) -> list[SuiteCase]:
        # Tiny blocks so the suite's 25-40 tokens go through several halvings, LSH blocks and
        # residual samples. "exact" keeps every key and samples every column: all weights are 1.
        small = dict(block_size=4, min_seq_len=4, lsh_bits=3)
        return [
            SuiteCase("exact", dict(top_k=4096, sample_size=4096, **small)),
            SuiteCase(
                "kmeans",
                dict(scoring="kmeans", top_k=16, min_keys=4, sample_size=3, n_clusters=3, kmeans_iters=3, **small),
                causal=False,
            ),
            SuiteCase("leverage", dict(scoring="leverage", top_k=12, min_keys=4, sample_size=2, **small), causal=False),
        ]

    def gpu_paths(self) -> dict[str, GpuPath]:
        # none: an evaluation-time approximation whose plan (pieces, block widths) is built on the host, eager on
        # every device; it does not train, so no training forward is compiled
        return {}

    # ---- plan ---------------------------------------------------------------------------
    def key_scores(self, k: Tensor, *, dense: bool = False) -> Tensor:
        """Scores of the keys; ``dense`` uses the clustering's reference (``cluster_scores_dense``)."""
        cfg = self.cfg
        if cfg.scoring == "leverage":
            return leverage_scores(k, cfg.leverage_eps)
        cluster = cluster_scores_dense if dense else cluster_scores
        return cluster(k, cfg.n_clusters, cfg.kmeans_iters, median=cfg.scoring == "kmedian")

    @torch.no_grad()
    def kept_keys(self, k: Tensor, *, dense: bool = False) -> Tensor:
        """[B, Hkv, K] positions of the kept keys, ascending (all keys when nothing is dropped or on fallback)."""
        b, h, t, _ = k.shape
        keep = min(self.cfg.top_k, t)
        if keep >= t or keep == 0 or keep < self.cfg.min_keys:  # nothing to drop, or fallback
            return torch.arange(t, device=k.device).expand(b, h, t).contiguous()
        return self.key_scores(k, dense=dense).topk(keep, dim=-1).indices.sort(-1).values.contiguous()

    def lsh_rank(self, x: Tensor) -> Tensor:
        """Angular LSH bucket of each row, as its rank in Gray-code order: [B, H, T, D] -> [B, H, T]."""
        bits = (x.to(self.projections.dtype) @ self.projections) > 0
        code = (bits.long() << torch.arange(bits.shape[-1], device=x.device)).sum(-1)
        return self.gray_rank[code]

    @torch.no_grad()
    def plan(self, q: Tensor, k: Tensor, q_pos: Tensor, *, dense: bool = False) -> list[ExactPiece | HyperPiece]:
        tq = q.shape[2]
        p0 = int(q_pos[0])
        kept = self.kept_keys(k, dense=dense)
        qrank, krank = self.lsh_rank(q), self.lsh_rank(k)
        pieces: list[ExactPiece | HyperPiece] = []
        if p0 > 0:  # a cache's past: one non-causal block for every new query
            pieces.append(self._hyper_piece(q, 0, tq, 0, p0, kept, qrank, krank))

        def halve(qs: int, qe: int) -> None:
            if qe - qs <= self.cfg.min_seq_len:
                pieces.append(ExactPiece(qs, qe, p0 + qs, p0 + qe))
                return
            mid = (qs + qe) // 2
            halve(qs, mid)
            pieces.append(self._hyper_piece(q, mid, qe, p0 + qs, p0 + mid, kept, qrank, krank))
            halve(mid, qe)

        halve(0, tq)
        return pieces

    def _hyper_piece(
        self, q: Tensor, qs: int, qe: int, lo: int, hi: int, kept: Tensor, qrank: Tensor, krank: Tensor
    ) -> HyperPiece:
        """Queries qs..qe-1 against the kept keys at positions [lo, hi), all of them before every query."""
        b, hq = q.shape[:2]
        rep = hq // kept.shape[1]
        dev = q.device
        start = torch.searchsorted(kept, torch.full(kept.shape[:2] + (1,), lo, device=dev)).min()
        end = torch.searchsorted(kept, torch.full(kept.shape[:2] + (1,), hi, device=dev)).max()
        kidx = kept[..., start:end]
        kvalid = (kidx >= lo) & (kidx < hi)
        nv = kvalid.sum(-1)  # [B, Hkv]
        nk = kidx.shape[-1]
        nq = qe - qs
        nb = -(-nq // self.cfg.block_size)
        qorder = torch.argsort(qrank[:, :, qs:qe], dim=-1, stable=True)
        qblock = torch.empty_like(qorder).scatter_(
            -1, qorder, (torch.arange(nq, device=dev) // self.cfg.block_size).expand(b, hq, nq)
        )
        big = torch.iinfo(torch.long).max
        korder = torch.argsort(torch.where(kvalid, krank.gather(-1, kidx), big), dim=-1, stable=True)
        kslot = torch.empty_like(korder).scatter_(-1, korder, torch.arange(nk, device=dev).expand_as(korder))
        kblock = torch.where(kvalid, kslot * nb // nv.clamp(min=1)[..., None], -1)  # equal-count blocks
        kstart = -(-(torch.arange(nb + 1, device=dev) * nv[..., None]) // nb)  # first slot of each block
        # residual columns: uniform over the valid kept keys, per query head, from a seeded generator
        s = min(self.cfg.sample_size, nk)
        g = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + qs * 7919 + lo)
        prio = torch.rand(b, hq, nk, generator=g, dtype=torch.float64).to(dev)
        valid_h = kvalid.repeat_interleave(rep, dim=1)
        samples = torch.where(valid_h, prio, -1.0).topk(s, dim=-1).indices
        svalid = valid_h.gather(-1, samples)
        nv_h = nv.repeat_interleave(rep, dim=1).to(torch.float64)
        s_eff = nv_h.clamp(max=self.cfg.sample_size).clamp(min=1)
        return HyperPiece(
            qs,
            qe,
            kidx,
            kvalid,
            qblock,
            qorder,
            kblock,
            korder,
            kstart,
            nb,
            samples,
            svalid,
            torch.log(nv_h.clamp(min=1) / s_eff),
        )

    # ---- reference: the plan as one dense weighted softmax -------------------------------
    def log_weights(
        self,
        pieces: list[ExactPiece | HyperPiece],
        b: int,
        hq: int,
        tq: int,
        tk: int,
        q_pos: Tensor,
        device: torch.device,
    ) -> Tensor:
        """[B, H, Tq, Tk]: log w_ij (0 for weight 1, log(n/s) for a sampled column, -inf for none)."""
        lw = torch.full((b, hq, tq, tk), -math.inf, dtype=torch.float64, device=device)
        for piece in pieces:
            rows = slice(piece.qs, piece.qe)
            if isinstance(piece, ExactPiece):
                keys = torch.arange(piece.klo, piece.khi, device=device)
                lw[:, :, rows, piece.klo : piece.khi] = torch.where(
                    ref.causal_mask(q_pos[rows].to(device), keys), 0.0, -math.inf
                )
                continue
            rep = hq // piece.kidx.shape[1]
            kblock = piece.kblock.repeat_interleave(rep, dim=1)
            in_block = (piece.qblock[..., :, None] == kblock[..., None, :]) & (kblock[..., None, :] >= 0)
            sampled = torch.zeros_like(kblock, dtype=torch.bool).scatter_(-1, piece.samples, piece.svalid)
            part = torch.where(
                in_block, 0.0, torch.where(sampled[..., None, :], piece.log_w[..., None, None], -math.inf)
            )
            full = torch.full((b, hq, piece.qe - piece.qs, tk), -math.inf, dtype=torch.float64, device=device)
            idx = piece.kidx.repeat_interleave(rep, dim=1)[..., None, :].expand_as(part)
            full.scatter_reduce_(-1, idx, part, reduce="amax")  # padded slots hold -inf: no effect
            lw[:, :, rows] = torch.maximum(lw[:, :, rows], full)
        return lw

    def reference(
        self, q: Tensor, k: Tensor, v: Tensor, *, hidden: Tensor, q_pos: Tensor, k_pos: Tensor, cache: KVCache | None
    ) -> AttnOut:
        pieces = self.plan(q, k, q_pos, dense=True)
        b, hq, tq, _ = q.shape
        lw = self.log_weights(pieces, b, hq, tq, k.shape[2], q_pos, q.device)
        s = ref.scores(q, k, self.scale)
        p = ref.masked_softmax(s + lw.to(s.dtype), torch.isfinite(lw))
        stats = (
            {"key_ratio": (torch.isfinite(lw).sum(-1).double() / (q_pos + 1).to(q.device)).mean()}
            if self.collect_stats
            else {}
        )
        return AttnOut(ref.weighted_values(p, v, q.dtype), stats=stats)

    # ---- fast: block by block, logsumexp merges -----------------------------------------
    def has_fast_path(self, q: Tensor, cache: KVCache | None) -> bool:
        return True

    def fast(
        self, q: Tensor, k: Tensor, v: Tensor, *, hidden: Tensor, q_pos: Tensor, k_pos: Tensor, cache: KVCache | None
    ) -> AttnOut:
        pieces = self.plan(q, k, q_pos)
        b, hq, tq, d = q.shape
        dt = torch.promote_types(q.dtype, torch.float32)
        out = q.new_zeros(b, hq, tq, d, dtype=dt)
        lse = q.new_full((b, hq, tq), -math.inf, dtype=dt)
        if not (torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))):
            # no autograd: merge each piece into a running (out, lse) in place as it comes, holding one piece's
            # output at a time (not every piece's, nor a new [B, H, T, D] per piece)
            for piece in pieces:
                o, l_ = self._piece(q, k, v, q_pos, piece)
                cur = lse[:, :, piece.qs : piece.qe]
                new = torch.logaddexp(cur, l_)
                dst = out[:, :, piece.qs : piece.qe]
                dst.mul_(torch.exp(cur - new)[..., None]).add_(o * torch.exp(l_ - new)[..., None])
                cur.copy_(new)
            return AttnOut(out.to(q.dtype))
        outs, lses = [], []  # per piece, merged per query row below (no in-place writes: autograd)
        for piece in pieces:
            o, l_ = self._piece(q, k, v, q_pos, piece)
            outs.append((piece.qs, piece.qe, o))
            lses.append(l_)
        # merge: lse_i = logsumexp over pieces; out_i = sum_p o_p exp(lse_p - lse_i)
        total = lse
        for (qs, qe, _), l_ in zip(outs, lses):
            total = torch.cat([total[:, :, :qs], torch.logaddexp(total[:, :, qs:qe], l_), total[:, :, qe:]], dim=2)
        for (qs, qe, o), l_ in zip(outs, lses):
            w = torch.exp(l_ - total[:, :, qs:qe])[..., None]
            out = torch.cat([out[:, :, :qs], out[:, :, qs:qe] + o * w, out[:, :, qe:]], dim=2)
        return AttnOut(out.to(q.dtype))

    def _piece(
        self, q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, piece: ExactPiece | HyperPiece
    ) -> tuple[Tensor, Tensor]:
        """Normalised output and logsumexp of one piece's rows."""
        if isinstance(piece, HyperPiece):
            return self._hyper(q, k, v, piece)
        return self._exact(
            q[:, :, piece.qs : piece.qe],
            k[:, :, piece.klo : piece.khi],
            v[:, :, piece.klo : piece.khi],
            q_pos[piece.qs : piece.qe],
            piece.klo,
        )

    def _softmax(self, s: Tensor, mask: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Normalised output and logsumexp of masked scores. An empty row gives zeros and a very
        negative (finite) lse, so merges and their gradients never meet inf - inf."""
        if s.shape[-1] == 0:
            return s.new_zeros(*s.shape[:-1], v.shape[-1]), s.new_full(s.shape[:-1], _EMPTY)
        s = s.masked_fill(~mask, -math.inf)
        mx = s.detach().amax(-1, keepdim=True)
        mx = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))
        e = torch.exp(s - mx)
        den = e.sum(-1)
        tiny = torch.finfo(den.dtype).tiny
        lse = torch.where(den > 0, torch.log(den.clamp(min=tiny)) + mx[..., 0], torch.full_like(den, _EMPTY))
        return (e @ v) / den.clamp(min=tiny)[..., None], lse

    def _exact(self, q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, klo: int) -> tuple[Tensor, Tensor]:
        dt = torch.promote_types(q.dtype, torch.float32)
        b, hq, tq, _ = q.shape
        ve = ref.expand_kv(v, hq).to(dt)
        kpos = torch.arange(klo, klo + k.shape[2], device=q.device)

        def rows(i: int, j: int) -> tuple[Tensor, Tensor]:
            s = ref.scores(q[:, :, i:j], k, self.scale)
            return self._softmax(s, ref.causal_mask(q_pos[i:j].to(q.device), kpos), ve)

        return _in_row_chunks(rows, tq, b * hq * k.shape[2])

    def _hyper(self, q: Tensor, k: Tensor, v: Tensor, piece: HyperPiece) -> tuple[Tensor, Tensor]:
        b, hq, _, d = q.shape
        hkv = k.shape[1]
        rep = hq // hkv
        dt = torch.promote_types(q.dtype, torch.float32)
        nq, nb, bq = piece.qe - piece.qs, piece.nb, self.cfg.block_size
        qp = q[:, :, piece.qs : piece.qe].to(dt)
        # block-diagonal part: sorted queries in blocks of bq against their block of sorted keys
        qsorted = qp.gather(2, piece.qorder[..., None].expand(-1, -1, -1, d))
        qsorted = torch.nn.functional.pad(qsorted, (0, 0, 0, nb * bq - nq)).view(b, hq, nb, bq, d)
        qvalid = (torch.arange(nb * bq, device=q.device) < nq).view(nb, bq)
        width = int((piece.kstart[..., 1:] - piece.kstart[..., :-1]).max()) if nb else 0
        slot = piece.kstart[..., :-1, None] + torch.arange(width, device=q.device)  # [B, Hkv, nb, w]
        bvalid = slot < piece.kstart[..., 1:, None]
        nk = piece.kidx.shape[-1]
        pos = piece.kidx.gather(
            -1, piece.korder.gather(-1, slot.clamp(max=max(nk - 1, 0)).reshape(b, hkv, -1))
        ).reshape(slot.shape)
        kb = ref.take_rows(k, pos).repeat_interleave(rep, dim=1).to(dt)  # [B, H, nb, w, D]
        vb = ref.take_rows(v, pos).repeat_interleave(rep, dim=1).to(dt)
        bvalid_h = bvalid.repeat_interleave(rep, dim=1)

        def blocks(i: int, j: int) -> tuple[Tensor, Tensor]:  # LSH blocks i..j-1
            s = torch.einsum("bhnqd,bhnwd->bhnqw", qsorted[:, :, i:j], kb[:, :, i:j]) * self.scale
            mask = qvalid[None, None, i:j, :, None] & bvalid_h[:, :, i:j, None, :]
            return self._softmax(s, mask, vb[:, :, i:j])

        ob, lb = _in_row_chunks(blocks, nb, b * hq * bq * width, dim=2)
        ob, lb = ob.reshape(b, hq, nb * bq, d)[:, :, :nq], lb.reshape(b, hq, nb * bq)[:, :, :nq]
        inv = torch.argsort(piece.qorder, dim=-1)  # back to position order
        ob, lb = ob.gather(2, inv[..., None].expand(-1, -1, -1, d)), lb.gather(2, inv)
        if piece.samples.shape[-1] == 0:
            return ob, lb
        # residual part: sampled columns outside the query's block, weighted n/s
        kidx_h = piece.kidx.repeat_interleave(rep, dim=1)
        cols = kidx_h.gather(-1, piece.samples)
        ks = ref.expand_kv(k, hq).gather(2, cols[..., None].expand(-1, -1, -1, d)).to(dt)
        vs = ref.expand_kv(v, hq).gather(2, cols[..., None].expand(-1, -1, -1, d)).to(dt)
        sblock = piece.kblock.repeat_interleave(rep, dim=1).gather(-1, piece.samples)
        log_w = piece.log_w.to(dt)[..., None, None]

        def rows(i: int, j: int) -> tuple[Tensor, Tensor]:
            rs = torch.matmul(qp[:, :, i:j], ks.transpose(-1, -2)) * self.scale + log_w
            rmask = piece.svalid[:, :, None, :] & (sblock[:, :, None, :] != piece.qblock[:, :, i:j, None])
            return self._softmax(rs, rmask, vs)

        orr, lr = _in_row_chunks(rows, nq, b * hq * ks.shape[2])
        lse = torch.logaddexp(lb, lr)
        o = ob * torch.exp(lb - lse)[..., None] + orr * torch.exp(lr - lse)[..., None]
        return o, lse
