"""Dynamic Group Attention's grouped KV cache: compressed entries, the raw window and the queries not
folded yet, so decode reads far fewer keys than full attention keeps (docs/dga.md)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor

from model.attention.common import reference as ref
from model.attention.common.base import Attention, AttnOut, CPRunner, KVCache, kv_cache_nbytes
from model.attention.common.flex import gpu_paths_active
from model.attention.dga.compressed import sample_offsets
from model.attention.dga.config import DGAConfig, focal_count

if TYPE_CHECKING:
    from model.attention.dga.compressed import Compressed
from model.attention.common.sdpa import sdpa_varying


class GroupedKVCache(Attention):
    """The cached (prefill and decode) half of DynamicGroupAttention, its base. The selection and
    attention steps it calls are DynamicGroupAttention's (declared here for the type checker)."""

    cfg: DGAConfig
    scale: float
    if TYPE_CHECKING:

        def _compress_causal(
            self, q: Tensor, k: Tensor, v: Tensor, first: int, last: int, q_base: int = 0, k_base: int = 0
        ) -> tuple[Compressed, tuple[Tensor, Tensor, Tensor]]: ...
        def _compress_sequence(
            self, q: Tensor, k: Tensor, v: Tensor
        ) -> tuple[Compressed, tuple[Tensor, Tensor, Tensor]]: ...
        def _needed_chunks(self, last_query_pos: int) -> int: ...
        def compress(
            self,
            q: Tensor,
            k: Tensor,
            v: Tensor,
            starts: Tensor,
            n: int,
            window: int,
            offsets: Tensor,
            *,
            q_base: int = 0,
            k_base: int = 0,
        ) -> Compressed: ...
        def _fast(
            self, q: Tensor, q_keys: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, step: Any = None
        ) -> AttnOut: ...
        def _attend_window(
            self,
            q: Tensor,
            q_pos: Tensor,
            k: Tensor,
            v: Tensor,
            ck: Tensor,
            cv: Tensor,
            avail: Tensor,
            k_base: int = 0,
            span: tuple[int, int] | None = None,
        ) -> tuple[Tensor, Tensor]: ...
        def _attend_complementary(
            self,
            q: Tensor,
            q_pos: Tensor,
            k: Tensor,
            v: Tensor,
            comp: Compressed,
            ck: Tensor,
            cv: Tensor,
            avail: Tensor,
        ) -> tuple[Tensor, Tensor]: ...

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        hidden: Tensor,
        positions: Tensor,
        cache: KVCache | None = None,
        documents: Tensor | None = None,
        context_parallel: CPRunner | None = None,
        step: Any = None,
    ) -> AttnOut:
        """As the base class, except with a cache: the grouped cache keeps its own small buffers (compressed
        entries, the raw window, the queries not folded yet), so the base cache's raw ``max_len`` buffers are
        freed on first use and never appended to; ``cache.length`` still counts every token. ``step``
        (``prepare_step``, a whole sequence from position 0): the fast path takes the shared state."""
        if step is not None and cache is None and documents is None and context_parallel is None:
            if self.impl != "reference":
                return self._fast(q, q, k, v, positions, step)
        if cache is None or documents is not None:
            return super().forward(
                q,
                k,
                v,
                hidden=hidden,
                positions=positions,
                cache=cache,
                documents=documents,
                context_parallel=context_parallel,
            )
        t = k.shape[2]
        if cache.length + t > cache.max_len:
            raise ValueError(f"KV cache full: {cache.length} + {t} tokens exceeds its max_len {cache.max_len}")
        if cache.k.numel() or cache.v.numel():
            cache.k, cache.v = cache.k.new_empty(0), cache.v.new_empty(0)
        return self._cached(q, k, v, positions, cache)

    def _cached(self, q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, cache: KVCache) -> AttnOut:
        """q: the new queries; k, v: the new keys and values only (positions cache.length ..)."""
        if self.cfg.selection == "causal":
            out = self._cached_causal(q, k, v, q_pos, cache)
        else:
            out = self._cached_sequence(q, k, v, q_pos, cache)
        cache.length += k.shape[2]
        stats = {}
        if self.collect_stats:
            size = self.cache_size(cache)
            stats = {"cache_ratio": torch.tensor(size["dga_kv_slots"] / max(1, size["full_kv_slots"]))}
        return AttnOut(out, stats=stats)

    def _entries_per_chunk(self) -> int:
        c, m = self.cfg.chunk_size, self.cfg.group_size
        r = focal_count(c, self.cfg.gamma, self.cfg.min_focal, m)
        return r + (c - r) // m

    def _causal_state(self, cache: KVCache, q: Tensor) -> dict:
        """Buffers sized once from ``cache.max_len``: ``k``/``v`` hold the compressed entries ``[0, n)`` (chunk
        after chunk, at the query head count) followed by the raw keys of positions ``folded * C ..``
        (at most 2C + 1 of them); ``q`` holds the queries of those positions (importance samples, q_last)."""
        st = cache.extra.get("dga")
        if st is None:
            b, hq, _, d = q.shape
            c = self.cfg.chunk_size
            entries = self._needed_chunks(cache.max_len - 1) * self._entries_per_chunk()
            # zero-filled: the static decode step (``decode_step``) reads whole buffers under a mask, and a NaN in
            # a masked row would still meet its zero weight
            st = cache.extra["dga"] = {
                "k": q.new_zeros(b, hq, entries + 2 * c + 1, d),
                "v": q.new_zeros(b, hq, entries + 2 * c + 1, d),
                "q": q.new_zeros(b, hq, 2 * c + 1, d),
                "n": 0,  # compressed entries
                "folded": 0,  # chunks folded; raw keys and queries are held from position folded * C on
                # the same counts on the device, for the static decode step: entries, rows filled (entries + raw
                # keys held), chunks folded; the host keeps its own copies, so neither side reads the other's
                "counts": torch.zeros(3, dtype=torch.long, device=q.device),
            }
        return st

    def _cached_causal(self, q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, cache: KVCache) -> Tensor:
        hq, t = q.shape[1], q.shape[2]
        c = self.cfg.chunk_size
        st = self._causal_state(cache, q)
        k, v = ref.expand_kv(k, hq), ref.expand_kv(v, hq)
        n, folded, p0 = st["n"], st["folded"], cache.length
        base = folded * c  # first raw position held
        held = p0 - base
        need = self._needed_chunks(p0 + t - 1)
        if t == 1 and gpu_paths_active(q):  # the GPU's decode: static shapes, device-side counts (a CUDA graph)
            return self._decode_static(q, k, v, st, fold=need > folded)
        if t == 1 and need == folded:
            # decode between folds: every compressed entry is visible, the raw keys held are the query's window
            st["k"][:, :, n + held], st["v"][:, :, n + held], st["q"][:, :, held] = k[:, :, 0], v[:, :, 0], q[:, :, 0]
            keys, values = st["k"][:, :, : n + held + 1], st["v"][:, :, : n + held + 1]
            return sdpa_varying(q, keys, values, scale=self.scale)
        # prefill, chunked prefill, or a decode step that folds: raw keys / queries of positions base .. p0 + t - 1
        rk = torch.cat([st["k"][:, :, n : n + held], k], 2)
        rv = torch.cat([st["v"][:, :, n : n + held], v], 2)
        rq = torch.cat([st["q"][:, :, :held], q], 2)
        if need > folded:  # chunks folded .. need - 1, from exactly the inputs the uncached forward uses
            _, (ck, cv, _) = self._compress_causal(rq, rk, rv, folded, need, q_base=base, k_base=base)
            st["k"][:, :, n : n + ck.shape[2]], st["v"][:, :, n : n + ck.shape[2]] = ck, cv
            n += ck.shape[2]
        out = None
        if t > 1:  # each query sees the entries of the chunks <= its own - 2 and its own window
            avail = (torch.arange(n, device=q.device) // self._entries_per_chunk() + 2) * c  # chunk u: from (u + 2) C
            out = self._attend_window(
                q, q_pos, rk, rv, st["k"][:, :, :n], st["v"][:, :, :n], avail.expand(q.shape[0], hq, n), k_base=base
            )[0]
        folded = max(folded, need)
        keep = slice(folded * c - base, None)  # raw keys and queries from the window of the last query on
        kept = rk.shape[2] - (folded * c - base)
        st["k"][:, :, n : n + kept], st["v"][:, :, n : n + kept] = rk[:, :, keep], rv[:, :, keep]
        st["q"][:, :, :kept] = rq[:, :, keep]
        st["n"], st["folded"] = n, folded
        for i, count in enumerate((n, n + kept, folded)):  # fill_ passes the value with the kernel: no sync
            st["counts"][i].fill_(count)
        if out is None:  # one query after its fold: every entry and the raw keys held, as between folds
            keys, values = st["k"][:, :, : n + kept], st["v"][:, :, : n + kept]
            out = sdpa_varying(q, keys, values, scale=self.scale)
        return out

    def _decode_static(self, q: Tensor, k: Tensor, v: Tensor, st: dict, *, fold: bool) -> Tensor:
        """One decoded token with static shapes: ``decode_step`` (or ``fold_step`` when the token's arrival folds a
        chunk, which the host knows from its own counts) over the whole buffers, compiled once per shape on CUDA.
        Equal to the host path token by token (tests/attention/dga/test_decode.py)."""
        args = (q, k, v, st["k"], st["v"], st["q"], st["counts"])
        if fold:
            e = self._entries_per_chunk()
            if st["n"] + e + self.cfg.chunk_size + 1 > st["k"].shape[2]:
                raise ValueError("dga: the grouped cache is full (a fold past max_len)")
            out = _compiled("fold", fold_step, q)(self, *args)
            st["n"], st["folded"] = st["n"] + e, st["folded"] + 1
            return out
        return _compiled("decode", decode_step, q)(self, *args)

    def _cached_sequence(self, q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, cache: KVCache) -> Tensor:
        """Sequence form: prefill compresses the prompt; decode folds a group every m' tokens (section 5.1).
        The cache holds the compressed entries and the fewer than m' raw tokens since the last fold."""
        hq = q.shape[1]
        k, v = ref.expand_kv(k, hq), ref.expand_kv(v, hq)
        st = cache.extra.get("dga")
        if st is None:
            if int(q_pos[0]) != 0:
                raise ValueError("dga (selection=sequence): the first call on a cache must prefill from position 0")
            comp, (ck, cv, avail) = self._compress_sequence(q, k, v)
            out, _ = self._attend_complementary(q, q_pos, k, v, comp, ck, cv, avail)
            cache.extra["dga"] = {"k": ck, "v": cv, "raw_k": k[:, :, :0].clone(), "raw_v": v[:, :, :0].clone()}
            return out
        m = self.cfg.group_size
        m_fold = math.ceil(round(self.cfg.decode_fold * m, 9))
        outs = []
        for i in range(q.shape[2]):  # each new token: all compressed entries + its raw buffer
            qi = q[:, :, i : i + 1]
            lk, lv = torch.cat([st["raw_k"], k[:, :, i : i + 1]], 2), torch.cat([st["raw_v"], v[:, :, i : i + 1]], 2)
            keys, values = torch.cat([st["k"], lk], 2), torch.cat([st["v"], lv], 2)
            p = torch.softmax(ref.scores(qi, keys, self.scale), dim=-1)
            outs.append(ref.weighted_values(p, values, q.dtype))
            if lk.shape[2] == m_fold:
                fk, fv, ak, av = self.fold(qi, lk, lv, m)
                st["k"] = torch.cat([st["k"], fk, ak], 2)
                st["v"] = torch.cat([st["v"], fv, av], 2)
                lk, lv = lk[:, :, :0].clone(), lv[:, :, :0].clone()  # not views: they would keep lk's storage
            st["raw_k"], st["raw_v"] = lk, lv
        return torch.cat(outs, dim=2)

    def fold(self, q_last: Tensor, k: Tensor, v: Tensor, m: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Fold m' buffered tokens: the top m'-m by the last query's score stay focal, the other m
        (in position order) become one group with weights softmax(q_last k^T / sqrt(d))."""
        dt = torch.promote_types(q_last.dtype, torch.float32)
        s = (torch.matmul(q_last.to(dt), k.to(dt).transpose(-1, -2)) * self.scale)[:, :, 0]  # [B, H, m']
        n = k.shape[2]
        with torch.no_grad():
            focal = torch.zeros_like(s, dtype=torch.bool).scatter_(-1, s.topk(n - m, dim=-1).indices, True)
            order = torch.argsort(focal.to(torch.int8), dim=-1, stable=True)
        members, focal_idx = order[..., :m], order[..., m:]
        w = torch.softmax(s.gather(-1, members), dim=-1)[..., None]
        ak = (w * ref.take_rows(k, members).to(dt)).sum(-2, keepdim=True).to(k.dtype)
        av = (w * ref.take_rows(v, members).to(dt)).sum(-2, keepdim=True).to(v.dtype)
        return ref.take_rows(k, focal_idx), ref.take_rows(v, focal_idx), ak, av

    def cache_size(self, cache: KVCache) -> dict[str, int]:
        """Key/value slots per head the grouped cache holds against full attention's, the queries the causal
        form holds until their chunks are folded, and the bytes the cache has allocated (``kv_cache_nbytes``)."""
        st = cache.extra.get("dga")
        full = cache.length
        nbytes = kv_cache_nbytes(cache)
        if st is None:
            return {"full_kv_slots": full, "dga_kv_slots": full, "dga_query_slots": 0, "bytes": nbytes}
        if self.cfg.selection == "causal":
            held = full - st["folded"] * self.cfg.chunk_size  # raw keys and queries from the next window on
            return {"full_kv_slots": full, "dga_kv_slots": st["n"] + held, "dga_query_slots": held, "bytes": nbytes}
        slots = st["k"].shape[2] + st["raw_k"].shape[2]
        return {"full_kv_slots": full, "dga_kv_slots": slots, "dga_query_slots": 0, "bytes": nbytes}


# ---- the static decode step (GPU: CUDA-graph capturable) -------------------------------------------------------
# Buffers as ``_causal_state`` lays them out: k, v [B, H, N_max + 2C + 1, D] (entries [0, n), then the raw keys
# held), q [B, H, 2C + 1, D]; counts = [n, rows filled, chunks folded] on the device. Every shape is fixed by the
# buffers, every position is read from ``counts`` on the device and written in place, so a step has no host read
# and one compiled graph serves every token. The attention reads the whole buffer under a mask (rows < filled):
# static, at the cost of reading the empty rows too.


def decode_step(
    core: GroupedKVCache, q: Tensor, k: Tensor, v: Tensor, kb: Tensor, vb: Tensor, qb: Tensor, counts: Tensor
) -> Tensor:
    """A token between folds: its key, value and query written at the next rows, then one SDPA over every entry and
    the raw keys held (every entry is visible to it). q, k, v [B, H, 1, D] at the query head count."""
    filled = counts[1:2]
    kb.index_copy_(2, filled, k)
    vb.index_copy_(2, filled, v)
    qb.index_copy_(2, filled - counts[0:1], q)
    counts[1:2] += 1
    visible = (torch.arange(kb.shape[2], device=kb.device) < counts[1])[None]  # [1, rows]: one query
    return F.scaled_dot_product_attention(q, kb, vb, attn_mask=visible, scale=core.scale)


def fold_step(
    core: GroupedKVCache, q: Tensor, k: Tensor, v: Tensor, kb: Tensor, vb: Tensor, qb: Tensor, counts: Tensor
) -> Tensor:
    """A token whose arrival folds chunk ``folded`` (the host knows when: the token is at (folded + 2) C, and then
    exactly 2C raw keys are held): that chunk is compressed from the 2C raw rows held, as the uncached forward
    compresses it (same sampled queries: the seed of the chunk's index), its entries are written after the others
    and the next chunk's raw rows moved behind them; then ``decode_step``."""
    c, e = core.cfg.chunk_size, core._entries_per_chunk()
    dev = kb.device
    rows = counts[0] + torch.arange(2 * c, device=dev)
    rk, rv, rq = kb.index_select(2, rows), vb.index_select(2, rows), qb[:, :, : 2 * c].clone()
    seeds = core.cfg.seed * 1_000_003 + counts[2:3]
    offsets = sample_offsets(2 * c, core.cfg.sample_recent, core.cfg.sample_random, seeds)
    comp = core.compress(rq, rk, rv, torch.zeros(1, dtype=torch.long, device=dev), c, 2 * c, offsets)
    ck = torch.cat([comp.focal_k, comp.agg_k], dim=3).flatten(2, 3)  # [B, H, E, D], as ``Compressed.entries``
    cv = torch.cat([comp.focal_v, comp.agg_v], dim=3).flatten(2, 3)
    kb.index_copy_(2, rows[:e], ck)
    vb.index_copy_(2, rows[:e], cv)
    kb.index_copy_(2, rows[e : e + c], rk[:, :, c:])
    vb.index_copy_(2, rows[e : e + c], rv[:, :, c:])
    qb[:, :, :c] = rq[:, :, c:]
    counts[0:1] += e  # entries: n + E
    counts[1:2] += e - c  # rows filled: n + E + C (the next chunk's raw keys)
    counts[2:3] += 1  # chunks folded
    return decode_step(core, q, k, v, kb, vb, qb, counts)


_STEP_FNS: dict[str, Any] = {}


def _compiled(name: str, fn: Any, q: Tensor) -> Any:
    """``fn`` compiled on CUDA (static shapes: one graph per buffer size; ``mode="reduce-overhead"`` can capture it
    in a CUDA graph), eager elsewhere."""
    if not q.is_cuda or torch.compiler.is_compiling():
        return fn
    if name not in _STEP_FNS:
        _STEP_FNS[name] = torch.compile(fn, dynamic=False)
    return _STEP_FNS[name]
