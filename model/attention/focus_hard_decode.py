"""Focus hard mode, decode: the new token reads the window and the far members of its own groups only, from
per-group index lists kept with the KV cache (see ``focus_hard``'s docstring).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from model.attention.focus_hard_rows import additive, take_rows

_FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


# ---- decode: per-group index lists in the KV cache ----------------------------------------------------------------
class GroupLists:
    """Per (sequence, group): the positions of the group's members so far, ascending (the hard-mode KV cache)."""

    def __init__(self, batch: int, n_groups: int, device: torch.device | str, capacity: int = 256):
        self.n_groups = n_groups
        self.index = torch.zeros(batch, n_groups, capacity, dtype=torch.long, device=device)
        self.counts = [[0] * n_groups for _ in range(batch)]  # members per (sequence, group)
        self.length = 0  # tokens appended
        self.rows: GroupRows | None = None  # CPU decoding: the groups' keys and values, contiguous

    @property
    def count(self) -> Tensor:
        return torch.tensor(self.counts, dtype=torch.long, device=self.index.device)

    def _reserve(self, need: int) -> None:
        if need > self.index.shape[2]:
            grown = self.index.new_zeros(*self.index.shape[:2], max(need, 2 * self.index.shape[2]))
            grown[:, :, : self.index.shape[2]] = self.index
            self.index = grown

    def append(self, bits: Tensor) -> None:
        """bits [B, t]: memberships of the tokens at positions [length, length + t)."""
        if bits.shape[1] == 1:  # decoding: a few scalar writes
            words = bits[:, 0].tolist()
            self._reserve(max(max(row) for row in self.counts) + 1)
            for b, word in enumerate(words):
                for c in range(self.n_groups):
                    if (word >> c) & 1:
                        self.index[b, c, self.counts[b][c]] = self.length
                        self.counts[b][c] += 1
            self.length += 1
            return
        member = ((bits[:, :, None] >> torch.arange(self.n_groups, device=bits.device)) & 1).bool()  # [B, t, K]
        count = self.count
        added = member.sum(1)
        self._reserve(int((count + added).max()) if member.numel() else 0)
        slot = count[:, None, :] + member.long().cumsum(1) - 1  # [B, t, K]
        bi, ii, ci = member.nonzero(as_tuple=True)
        self.index[bi, ci, slot[bi, ii, ci]] = self.length + ii
        self.counts = (count + added).tolist()
        self.length += bits.shape[1]

    def members(self, b: int, c: int, count: int) -> Tensor:
        return self.index[b, c, :count]


class GroupRows:
    """Per (sequence, group): the keys and values of the group's members, contiguous and in position order, copied
    from the KV cache as tokens arrive (``sync``). CPU decoding then reads a group's far keys as one slice instead of
    gathering them every step. Costs top_k times the raw keys and values (plus growth room)."""

    def __init__(self, batch: int, n_groups: int):
        self.k: list[list[Tensor | None]] = [[None] * n_groups for _ in range(batch)]
        self.v: list[list[Tensor | None]] = [[None] * n_groups for _ in range(batch)]
        self.stored = [[0] * n_groups for _ in range(batch)]

    def sync(self, lists: GroupLists, k: Tensor, v: Tensor) -> None:
        """Copy in the members the lists gained since the last call (k, v: [B, Hkv, Tk, D], the cache so far)."""
        for b, row in enumerate(lists.counts):
            for c, count in enumerate(row):
                have = self.stored[b][c]
                if count == have:
                    continue
                new = lists.members(b, c, count)[have:]
                kb, vb = self.k[b][c], self.v[b][c]
                if kb is None or kb.shape[1] < count:
                    cap = max(count + 64, int(1.5 * (0 if kb is None else kb.shape[1])))
                    grown_k = k.new_empty(k.shape[1], cap, k.shape[3])
                    grown_v = v.new_empty(v.shape[1], cap, v.shape[3])
                    if kb is not None and vb is not None:
                        grown_k[:, :have], grown_v[:, :have] = kb[:, :have], vb[:, :have]
                    self.k[b][c], self.v[b][c] = kb, vb = grown_k, grown_v
                assert kb is not None and vb is not None
                if new.numel() == 1:  # decoding: one row, no gather
                    kb[:, have] = k[b, :, int(new)]
                    vb[:, have] = v[b, :, int(new)]
                else:
                    kb[:, have:count] = take_rows(k, b, new)
                    vb[:, have:count] = take_rows(v, b, new)
                self.stored[b][c] = count


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
    lists.rows.sync(lists, k, v)
    counts = lists.counts
    words = bits_q[:, 0].tolist()
    outs = []
    for b in range(b_size):
        own = words[b]
        qb = q[b : b + 1]
        o, lse = _FWD(qb, k[b : b + 1, :, lo:], v[b : b + 1, :, lo:], 0.0, False, scale=scale)
        parts = [(o, lse)]
        for c in range(lists.n_groups):
            if not (own >> c) & 1:
                continue
            idx = lists.members(b, c, counts[b][c])
            n_far = int(torch.searchsorted(idx, lo))  # members before the window
            if n_far == 0:
                continue
            mask = None
            lower = own & ((1 << c) - 1)
            if lower:  # a key also in a lower group of the token was taken there
                dup = (bits_k[b, idx[:n_far]] & lower) != 0
                if bool(dup.all()):
                    continue
                mask = additive(~dup, q.dtype)[None, None, None]
            kr, vr = lists.rows.k[b][c], lists.rows.v[b][c]
            assert kr is not None and vr is not None  # synced above
            kc, vc = kr[None, :, :n_far], vr[None, :, :n_far]
            parts.append(_FWD(qb, kc, vc, 0.0, False, attn_mask=mask, scale=scale))
        if len(parts) == 1:
            outs.append(o)
            continue
        # merge by logsumexp: part weights softmax(lse) over the parts, in the logsumexp's dtype (float32 for bf16)
        weights = torch.softmax(torch.stack([lse_part for _, lse_part in parts]), dim=0)[..., None]
        out = (torch.stack([o_part for o_part, _ in parts]).to(weights.dtype) * weights).sum(0)
        outs.append(out.to(q.dtype))
    return torch.cat(outs, 0)


def decode_hard_attention(
    q: Tensor, k: Tensor, v: Tensor, *, bits_q: Tensor, bits_k: Tensor, lists: GroupLists, window: int, scale: float
) -> Tensor:
    """One new token per sequence (q [B, H, 1, D], the last of the Tk cached keys): exact hard attention reading the
    window and the far members of the token's groups only. Any device; SDPA does the attention."""
    b_size, tk = q.shape[0], k.shape[2]
    p = tk - 1
    lo = max(0, p - window + 1)  # keys [lo, p] are inside the window: all allowed
    counts = lists.counts
    near = torch.arange(lo, tk, device=q.device)
    outs = []
    for b in range(b_size):
        own = int(bits_q[b, 0])
        far = []
        for c in range(lists.n_groups):
            if not (own >> c) & 1:
                continue
            idx = lists.members(b, c, counts[b][c])
            idx = idx[: int(torch.searchsorted(idx, lo))]  # members before the window
            lower = own & ((1 << c) - 1)
            if lower and idx.numel():  # a key also in a lower group of the query was taken there
                idx = idx[(bits_k[b, idx] & lower) == 0]
            far.append(idx)
        keys = torch.cat([*far, near])
        kb, vb = take_rows(k, b, keys)[None], take_rows(v, b, keys)[None]
        outs.append(
            F.scaled_dot_product_attention(q[b : b + 1], kb, vb, scale=scale, enable_gqa=kb.shape[1] != q.shape[1])
        )
    return torch.cat(outs, 0)
