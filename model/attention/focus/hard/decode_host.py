"""Focus hard mode: the assignment of one CPU decode step on host floats.

A CPU decode step is a few kernel calls around a fixed cost of small tensor operations. For one new token the
group scores -> prefix Sinkhorn -> top-k memberships are ~40 operations on [B, 1, K], each costing more to
dispatch than its numbers take to compute; on host floats (float64) they are one pass (``sinkhorn_token_host``).
``HostDecode`` holds, per KV cache, the Sinkhorn state as host floats and the assignments and membership words
decoded this way that are not in the cache's tensors yet; every tensor path first calls ``flush``, which writes them
(one operation each) and hands the state back to the cache's tensor.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import torch
from torch import Tensor

from model.attention.common.base import KVCache
from model.attention.focus.sinkhorn import sinkhorn_token_host

KEY = "focus_host"  # cache.extra: the HostDecode of a cache in host mode


def top_k_word(g: Sequence[float], top_k: int) -> int:
    """The membership word of one assignment: bits of its top_k groups, ties to the lower group (as
    ``membership_bits``)."""
    if top_k == 1:  # max returns the first of tied maxima
        return 1 << max(range(len(g)), key=g.__getitem__)
    return sum(1 << c for c in sorted(range(len(g)), key=g.__getitem__, reverse=True)[:top_k])  # a stable sort


class HostDecode:
    """The prefix Sinkhorn state of a cache's sequences as host floats, and the assignments of the tokens decoded on
    the host since position ``start``, token-major, rounded to the cache's dtype (float32 or float64)."""

    def __init__(self, state: Tensor, start: int):
        self.dtype = state.dtype
        self.state: list[list[list[float]]] = state.tolist()  # [B][iters][K]
        self.start = start
        self.pending: array[float] = array("d" if state.dtype == torch.float64 else "f")
        self.words: array[int] = array("q")  # the same tokens' membership words, token-major
        self.words_written = 0  # of them, already in the cache's ``focus_bits``

    @classmethod
    def accepts(cls, state: Tensor, dtype: torch.dtype) -> bool:
        """Whether a state tensor can go to the host: the dtype the tensor path would compute in, every mass finite."""
        return state.dtype == dtype and bool(torch.isfinite(state).all())

    def step(self, scores: list[list[float]], top_k: int) -> list[int] | None:
        """One new token per sequence (scores [B][K]): update the state, keep its assignment, return its membership
        words; None, with nothing changed, when a score is not finite."""
        rows: array[float] = array(self.pending.typecode)
        state, words = [], []
        for row, earlier in zip(scores, self.state):
            token = sinkhorn_token_host(row, earlier)
            if token is None:
                return None
            g = array(self.pending.typecode, token[0])  # as the cache stores it: the top-k sees the same ties
            rows.extend(g)
            state.append(token[1])
            words.append(top_k_word(g, top_k))
        self.state = state
        self.pending.extend(rows)
        self.words.extend(words)
        return words

    def bits(self, cache: KVCache) -> Tensor:
        """The cache's membership words of every token so far, [B, Tk], the pending ones written first (decoding
        reads them only now and then: a group's member rows are copied, or its keys are most of the cache)."""
        buf, b_size = cache.extra["focus_bits"], len(self.state)
        done, count = self.words_written, len(self.words) // b_size
        if count > done:
            new = torch.frombuffer(self.words, dtype=torch.long).view(count, b_size)[done:]
            buf[:, self.start + done : self.start + count] = new.T
            self.words_written = count
        return buf[:, : self.start + count]

    def flush(self, cache: KVCache) -> None:
        """Write the state and the pending assignments and words into the cache's tensors (``focus_sinkhorn``,
        ``focus_g``, ``focus_bits``) and leave host mode."""
        cache.extra["focus_sinkhorn"] = torch.tensor(self.state, dtype=self.dtype)
        if self.pending:
            b, n_groups = len(self.state), len(self.state[0][0])
            rows = torch.frombuffer(self.pending, dtype=self.dtype).view(-1, b, n_groups).transpose(0, 1)
            cache.extra["focus_g"][:, self.start : self.start + rows.shape[1]] = rows
            self.bits(cache)
        del cache.extra[KEY]


def flush(cache: KVCache | None) -> None:
    """Leave host mode, if the cache is in it (every tensor path calls this first)."""
    host = cache.extra.get(KEY) if cache is not None else None
    if host is not None:
        host.flush(cache)
