"""Focus hard mode, decode on the device (CUDA, or CPU inside ``gpu_paths_forced``): one new token per sequence as
one step of static shapes, with no host synchronisation, that a CUDA graph can capture, reading only the token's
groups' pages and the window.

The CPU decode paths (``decode.py``, ``decode_host.py``) keep per-group member lists as host arrays and read the
token's groups and window from them: right for the CPU, where a step is a few kernel calls around a fixed cost of
small operations. On a GPU those lists cost a device -> host read of every token's membership (``.tolist()``,
``int(q_pos[-1])``) and pageable host -> device copies of member indices at every token. Here nothing leaves the
device:

- the assignment of the new token is the Sinkhorn token update (``sinkhorn_prefix`` of one token onto the cached
  state, or a softmax) of its folded group scores; its top_k groups (``token_groups``) give its membership word, the
  sum of their bits (as ``membership_bits``);
- the Sinkhorn state, the token's assignment and its word are written into the cache's preallocated buffers
  (``focus_sinkhorn`` in place, ``focus_g`` and ``focus_bits`` by ``scatter_`` at the token's position, a device
  tensor), and the token into its groups' page tables (``decode_pages.append``: device-side counts);
- the attention reads the far members of the token's groups (through the page tables) and the window, one partial
  softmax per part merged by log-sum-exp (``decode_pages``): on CUDA (and under Triton's interpreter) the split-KV
  kernel of ``decode_triton.py``, which loops only over the pages below each group's count; elsewhere the same parts
  in torch over the groups' whole (masked) tables. Exact: key j is read iff j <= p and (p - j < window or the words
  intersect), the dense hard mask's row (``naive.hard_mask``), each key once. GQA: the Hq / Hkv query heads of a key
  head are the rows of one query block (no expanded copy of K and V).

Why a CUDA graph can capture it: every shape is fixed by the cache (B, heads, max_len, D, K) and none by data (the
position is a device tensor, not a Python int; no ``nonzero``, ``masked_select``, boolean indexing or ``unique``;
the kernel's loop bounds are device values); no ``.item()``, ``.tolist()``, ``bool(tensor)`` or host -> device copy;
every write goes into a buffer that exists before the step (in place), so consecutive tokens replay the same
kernels on the same addresses with new values. tests/attention/focus/test_decode_device.py traces it with
``fullgraph=True`` and finds no graph break, no synchronising op, and one graph for consecutive positions.

Batch > 1 with per-sequence positions (q_pos [B]) is supported by the step; ``KVCache`` itself holds one length for
the batch.
"""

from __future__ import annotations

import torch
from torch import Tensor

from model.attention.focus.hard import decode_pages
from model.attention.focus.hard.decode_pages import GroupPages
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
    pages: GroupPages,
    *,
    iters: int,
    top_k: int,
    window: int,
    scale: float,
    kernel: bool = False,
    splits: int = 1,
) -> Tensor:
    """One hard-mode decode step on the device. q [B, Hq, 1, D]; k_all, v_all [B, Hkv, L, D]: the whole KV cache
    buffers, the new token's key and value already at its position; hidden [B, 1, d_model]; fold [K, d_model] the
    folded (C W_g) / tau (its dtype is the assignment's: float32, or float64 for float64 inputs); q_pos [1] or [B]:
    the token's position (device int64). ``state`` [B, iters, K]: the prefix Sinkhorn state, updated in place (None:
    softmax assignments); g_all [B, L, K] and bits_all [B, L]: every cached token's assignment and membership word,
    the new token's written at q_pos; ``pages``: the group page tables of the tokens before q_pos, the token appended
    in place. ``kernel``: the attention by the split-KV Triton kernel (``splits`` per group), else in torch. Returns
    the output [B, Hq, 1, D]."""
    b = q.shape[0]
    s = (hidden.to(fold.dtype).unsqueeze(2) * fold).sum(-1)  # [B, 1, K], as FocusAttention.group_scores decodes
    if state is None:
        g = torch.softmax(s, dim=-1)
    else:
        g, new_state = sinkhorn_prefix(s, iters, state)
        state.copy_(new_state)
    groups = decode_pages.token_groups(g, top_k)  # [B, top_k]
    bits_q = torch.bitwise_left_shift(torch.ones_like(groups), groups).sum(-1, keepdim=True)  # [B, 1]
    p = q_pos.reshape(-1, 1).expand(b, 1)  # [B, 1]
    bits_all.scatter_(1, p, bits_q)
    g_all.scatter_(1, p.unsqueeze(-1).expand(b, 1, g.shape[-1]), g.to(g_all.dtype))
    decode_pages.append(pages, groups, p, bits_all, window)
    if kernel:
        from model.attention.focus.hard.decode_triton import triton_partials  # triton: imported where it runs

        outs, lses = triton_partials(
            q, k_all, v_all, bits_all, pages, groups, bits_q, p, window=window, scale=scale, splits=splits
        )
    else:
        outs, lses = decode_pages.torch_partials(
            q, k_all, v_all, bits_all, pages, groups, bits_q, p, window=window, scale=scale
        )
    return decode_pages.merge(outs, lses).to(q.dtype)
