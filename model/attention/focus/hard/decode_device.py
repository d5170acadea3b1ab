"""Focus hard mode, decode on the device (CUDA, or CPU inside ``gpu_paths_forced``): one new token per sequence as
one step of static shapes, with no host synchronisation, that a CUDA graph can capture.

The CPU decode paths (``decode.py``, ``decode_host.py``) keep per-group member lists as host arrays and read the
token's groups and window from them: right for the CPU, where a step is a few kernel calls around a fixed cost of
small operations. On a GPU those lists cost a device -> host read of every token's membership (``.tolist()``,
``int(q_pos[-1])``) and pageable host -> device copies of member indices at every token. Here nothing leaves the
device:

- the assignment of the new token is the Sinkhorn token update (``sinkhorn_prefix`` of one token onto the cached
  state, or a softmax) of its folded group scores, and its membership word is ``membership_bits``;
- the Sinkhorn state, the token's assignment and its word are written into the cache's preallocated buffers
  (``focus_sinkhorn`` in place, ``focus_g`` and ``focus_bits`` by ``scatter_`` at the token's position, a device
  tensor);
- the attention is ONE masked SDPA call over the whole preallocated KV cache [B, Hkv, max_len, D]: key j is allowed
  iff j <= p (p the token's position) and (p - j < window or the words intersect, ``bits_k & bits_q != 0``), the
  dense hard mask's row (``naive.hard_mask``), so the step is exact. Unused cache rows (j > p) are masked out; the
  cache is zero-initialised (``KVCache``), so their zero weights never meet a NaN. GQA: the Hq / Hkv query heads of
  a key head are the rows of one [B, Hkv, Hq / Hkv, D] query block (no expanded copy of K and V).

Why a CUDA graph can capture it: every shape is fixed by the cache (B, heads, max_len, D, K) and none by data (the
position is a device tensor, not a Python int; no ``nonzero``, ``masked_select``, boolean indexing or ``unique``);
no ``.item()``, ``.tolist()``, ``bool(tensor)`` or host -> device copy; every write goes into a buffer that exists
before the step (in place), so consecutive tokens replay the same kernels on the same addresses with new values.
tests/attention/focus/test_decode_device.py traces it with ``fullgraph=True`` and finds no graph break, no
synchronising op, and one graph for consecutive positions.

The price of static shapes: the step reads the whole max_len cache (masked rows included), as full attention reads
the keys so far; the group sparsity saves no reads here, only the mask changes. Batch > 1 with per-sequence
positions (q_pos [B]) is supported by the step; ``KVCache`` itself holds one length for the batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from model.attention.focus.naive import membership_bits
from model.attention.focus.sinkhorn import sinkhorn_prefix


def device_decode_step(
    q: Tensor,
    k_all: Tensor,
    v_all: Tensor,
    hidden: Tensor,
    fold: Tensor,
    q_pos: Tensor,
    state: Tensor | None,
    g_all: Tensor,
    bits_all: Tensor,
    *,
    iters: int,
    top_k: int,
    window: int,
    scale: float,
) -> Tensor:
    """One hard-mode decode step on the device. q [B, Hq, 1, D]; k_all, v_all [B, Hkv, L, D]: the whole KV cache
    buffers, the new token's key and value already at its position; hidden [B, 1, d_model]; fold [K, d_model] the
    folded (C W_g) / tau (its dtype is the assignment's: float32, or float64 for float64 inputs); q_pos [1] or [B]:
    the token's position (device int64). ``state`` [B, iters, K]: the prefix Sinkhorn state, updated in place (None:
    softmax assignments); g_all [B, L, K] and bits_all [B, L]: every cached token's assignment and membership word,
    the new token's written at q_pos. Returns the output [B, Hq, 1, D]."""
    b, hq = q.shape[0], q.shape[1]
    hkv, length = k_all.shape[1], k_all.shape[2]
    s = (hidden.to(fold.dtype).unsqueeze(2) * fold).sum(-1)  # [B, 1, K], as FocusAttention.group_scores decodes
    if state is None:
        g = torch.softmax(s, dim=-1)
    else:
        g, new_state = sinkhorn_prefix(s, iters, state)
        state.copy_(new_state)
    bits_q = membership_bits(g, top_k)  # [B, 1]
    p = q_pos.reshape(-1, 1).expand(b, 1)  # [B, 1]
    bits_all.scatter_(1, p, bits_q)
    g_all.scatter_(1, p.unsqueeze(-1).expand(b, 1, g.shape[-1]), g.to(g_all.dtype))
    pos = torch.arange(length, device=q.device)  # [L]
    allowed = (pos <= p) & ((p - pos < window) | ((bits_all & bits_q) != 0))  # [B, L]
    out = F.scaled_dot_product_attention(
        q.reshape(b, hkv, hq // hkv, q.shape[3]), k_all, v_all, attn_mask=allowed[:, None, None], scale=scale
    )
    return out.reshape(q.shape)
