"""Dynamic Group Attention (papers/dynamic-group-attention-dga.txt, section 5, appendices D, E).

Keys are split into *focal* tokens (the top ``gamma`` share by an importance score, eq. 16-17,
kept raw) and non-focal tokens, which are grouped in position order in groups of ``m`` and
replaced by one aggregated key/value per group, ``sum_j P_j k_j`` with
``P = softmax(q_last k_G^T / sqrt(d))`` from the query of the group's last token (eq. 14).
A query attends focal keys, the aggregates it may see, and raw *complementary* keys (the
tokens near it that no visible aggregate covers, eq. 15), under one mask (appendix D).

Two selection modes (docs/dga.md has the full design):

- ``selection = "sequence"``: the paper's form. Focal tokens of the whole sequence are chosen
  from a sample of queries of the whole sequence (recent plus random); an aggregate is visible
  once its whole group is at or before the query; complementary keys are the members of the
  query's own unfinished group up to the query. Right for prefilling a given prompt, but the
  focal choice reads later tokens, so it is *not* causal (the suite shows the leak).
- ``selection = "causal"`` (training default): decisions are made chunk by chunk. Key chunk
  ``c`` (positions [cC, (c+1)C)) is compressed from queries of chunks ``c`` and ``c+1`` only
  (importance over the keys of those two chunks), and its focal keys and aggregates are used
  only by queries of chunk ``c+2`` and later; the query's own chunk and the previous one are
  at full resolution (they play the role of the complementary tokens). No query's key set
  depends on a later token, and decoding with the chunk-folding KV cache reproduces the
  uncached forward exactly.

Paths. ``reference``: dense masked softmax over ``[all raw keys; all aggregates]`` (T x (T+G)), ``naive.py``.
``fast`` on the CPU for a whole sequence (training, uncached prefill): the parts form of ``cpu.py``, kernel
calls over ranges of one compressed key list per layer and of the raw keys, merged by logsumexp: O(T D) memory.
Cached calls (and ``impl = "gathered"``): one softmax over the gathered ``[focal; aggregated;
complementary/window]`` keys, so the work is about L (r + (L-r)/m + window) instead of L^2; on CUDA (no cache) a
FlexAttention ``mask_mod`` over ``[compressed; raw]`` keys whose block mask skips the invisible raw blocks
(``flex.py``; training: a raw-window call and an entries call merged by logsumexp, their block masks built once per
step and shape by ``prepare_step`` and shared by every layer).
Both paths share the compression (importance, selection, aggregation); the selection is a
discrete choice (no gradient), aggregation weights carry gradients to q and k.

Decode. Causal form: a chunk is folded into the grouped cache when the first query that may
see it arrives; the cache holds the compressed chunks plus the raw current and previous chunk
(plus the queries of the chunks not yet folded). On the GPU a decoded token takes a static-shape step over
the whole buffers with device-side counts (``cached.decode_step`` / ``fold_step``: CUDA-graph capturable).
Sequence form: the paper's section 5.1 rule:
prefill compresses the prompt, decode keeps new tokens raw until m' = ceil(decode_fold * m) of
them, then keeps the top m'-m as focal and folds the other m into one group, weights from the
last query. Either way nothing else is kept: the base cache's raw ``max_len`` buffers are freed.
``cache_size`` reports the slots against full attention's and the bytes allocated
(``kv_cache_nbytes``, which measures any layer cache).
"""

from __future__ import annotations

from model.attention.common.base import register_attention
from model.attention.dga.cached import GroupedKVCache
from model.attention.dga.config import DGAConfig, focal_count
from model.attention.dga.flex import causal_flex_blocks
from model.attention.dga.module import CPContext, DynamicGroupAttention

register_attention("dga", DGAConfig)(DynamicGroupAttention)

__all__ = ["CPContext", "DGAConfig", "DynamicGroupAttention", "GroupedKVCache", "causal_flex_blocks", "focal_count"]
