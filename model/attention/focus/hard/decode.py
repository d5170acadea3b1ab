"""Focus hard mode, decode: the new token reads the window and the far members of its own groups only, from
per-group member lists kept with the KV cache (see ``hard/cpu.py``'s docstring).

A decode step is a few kernel calls around a fixed cost of small operations (at batch 1 the small operations took
as long as the kernels), so the lists are Python-side int64 arrays (append and bisection without tensor
operations), and the CPU path reads a group as one contiguous buffer: a ring copy of the window, then the group's
members, copied in only when a member leaves the window that is not there yet (then every member so far: about one
copy per group per ``window`` tokens).
"""

from __future__ import annotations

import bisect
from array import array
from collections.abc import Callable

import torch
from torch import Tensor

from model.attention.common.sdpa import sdpa_varying
from model.attention.focus.hard.rows import additive, take_rows

_FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
# CPU decoding reads the whole cache under a mask once the token's groups and window hold this share of the keys
# (top_k = 2 of 4 groups, 16K context: read in two calls 1.45x full attention's step, one masked call 1.2-1.3x)
DENSE_SHARE = 0.75


def _as_index(positions: array, device: torch.device) -> Tensor:
    """An int64 array (a copy of a slice) as a tensor on ``device``."""
    return (
        torch.frombuffer(positions, dtype=torch.long).to(device)
        if len(positions)
        else torch.empty(0, dtype=torch.long, device=device)
    )


# ---- decode: per-group member lists in the KV cache ---------------------------------------------------------------
class GroupLists:
    """Per (sequence, group): the positions of the group's members so far, ascending (the hard-mode KV cache), as
    int64 arrays; ``members`` gives one as a tensor on the lists' device (written into ``index`` as needed)."""

    def __init__(self, batch: int, n_groups: int, device: torch.device | str, capacity: int = 256):
        self.n_groups = n_groups
        self.device = torch.device(device)
        self.pos = [[array("q") for _ in range(n_groups)] for _ in range(batch)]
        self.index = torch.zeros(batch, n_groups, capacity, dtype=torch.long, device=device)
        self._indexed = [[0] * n_groups for _ in range(batch)]  # members already written into ``index``
        self.length = 0  # tokens appended
        self.rows: GroupRows | None = None  # CPU decoding: the groups' keys and values, contiguous

    @property
    def count(self) -> Tensor:
        """Members per (sequence, group), [B, K]."""
        return torch.tensor([[len(p) for p in row] for row in self.pos], dtype=torch.long, device=self.device)

    def append(self, bits: Tensor) -> None:
        """bits [B, t]: memberships of the tokens at positions [length, length + t)."""
        if bits.shape[1] == 1:  # decoding: a few appends, no tensor operation
            self.append_words([word for (word,) in bits.tolist()])
            return
        member = (bits[:, :, None] >> torch.arange(self.n_groups, device=bits.device)) & 1  # [B, t, K]
        for b in range(bits.shape[0]):
            group, token = torch.nonzero(member[b].T, as_tuple=True)  # by group, then position
            tokens = (token + self.length).tolist()
            start = 0
            for c, n in enumerate(torch.bincount(group, minlength=self.n_groups).tolist()):
                self.pos[b][c].extend(tokens[start : start + n])
                start += n
        self.length += bits.shape[1]

    def append_words(self, words: list[int]) -> None:
        """One token per sequence: its membership word, per sequence (decoding)."""
        for b, word in enumerate(words):
            for c in range(self.n_groups):
                if (word >> c) & 1:
                    self.pos[b][c].append(self.length)
        self.length += 1

    def members(self, b: int, c: int, count: int) -> Tensor:
        """The first ``count`` members of group c of sequence b, [count] on the lists' device."""
        have = self._indexed[b][c]
        if have < count:
            if count > self.index.shape[2]:
                grown = self.index.new_zeros(*self.index.shape[:2], max(count, 2 * self.index.shape[2]))
                grown[:, :, : self.index.shape[2]] = self.index
                self.index = grown
            self.index[b, c, have:count] = _as_index(self.pos[b][c][have:count], self.device)
            self._indexed[b][c] = count
        return self.index[b, c, :count]


class GroupRows:
    """CPU decoding once the window is full, per (sequence, group): one buffer [1, Hkv, window + capacity, D] of keys
    (and one of values) holding a copy of the window, then the group's first ``stored`` members in position order
    (and their membership words, for top_k > 1). A token of the group reads ``[window copy | members before the
    window]`` as one contiguous slice: one kernel call, as attention over a set of keys does not depend on their
    order. The window copy is a ring (position p in slot p % window) brought up to date when the group is read, so
    it copies only the tokens decoded since (about n_groups / top_k per read). Costs top_k times the raw keys and
    values (plus growth room and n_groups windows)."""

    def __init__(self, batch: int, n_groups: int, window: int):
        self.window = window
        self.k: list[list[Tensor | None]] = [[None] * n_groups for _ in range(batch)]
        self.v: list[list[Tensor | None]] = [[None] * n_groups for _ in range(batch)]
        self.bits: list[list[Tensor | None]] = [[None] * n_groups for _ in range(batch)]
        self.stored = [[0] * n_groups for _ in range(batch)]
        self.synced = [[0] * n_groups for _ in range(batch)]  # the ring holds the window of the first synced keys

    def fill(self, lists: GroupLists, b: int, c: int, k: Tensor, v: Tensor, bits_k: Tensor) -> None:
        """Copy in every member of group c of sequence b not stored yet (k, v: [B, Hkv, Tk, D] and bits_k [B, Tk],
        the cache so far, holding every listed member)."""
        pos = lists.pos[b][c]
        have, count = self.stored[b][c], len(pos)
        kb, vb, bb = self._room(b, c, k, v, bits_k, count)
        if count == have:
            return
        new, w = _as_index(pos[have:count], k.device), self.window
        kb[0, :, w + have : w + count] = take_rows(k, b, new)
        vb[0, :, w + have : w + count] = take_rows(v, b, new)
        bb[have:count] = bits_k[b].index_select(0, new)
        self.stored[b][c] = count

    def sync(self, b: int, c: int, k: Tensor, v: Tensor) -> None:
        """Bring the window copy of (b, c) up to the cache's Tk keys (Tk >= window)."""
        w, tk = self.window, k.shape[2]
        start = max(self.synced[b][c], tk - w)
        kb, vb = self.k[b][c], self.v[b][c]
        assert kb is not None and vb is not None  # allocated by fill
        if k.shape[0] > 1:
            k, v = k[b : b + 1], v[b : b + 1]
        while start < tk:  # at most two runs: up to the ring's end, then from its start (narrow: one view each)
            slot = start % w
            n = min(tk - start, w - slot)
            kb.narrow(2, slot, n).copy_(k.narrow(2, start, n))
            vb.narrow(2, slot, n).copy_(v.narrow(2, start, n))
            start += n
        self.synced[b][c] = tk

    def _room(self, b: int, c: int, k: Tensor, v: Tensor, bits_k: Tensor, count: int) -> tuple[Tensor, Tensor, Tensor]:
        """The buffers of (b, c), grown (window copy and stored rows kept) to hold ``count`` members."""
        kb, vb, bb, w = self.k[b][c], self.v[b][c], self.bits[b][c], self.window
        if kb is not None and vb is not None and bb is not None and bb.shape[0] >= count:
            return kb, vb, bb
        cap = max(count + 64, int(1.5 * (0 if bb is None else bb.shape[0])))
        grown_k = k.new_empty(1, k.shape[1], w + cap, k.shape[3])
        grown_v = v.new_empty(1, v.shape[1], w + cap, v.shape[3])
        grown_b = bits_k.new_empty(cap)
        if kb is not None and vb is not None and bb is not None:
            keep = w + self.stored[b][c]
            grown_k[:, :, :keep], grown_v[:, :, :keep] = kb[:, :, :keep], vb[:, :, :keep]
            grown_b[: self.stored[b][c]] = bb[: self.stored[b][c]]
        self.k[b][c], self.v[b][c], self.bits[b][c] = grown_k, grown_v, grown_b
        return grown_k, grown_v, grown_b


def _merge(parts: list[tuple[Tensor, Tensor]]) -> Tensor:
    """Attention results over disjoint key sets (output, logsumexp) -> the output over their union, in the
    logsumexp's dtype (float32 for bf16 inputs)."""
    (o, lse), *rest = parts
    if not rest:
        return o
    if len(rest) == 1:  # two parts: one interpolation
        o_part, lse_part = rest[0]
        weight = torch.sigmoid(lse_part - lse).unsqueeze(-1)
        if o.dtype != weight.dtype:
            o, o_part = o.to(weight.dtype), o_part.to(weight.dtype)
        return torch.lerp(o, o_part, weight)
    weights = torch.softmax(torch.stack([lse_part for _, lse_part in parts]), dim=0)[..., None]
    return (torch.stack([o_part for o_part, _ in parts]).to(weights.dtype) * weights).sum(0)


def cpu_decode_hard_attention(
    q: Tensor, k: Tensor, v: Tensor, *, bits_q: Tensor | None, bits_k: Tensor | Callable[[], Tensor],
    lists: GroupLists, window: int, scale: float, words: list[int] | None = None,
) -> Tensor:  # fmt: skip
    """``decode_hard_attention`` on the CPU kernel. Once the window is full, the token's first group is read as one
    contiguous slice of ``GroupRows`` (kept in ``lists.rows``): the window copy and the group's members before the
    window, one kernel call; each further group (top_k > 1) is one more call over its members before the window,
    a key also in a lower group of the token masked there, merged by logsumexp. When the window and the token's
    groups hold DENSE_SHARE of the keys, one masked call over the cache instead. No autograd (the kernel's
    logsumexp has no gradient): the caller uses ``decode_hard_attention`` then.

    ``words``: the tokens' membership words, when the caller has them on the host (else read from ``bits_q``).
    ``bits_k`` may be a function returning it, called only when a step reads the keys' words (a fill of group
    rows, a masked call)."""
    b_size, tk = q.shape[0], k.shape[2]
    lo = tk - window  # keys [lo, tk) are inside the window: all allowed
    if lo <= 0:  # every key is inside the window
        return _FWD(q, k, v, 0.0, False, scale=scale)[0]
    if lists.rows is None or lists.rows.window != window:
        lists.rows = GroupRows(b_size, lists.n_groups, window)
    rows = lists.rows
    outs = []
    if words is None:
        assert bits_q is not None, "bits_q or words"
        words = [word for (word,) in bits_q.tolist()]

    def keys_words() -> Tensor:
        return bits_k if isinstance(bits_k, Tensor) else bits_k()

    for b, own in enumerate(words):
        qb, kb, vb = (q, k, v) if b_size == 1 else (q[b : b + 1], k[b : b + 1], v[b : b + 1])
        groups = [c for c in range(lists.n_groups) if (own >> c) & 1]
        far = [bisect.bisect_left(lists.pos[b][c], lo) for c in groups]  # members before the window
        if window + sum(far) >= DENSE_SHARE * tk:  # the groups hold most keys: one masked call over the cache
            allowed = (keys_words()[b] & own) != 0
            allowed[lo:] = True
            mask = additive(allowed, q.dtype)[None, None, None]
            outs.append(_FWD(qb, kb, vb, 0.0, False, attn_mask=mask, scale=scale)[0])
            continue
        parts: list[tuple[Tensor, Tensor]] = []
        for c, n_far in zip(groups, far):
            if not parts:  # the token's first group: the window copy and its far members, one call
                if rows.stored[b][c] < n_far or rows.k[b][c] is None:
                    rows.fill(lists, b, c, k, v, keys_words())
                rows.sync(b, c, k, v)
                kr, vr = rows.k[b][c], rows.v[b][c]
                assert kr is not None and vr is not None  # filled above
                parts.append(_FWD(qb, kr[:, :, : window + n_far], vr[:, :, : window + n_far], 0.0, False, scale=scale))
                continue
            if n_far == 0:
                continue
            if rows.stored[b][c] < n_far:
                rows.fill(lists, b, c, k, v, keys_words())
            kr, vr, br = rows.k[b][c], rows.v[b][c], rows.bits[b][c]
            assert kr is not None and vr is not None and br is not None  # filled above
            dup = (br[:n_far] & (own & ((1 << c) - 1))) != 0  # also in a lower group of the token: taken there
            if bool(dup.all()):
                continue
            mask = additive(~dup, q.dtype)[None, None, None]
            far_k, far_v = kr[:, :, window : window + n_far], vr[:, :, window : window + n_far]
            parts.append(_FWD(qb, far_k, far_v, 0.0, False, attn_mask=mask, scale=scale))
        if not parts:  # a token in no group: the window only
            parts.append(_FWD(qb, kb[:, :, lo:], vb[:, :, lo:], 0.0, False, scale=scale))
        outs.append(_merge(parts))
    out = outs[0] if b_size == 1 else torch.cat(outs, 0)
    return out if out.dtype == q.dtype else out.to(q.dtype)


def decode_hard_attention(
    q: Tensor, k: Tensor, v: Tensor, *, bits_q: Tensor, bits_k: Tensor, lists: GroupLists, window: int, scale: float
) -> Tensor:
    """One new token per sequence (q [B, H, 1, D], the last of the Tk cached keys): exact hard attention reading the
    window and the far members of the token's groups only. Any device; SDPA does the attention."""
    tk = k.shape[2]
    p = tk - 1
    lo = max(0, p - window + 1)  # keys [lo, p] are inside the window: all allowed
    near = torch.arange(lo, tk, device=q.device)
    outs = []
    for b, (own,) in enumerate(bits_q.tolist()):
        far = []
        for c in range(lists.n_groups):
            if not (own >> c) & 1:
                continue
            idx = lists.members(b, c, bisect.bisect_left(lists.pos[b][c], lo))  # members before the window
            lower = own & ((1 << c) - 1)
            if lower and idx.numel():  # a key also in a lower group of the query was taken there
                idx = idx[(bits_k[b, idx] & lower) == 0]
            far.append(idx)
        keys = torch.cat([*far, near])
        kb, vb = take_rows(k, b, keys)[None], take_rows(v, b, keys)[None]
        outs.append(sdpa_varying(q[b : b + 1], kb, vb, scale=scale, enable_gqa=kb.shape[1] != q.shape[1]))
    return torch.cat(outs, 0)
