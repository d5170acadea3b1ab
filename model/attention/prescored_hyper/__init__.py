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

Files: ``config.py`` (the options), ``scoring.py`` (the fast key scorers), ``plan.py`` (the pieces of the weighted
softmax), ``naive.py`` (the dense reference: the plan's T x T log-weights, the weighted softmax, the clustering's
dense form), ``hyper.py`` (the fast path: piece by piece, block by block), ``module.py`` (the module).
"""

from __future__ import annotations

from model.attention.common.base import register_attention
from model.attention.prescored_hyper import hyper, naive, plan, scoring
from model.attention.prescored_hyper.config import SCORINGS, PrescoredHyperConfig
from model.attention.prescored_hyper.module import PrescoredHyperAttention
from model.attention.prescored_hyper.naive import cluster_scores_dense
from model.attention.prescored_hyper.plan import ExactPiece, HyperPiece
from model.attention.prescored_hyper.scoring import cluster_scores, leverage_scores

register_attention("prescored_hyper", PrescoredHyperConfig)(PrescoredHyperAttention)

__all__ = [
    "SCORINGS",
    "ExactPiece",
    "HyperPiece",
    "PrescoredHyperAttention",
    "PrescoredHyperConfig",
    "cluster_scores",
    "cluster_scores_dense",
    "hyper",
    "leverage_scores",
    "naive",
    "plan",
    "scoring",
]
