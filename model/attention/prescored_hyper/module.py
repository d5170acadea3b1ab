"""``PrescoredHyperAttention``, the module: the key selection and LSH buffers that fix the plan, and its two paths.

``reference`` materialises the plan as one T x T weighted softmax (``naive.py``); ``fast`` computes it block by
block (``hyper.py``). The package docstring has the paper's algorithm."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from model.attention.common.base import Attention, AttnOut, GpuPath, KVCache, LayerSpec, SuiteCase
from model.attention.prescored_hyper import hyper, naive
from model.attention.prescored_hyper import plan as plans
from model.attention.prescored_hyper.config import PrescoredHyperConfig
from model.attention.prescored_hyper.plan import ExactPiece, HyperPiece
from model.attention.prescored_hyper.scoring import cluster_scores, leverage_scores


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
        """Scores of the keys; ``dense`` uses the clustering's reference (``naive.cluster_scores_dense``)."""
        cfg = self.cfg
        if cfg.scoring == "leverage":
            return leverage_scores(k, cfg.leverage_eps)
        cluster = naive.cluster_scores_dense if dense else cluster_scores
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
        kept = self.kept_keys(k, dense=dense)
        return plans.make(q, q_pos, kept, self.lsh_rank(q), self.lsh_rank(k), self.cfg)

    # ---- reference: the plan as one dense weighted softmax -------------------------------
    def reference(
        self, q: Tensor, k: Tensor, v: Tensor, *, hidden: Tensor, q_pos: Tensor, k_pos: Tensor, cache: KVCache | None
    ) -> AttnOut:
        pieces = self.plan(q, k, q_pos, dense=True)
        b, hq, tq, _ = q.shape
        lw = naive.log_weights(pieces, b, hq, tq, k.shape[2], q_pos, q.device)
        stats = (
            {"key_ratio": (torch.isfinite(lw).sum(-1).double() / (q_pos + 1).to(q.device)).mean()}
            if self.collect_stats
            else {}
        )
        return AttnOut(naive.attention(q, k, v, lw, self.scale), stats=stats)

    # ---- fast: block by block, logsumexp merges -----------------------------------------
    def has_fast_path(self, q: Tensor, cache: KVCache | None) -> bool:
        return True

    def fast(
        self, q: Tensor, k: Tensor, v: Tensor, *, hidden: Tensor, q_pos: Tensor, k_pos: Tensor, cache: KVCache | None
    ) -> AttnOut:
        pieces = self.plan(q, k, q_pos)
        return AttnOut(hyper.attention(q, k, v, q_pos, pieces, self.scale, self.cfg.block_size))
