"""Focus hard mode, decode: the new token reads the window and the far members of its own groups only, from
per-group member lists kept with the KV cache (see ``focus_hard``'s docstring).

A decode step is a few kernel calls around a fixed cost of small operations (at batch 1 the small operations took
as long as the kernels), so the lists are Python-side int64 arrays (append and bisection without tensor
operations), and the CPU path copies a group's keys into its contiguous rows only when a member leaves the window
that is not there yet (then every member so far: about one copy per group per ``window`` tokens).
"""

from __future__ import annotations

import bisect
from array import array

import torch
from torch import Tensor

from model.attention.focus_hard_rows import additive, take_rows
from model.attention.sdpa import sdpa_varying

_FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


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
            for b, (word,) in enumerate(bits.tolist()):
                for c in range(self.n_groups):
                    if (word >> c) & 1:
                        self.pos[b][c].append(self.length)
            self.length += 1
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
    """Per (sequence, group): the keys and values of the group's first ``stored`` members, [1, Hkv, capacity, D],
    contiguous and in position order (and their membership words, for top_k > 1), copied from the KV cache by
    ``fill``. CPU decoding reads a group's far keys as one slice. Costs top_k times the raw keys and values (plus
    growth room)."""

    def __init__(self, batch: int, n_groups: int):
        self.k: list[list[Tensor | None]] = [[None] * n_groups for _ in range(batch)]
        self.v: list[list[Tensor | None]] = [[None] * n_groups for _ in range(batch)]
        self.bits: list[list[Tensor | None]] = [[None] * n_groups for _ in range(batch)]
        self.stored = [[0] * n_groups for _ in range(batch)]

    def fill(self, lists: GroupLists, b: int, c: int, k: Tensor, v: Tensor, bits_k: Tensor) -> None:
        """Copy in every member of group c of sequence b not stored yet (k, v: [B, Hkv, Tk, D] and bits_k [B, Tk],
        the cache so far, holding every listed member)."""
        pos = lists.pos[b][c]
        have, count = self.stored[b][c], len(pos)
        if count == have:
            return
        kb, vb, bb = self.k[b][c], self.v[b][c], self.bits[b][c]
        if kb is None or vb is None or bb is None or kb.shape[2] < count:
            cap = max(count + 64, int(1.5 * (0 if kb is None else kb.shape[2])))
            grown_k = k.new_empty(1, k.shape[1], cap, k.shape[3])
            grown_v = v.new_empty(1, v.shape[1], cap, v.shape[3])
            grown_b = bits_k.new_empty(cap)
            if kb is not None and vb is not None and bb is not None:
                grown_k[:, :, :have], grown_v[:, :, :have], grown_b[:have] = kb[:, :, :have], vb[:, :, :have], bb[:have]
            self.k[b][c], self.v[b][c], self.bits[b][c] = kb, vb, bb = grown_k, grown_v, grown_b
        new = _as_index(pos[have:count], k.device)
        kb[0, :, have:count] = take_rows(k, b, new)
        vb[0, :, have:count] = take_rows(v, b, new)
        bb[have:count] = bits_k[b].index_select(0, new)
        self.stored[b][c] = count


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
    q: Tensor, k: Tensor, v: Tensor, *, bits_q: Tensor, bits_k: Tensor, lists: GroupLists, window: int, scale: float
) -> Tensor:
    """``decode_hard_attention`` on the CPU kernel, reading each of the token's groups' far keys as one contiguous
    slice of ``GroupRows`` (kept in ``lists.rows``) and the window as a slice of the cache; the parts (window, one per
    group) merge by logsumexp. With top_k > 1 a far key also in a lower group of the token is masked in the higher
    one. No autograd (the kernel's logsumexp has no gradient): the caller uses ``decode_hard_attention`` then."""
    b_size, tk = q.shape[0], k.shape[2]
    lo = max(0, tk - window)  # keys [lo, tk) are inside the window: all allowed
    if lists.rows is None:
        lists.rows = GroupRows(b_size, lists.n_groups)
    rows = lists.rows
    outs = []
    for b, (own,) in enumerate(bits_q.tolist()):
        qb, kb, vb = (q, k, v) if b_size == 1 else (q[b : b + 1], k[b : b + 1], v[b : b + 1])
        parts = [_FWD(qb, kb[:, :, lo:], vb[:, :, lo:], 0.0, False, scale=scale)]
        for c in range(lists.n_groups):
            if not (own >> c) & 1:
                continue
            n_far = bisect.bisect_left(lists.pos[b][c], lo)  # members before the window
            if n_far == 0:
                continue
            if rows.stored[b][c] < n_far:
                rows.fill(lists, b, c, k, v, bits_k)
            kr, vr, br = rows.k[b][c], rows.v[b][c], rows.bits[b][c]
            assert kr is not None and vr is not None and br is not None  # filled above
            mask = None
            lower = own & ((1 << c) - 1)
            if lower:  # a key also in a lower group of the token was taken there
                dup = (br[:n_far] & lower) != 0
                if bool(dup.all()):
                    continue
                mask = additive(~dup, q.dtype)[None, None, None]
            parts.append(_FWD(qb, kr[:, :, :n_far], vr[:, :, :n_far], 0.0, False, attn_mask=mask, scale=scale))
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
