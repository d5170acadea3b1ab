"""Options of pre-scored HyperAttention: the scorings and ``PrescoredHyperConfig``."""

from __future__ import annotations

from dataclasses import dataclass

from core.errors import check_choice, check_min, check_range
from model.attention.common.base import VariantConfig

SCORINGS = ("kmeans", "kmedian", "leverage")


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
