"""Dynamic Group Attention's module (the package docstring has the paper's summary; docs/dga.md the design).

``DynamicGroupAttention``: the compression shared by every path (importance, focal selection, aggregation), the
dense reference (``naive.py``), the memory-linear CPU parts form (``cpu.py``), the gathered form (one softmax over
``[focal; aggregated; complementary/window]`` keys: cached calls and ``impl = "gathered"``), FlexAttention on CUDA
(``flex.py``) and the context-parallel hooks; its base ``GroupedKVCache`` (``cached.py``) is the cached half.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from model.attention.common import reference as ref
from model.attention.common.base import AttnOut, CPGather, KVCache, LayerSpec, SuiteCase
from model.attention.common.flex import cached_structure, flex_supports
from model.attention.dga import flex, naive
from model.attention.dga.cached import GroupedKVCache
from model.attention.dga.compressed import Compressed, pad_positions, sample_offsets
from model.attention.dga.config import DGAConfig, focal_count
from model.attention.dga.cpu import KERNEL_DTYPES, CausalPlan, Plan, SequencePlan, parts_attention
from model.attention.dga.select import focal_order


@dataclass(frozen=True)
class CPContext:
    """What a DGA layer gathers under context parallelism (``cp_context``): the compressed entries of the whole
    sequence (keys, values) on the parts path, else the whole sequence's queries."""

    entries: tuple[Tensor, Tensor] | None = None
    queries: Tensor | None = None


@dataclass(frozen=True)
class DGAStep:
    """What every layer shares in a whole-sequence causal forward (``prepare_step``): the chunk starts and sampled
    query offsets of chunks 0..needed-1 (``_causal_units``: they depend on the options and the length only) and, on
    the FlexAttention path, its block masks."""

    starts: Tensor
    offsets: Tensor
    masks: flex.CausalMasks | None


IMPORTANCE_ELEMENTS = 1 << 18  # scores of the sampled queries computed at once (1 MiB in float32)


class DynamicGroupAttention(GroupedKVCache):
    description = "Dynamic Group Attention, causal chunked selection (docs/dga.md)"

    def __init__(self, cfg: DGAConfig, spec: LayerSpec):
        super().__init__(cfg, spec)
        self.scale = 1.0 / math.sqrt(spec.head_dim)

    @classmethod
    def suite_cases(cls) -> list[SuiteCase]:
        # Small chunks and groups so that, at the suite's 25-40 tokens, several chunks are folded
        # (focal + aggregated + window) and the sequence form has several groups and a leak.
        small = dict(group_size=2, gamma=0.2, sample_recent=2, sample_random=3)
        return [
            SuiteCase("causal", dict(selection="causal", chunk_size=8, **small)),
            SuiteCase(
                "causal-m3",
                dict(selection="causal", chunk_size=7, group_size=3, gamma=0.15, sample_recent=1, sample_random=2),
            ),
            SuiteCase("sequence", dict(selection="sequence", **small), causal=False),
        ]

    @classmethod
    def attention_ops(cls) -> tuple[Any, ...]:
        """The fused kernels, and the focal selection (``dga::focal_order``): selective checkpointing keeps its
        integer output, so the backward does not recompute the importance scores, their top-k and the ordering."""
        return (*super().attention_ops(), torch.ops.dga.focal_order.default)

    def saved_activation_bytes(
        self, *, q_tokens: int, k_tokens: int, heads: int, kv_heads: int, dtype_bytes: int
    ) -> int:
        """A fused kernel's (q, k, v, output, logsumexp), plus what DGA keeps: the second FlexAttention call's output
        and logsumexp (raw window and entries are two calls), the compressed entries' keys and values at the query
        heads (E per chunk of C keys) and the saved focal selection (one int64 per key and query head)."""
        base = super().saved_activation_bytes(
            q_tokens=q_tokens, k_tokens=k_tokens, heads=heads, kv_heads=kv_heads, dtype_bytes=dtype_bytes
        )
        d, c = self.spec.head_dim, self.cfg.chunk_size
        entries = k_tokens * self._entries_per_chunk() // c
        return base + (q_tokens * d + 2 * entries * d) * heads * dtype_bytes + (4 * q_tokens + 8 * k_tokens) * heads

    def prepare_step(self, seq_len: int, device: torch.device) -> DGAStep | None:
        """The causal form's per-step state (``DGAStep``), built once per length, options and device and shared by
        every layer and step; the sequence form has none."""
        if self.cfg.selection != "causal":
            return None
        flex_path = flex_supports(torch.empty(0, self.spec.head_dim, device=device))
        chunks = self._needed_chunks(seq_len - 1)

        def build() -> DGAStep:
            starts, offsets = self._causal_units(0, chunks, device)
            masks = None
            if flex_path:
                n = starts.shape[0] * self._entries_per_chunk()
                masks = flex.causal_masks(seq_len, n, self.cfg.chunk_size, self._entries_per_chunk(), device)
            return DGAStep(starts, offsets, masks)

        # nothing in it depends on a layer or a batch: kept per (length, options, device)
        return cached_structure(("dga_step", seq_len, str(device), flex_path, *vars(self.cfg).values()), build)

    # ---- compression (shared by every path) ------------------------------------------
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
    ) -> Compressed:
        """Compress units [s, s + n) for each s in ``starts``.

        q, k, v: [B, H, *, D] (k, v already at the query head count); q row p holds position
        p + q_base, k/v row p holds position p + k_base. Importance of each unit key: mean weight it gets
        from the sampled queries ``starts + offsets`` (eq. 16), softmax over the ``window`` keys
        from the unit start (eq. 17), causally masked.
        """
        b, h, _, d = k.shape
        u = starts.numel()
        cfg = self.cfg
        m = cfg.group_size
        r = focal_count(n, cfg.gamma, cfg.min_focal, m)
        g = (n - r) // m
        dt = torch.promote_types(q.dtype, torch.float32)
        dev = k.device
        starts = starts.to(dev)
        with torch.no_grad():  # the selection is a discrete decision: no gradient flows through it
            # units in blocks: the sampled queries' scores over each unit's window stay a fraction of the output
            step = max(1, IMPORTANCE_ELEMENTS // max(1, b * h * offsets.shape[-1] * window))
            # compiled: one block, since a loop count read from the length specialises the graph (a recompile per
            # length); the scores stay linear in T (U x S x 2C)
            blocks = [0] if torch.compiler.is_compiling() else range(0, max(u, 1), step)  # u = 0: one empty block
            if torch.compiler.is_compiling():
                step = u
            parts = [
                self._importance(
                    q,
                    k,
                    starts[i : i + step],
                    offsets if offsets.shape[0] == 1 else offsets[i : i + step],
                    window,
                    n,
                    q_base,
                    k_base,
                    dt,
                )
                for i in blocks
            ]
            importance = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)  # [B, H, U, n]
            # non-focal first, each part in position order; one operator, whose output selective checkpointing keeps
            order = focal_order(importance, r) + starts[:, None]
        focal_pos = order[..., n - r :]
        members = order[..., : n - r].reshape(b, h, u, g, m)
        km, vm = ref.take_rows(k, members - k_base), ref.take_rows(v, members - k_base)  # [B, H, U, g, m, D]
        q_last = ref.take_rows(q, members[..., -1] - q_base)  # [B, H, U, g, D]
        # products as matmuls: no [B, H, U, g, m, D] temporary
        # the matmuls in the inputs' dtype (bf16 on the GPU: no float32 copies of the gathered members, which are the
        # size of K and V), the softmax over each group in float32 or wider; float32 / float64 inputs: unchanged
        p = torch.softmax(torch.matmul(km, q_last[..., None])[..., 0].to(dt) * self.scale, dim=-1)
        agg_k = torch.matmul(p.to(k.dtype)[..., None, :], km)[..., 0, :]
        agg_v = torch.matmul(p.to(v.dtype)[..., None, :], vm)[..., 0, :]
        return Compressed(
            focal_pos, members, ref.take_rows(k, focal_pos - k_base), ref.take_rows(v, focal_pos - k_base), agg_k, agg_v
        )

    def _importance(
        self,
        q: Tensor,
        k: Tensor,
        starts: Tensor,
        offsets: Tensor,
        window: int,
        n: int,
        q_base: int,
        k_base: int,
        dt: torch.dtype,
    ) -> Tensor:
        """Eq. 16-17 for the units at ``starts``: the mean weight each of a unit's first ``n`` keys gets from the
        sampled queries ``starts + offsets``, softmax over the ``window`` keys from the unit start, causally masked.
        [B, H, U, n]."""
        b, h = k.shape[:2]
        wpos = starts[:, None] + torch.arange(window, device=k.device)  # [U, W]
        spos = starts[:, None] + offsets.to(k.device)  # [U, S]
        qs = ref.take_rows(q, (spos - q_base).expand(b, h, -1, -1)).to(dt)
        kw = ref.take_rows(k, (wpos - k_base).expand(b, h, -1, -1)).to(dt)
        mask = wpos[:, None, :] <= spos[:, :, None]  # [U, S, W]
        # out of place: under selective activation checkpointing the matmul's output is kept for the recompute, and
        # an in-place scale would apply twice there (the recomputed selection would differ from the forward's)
        s = (torch.matmul(qs, kw.transpose(-1, -2)) * self.scale).masked_fill(~mask, float("-inf"))
        del kw
        a = torch.softmax(s, dim=-1).nan_to_num_(0.0)  # a row with no key gives zeros
        del s
        return (a.sum(-2) / mask.sum(-2).clamp(min=1))[..., :n]

    def _causal_units(self, first: int, last: int, device: torch.device) -> tuple[Tensor, Tensor]:
        """Chunks first..last-1 and their sampled query offsets (relative to each chunk start, over 2C), built on
        ``device``: on the host they were copied to the GPU in every forward (and again in its recomputation)."""
        c = self.cfg.chunk_size
        units = torch.arange(first, last, device=device)
        seeds = self.cfg.seed * 1_000_003 + units
        return units * c, sample_offsets(2 * c, self.cfg.sample_recent, self.cfg.sample_random, seeds)

    def _compress_causal(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        first: int,
        last: int,
        q_base: int = 0,
        k_base: int = 0,
        units: tuple[Tensor, Tensor] | None = None,
    ) -> tuple[Compressed, tuple[Tensor, Tensor, Tensor]]:
        """Compressed entries (k, v, avail) of chunks first..last-1: visible from position (c+2) C. ``units``: their
        ``_causal_units`` when already built (``prepare_step``)."""
        c = self.cfg.chunk_size
        starts, offsets = units if units is not None else self._causal_units(first, last, k.device)
        comp = self.compress(q, k, v, starts, c, 2 * c, offsets, q_base=q_base, k_base=k_base)
        avail = (starts + 2 * c)[:, None]  # [U, 1]
        return comp, comp.entries(avail, avail)

    def _compress_sequence(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Compressed, tuple[Tensor, Tensor, Tensor]]:
        t = k.shape[2]
        seeds = torch.full((1,), self.cfg.seed * 1_000_003, device=k.device) + t
        offsets = sample_offsets(t, self.cfg.sample_recent, self.cfg.sample_random, seeds)
        comp = self.compress(q, k, v, torch.zeros(1, dtype=torch.long, device=k.device), t, t, offsets)
        # focal keys are visible from their own position, an aggregate once its last member is
        return comp, comp.entries(comp.focal_pos, comp.members[..., -1])

    def _needed_chunks(self, last_query_pos: int) -> int:
        """Chunks 0..n-1 are compressed for a query at ``last_query_pos`` (chunk j sees chunks <= j-2)."""
        return max(0, last_query_pos // self.cfg.chunk_size - 1)

    # ---- reference: dense over [raw keys; aggregates] (naive.py) ------------------------
    def reference(
        self, q: Tensor, k: Tensor, v: Tensor, *, hidden: Tensor, q_pos: Tensor, k_pos: Tensor, cache: KVCache | None
    ) -> AttnOut:
        # a call with a cache never gets here: ``forward`` sends it to the grouped cache (``_cached``)
        return self._reference(q, q, k, v, q_pos, k_pos)

    def _reference(self, q: Tensor, q_keys: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, k_pos: Tensor) -> AttnOut:
        """q: the queries at q_pos; q_keys: the queries at k_pos, which compression reads (importance samples and
        each group's last query); the same tensor except under context parallelism."""
        hq = q.shape[1]
        k, v = ref.expand_kv(k, hq), ref.expand_kv(v, hq)
        comp = self._compress_uncached(q_keys, k, v, int(q_pos[-1]))[0]
        raw_mask, agg_mask = naive.masks(
            comp.focal_pos, comp.members, q_pos, k_pos, selection=self.cfg.selection, chunk_size=self.cfg.chunk_size
        )
        out = naive.attention(q, k, v, comp.agg_k, comp.agg_v, raw_mask, agg_mask, self.scale)
        stats = self._stats(raw_mask.sum(-1) + agg_mask.sum(-1), q_pos) if self.collect_stats else {}
        return AttnOut(out, stats=stats)

    def _compress_uncached(
        self, q: Tensor, k: Tensor, v: Tensor, last_query_pos: int, step: DGAStep | None = None
    ) -> tuple[Compressed, tuple[Tensor, Tensor, Tensor]]:
        if self.cfg.selection == "causal":
            units = None if step is None else (step.starts, step.offsets)
            return self._compress_causal(q, k, v, 0, self._needed_chunks(last_query_pos), units=units)
        return self._compress_sequence(q, k, v)

    # ---- context parallelism ------------------------------------------------------------
    # Compressing key chunk j reads chunks j and j + 1 (importance: the sampled queries of both over the keys of
    # both; aggregation: each group's last query, inside chunk j). Each CP chunk holds whole DGA chunks
    # (cp_chunk_multiple), so the chunk-aligned windows and fold points are the single-process ones.
    # Parts path (CPU kernel dtypes, ``impl`` not "reference" / "gathered"): each rank compresses the DGA chunks it
    # holds (the first DGA chunk of the next CP chunk, queries and keys, comes from an all-gather of C rows per CP
    # chunk, without gradient: importance is a discrete choice) and the compressed entries (E per chunk) are
    # all-gathered, autograd-aware; each query chunk then runs ``CausalPlan`` at its offset against the gathered raw
    # keys and entries. So a rank computes and keeps only its own queries' share (plus the gathered K, V and
    # entries). Other paths (the dense reference, the gathered form, FlexAttention) gather the queries and compress
    # every needed chunk on every rank.
    @classmethod
    def cp_chunk_multiple(cls, cfg: DGAConfig) -> int:
        return cfg.chunk_size if cfg.selection == "causal" else 1

    @classmethod
    def cp_unsupported(cls, cfg: DGAConfig) -> str | None:
        if cfg.selection == "sequence":
            return "selection = 'sequence' chooses focal keys from the whole sequence (prefill only); use 'causal'"
        return None

    def _cp_parts(self, q: Tensor) -> bool:
        """Whether the CP chunks take the parts form (``_fast``'s choice for a whole sequence on the CPU)."""
        if self.impl in ("reference", "gathered") or self.cfg.selection != "causal" or flex_supports(q):
            return False
        return self._parts_kernel(q)

    def cp_context(
        self, q: Tensor, k: Tensor, v: Tensor, *, hidden: Tensor, gather: CPGather, positions: Tensor
    ) -> CPContext:
        if not self._cp_parts(q):
            return CPContext(queries=gather(q, 2))
        return CPContext(entries=self._cp_entries(q, k, v, gather, positions))

    def _cp_entries(
        self, q: Tensor, k: Tensor, v: Tensor, gather: CPGather, positions: Tensor
    ) -> tuple[Tensor, Tensor]:
        """The compressed entries of the whole sequence [B, Hq, (T / C) E, D] (keys, values; chunks that no query
        sees are zeros), each rank compressing the DGA chunks of its own two CP chunks."""
        c, e = self.cfg.chunk_size, self._entries_per_chunk()
        hq = q.shape[1]
        k, v = ref.expand_kv(k, hq), ref.expand_kv(v, hq)
        b, _, t_local, d = q.shape
        s = t_local // 2  # one CP chunk
        starts = (int(positions[0]), int(positions[s]))
        t = starts[0] + starts[1] + s  # chunks r and 2 cp - 1 - r: their starts add up to T - s
        needed = self._needed_chunks(t - 1)  # chunks 0..needed-1 are ever visible
        # the first DGA chunk of every CP chunk (queries and keys, no gradient), in global order
        heads = torch.cat([torch.cat([q[:, :, i * s : i * s + c], k[:, :, i * s : i * s + c]], -1) for i in (0, 1)], 2)
        heads = gather(heads.detach(), 2)  # [B, Hq, 2 cp C, 2 D]
        n_cp_chunks = heads.shape[2] // c
        local = []
        for i, start in enumerate(starts):
            first, last = start // c, min(start // c + s // c, needed)
            rows = slice(i * s, (i + 1) * s)
            if last > first:
                g = start // s  # this CP chunk's global index
                nxt = (
                    heads[:, :, (g + 1) * c : (g + 2) * c] if g + 1 < n_cp_chunks else heads.new_zeros(b, hq, c, 2 * d)
                )
                q_ext = torch.cat([q[:, :, rows], nxt[..., :d]], 2)
                k_ext = torch.cat([k[:, :, rows], nxt[..., d:]], 2)
                units, offsets = self._causal_units(first, last, q.device)
                comp = self.compress(q_ext, k_ext, v[:, :, rows], units, c, 2 * c, offsets, q_base=start, k_base=start)
                avail = (units + 2 * c)[:, None]
                ck, cv, _ = comp.entries(avail, avail)
                local.append(torch.cat([ck, cv], -1))
            pad = s // c - max(0, last - first)  # chunks no query sees (the last two of the sequence)
            if pad:
                local.append(q.new_zeros(b, hq, pad * e, 2 * d))
        entries = gather(torch.cat(local, 2), 2)
        return entries[..., :d].contiguous(), entries[..., d:].contiguous()

    def cp_attend(
        self, q: Tensor, k: Tensor, v: Tensor, *, hidden: Tensor, q_pos: Tensor, k_pos: Tensor, context: CPContext
    ) -> AttnOut:
        if context.entries is not None:
            hq = q.shape[1]
            k, v = ref.expand_kv(k, hq), ref.expand_kv(v, hq)
            ck, cv = context.entries
            plan = CausalPlan(q.shape[2], self.cfg.chunk_size, self._entries_per_chunk(), q.dtype, q0=int(q_pos[0]))
            out = parts_attention(q, k, v, ck, cv, plan, self.scale)
            b = q.shape[0]
            return AttnOut(
                out, stats=self._stats(self._causal_counts(b, hq, q_pos), q_pos) if self.collect_stats else {}
            )
        assert context.queries is not None  # cp_context gives one of the two
        q_keys = context.queries[:, :, : k.shape[2]]
        if self.impl == "reference":
            return self._reference(q, q_keys, k, v, q_pos, k_pos)
        return self._fast(q, q_keys, k, v, q_pos)

    # ---- fast: one softmax over the gathered keys --------------------------------------
    def has_fast_path(self, q: Tensor, cache: KVCache | None) -> bool:
        return True  # the gathered path is exact on every device; CUDA uses FlexAttention when available

    def fast(
        self, q: Tensor, k: Tensor, v: Tensor, *, hidden: Tensor, q_pos: Tensor, k_pos: Tensor, cache: KVCache | None
    ) -> AttnOut:
        return self._fast(q, q, k, v, q_pos)

    def _fast(
        self, q: Tensor, q_keys: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, step: DGAStep | None = None
    ) -> AttnOut:
        """``fast`` with the queries compression reads (``q_keys``, at the key positions) passed apart. ``step``:
        ``prepare_step``'s state, for a whole sequence from position 0 only."""
        hq = q.shape[1]
        k, v = ref.expand_kv(k, hq), ref.expand_kv(v, hq)
        # no cache: key row p holds position p and the last query is the last key (under CP too), so the last query
        # position comes from a shape, not a host read of q_pos (a graph break in the compiled GPU forward)
        comp, (ck, cv, avail) = self._compress_uncached(q_keys, k, v, k.shape[2] - 1, step)
        if flex_supports(q):
            out = flex.attention(
                q,
                k,
                v,
                comp.focal_pos,
                comp.members,
                ck,
                cv,
                avail,
                q_pos,
                selection=self.cfg.selection,
                chunk_size=self.cfg.chunk_size,
                entries_per_chunk=self._entries_per_chunk(),
                scale=self.scale,
                masks=None if step is None else step.masks,
            )
            return AttnOut(out, stats=self._stats(None, q_pos) if self.collect_stats else {})
        if self.impl != "gathered" and self._parts_apply(q, q_pos):
            ck, cv, plan = self._parts_inputs(comp, ck, cv, avail, q.shape[2], q.dtype)
            out = parts_attention(q, k, v, ck, cv, plan, self.scale)
            counts = self._parts_counts(comp, avail, q_pos) if self.collect_stats else None
        elif self.cfg.selection == "causal":  # the queries are the last rows of the keys (above): a span from shapes
            span = (k.shape[2] - q.shape[2], k.shape[2])
            out, counts = self._attend_window(q, q_pos, k, v, ck, cv, avail, span=span)
        else:
            out, counts = self._attend_complementary(q, q_pos, k, v, comp, ck, cv, avail)
        return AttnOut(out, stats=self._stats(counts, q_pos) if self.collect_stats else {})

    # ---- parts: the memory-linear form on the fused CPU kernel (cpu.py) ------------------
    def _parts_apply(self, q: Tensor, q_pos: Tensor) -> bool:
        """The parts form takes a whole sequence from position 0 (training, uncached prefill) in a kernel dtype
        on the CPU; other calls (and ``impl = "gathered"``, kept as a second reference) gather per query block."""
        return self._parts_kernel(q) and int(q_pos[0]) == 0 and int(q_pos[-1]) == q.shape[2] - 1

    @staticmethod
    def _parts_kernel(q: Tensor) -> bool:
        """The fused CPU kernel takes ``q``: on the CPU, in a kernel dtype, not compiling (compiled on the CPU: the
        gathered path, as before)."""
        return q.device.type == "cpu" and not torch.compiler.is_compiling() and q.dtype in KERNEL_DTYPES

    def _parts_inputs(
        self, comp: Compressed, ck: Tensor, cv: Tensor, avail: Tensor, t: int, dtype: torch.dtype
    ) -> tuple[Tensor, Tensor, Plan]:
        """The compressed key list in the order the plan reads it, and the plan."""
        if self.cfg.selection == "causal":
            return ck, cv, CausalPlan(t, self.cfg.chunk_size, self._entries_per_chunk(), dtype)
        b, h = ck.shape[:2]
        order = avail.argsort(-1)  # distinct positions: each entry visible from its own
        idx = order[..., None].expand(-1, -1, -1, ck.shape[-1])
        ck, cv, avail = ck.gather(2, idx), cv.gather(2, idx), avail.gather(-1, order)
        focal, group_last = self._sequence_flags(comp, t)
        members = comp.members.reshape(b, h, -1, self.cfg.group_size)
        plan = SequencePlan(avail, focal, group_last, members[..., 0], members[..., -1], dtype)
        return ck, cv, plan

    def _sequence_flags(self, comp: Compressed, t: int) -> tuple[Tensor, Tensor]:
        """Focal flags [B, H, T] and each non-focal token's group's last member [B, H, T] (-1 for focal tokens)."""
        b, h = comp.focal_pos.shape[:2]
        dev = comp.focal_pos.device
        focal = torch.zeros(b, h, t, dtype=torch.bool, device=dev).scatter_(-1, comp.focal_pos.reshape(b, h, -1), True)
        group_last = torch.full((b, h, t), -1, dtype=torch.long, device=dev)
        last = comp.members[..., -1:].expand_as(comp.members)
        group_last.scatter_(-1, comp.members.reshape(b, h, -1), last.reshape(b, h, -1))
        return focal, group_last

    def _parts_counts(self, comp: Compressed, avail: Tensor, q_pos: Tensor) -> Tensor:
        """Keys each query sees (statistics), from the visibility rules without a mask."""
        b, h = comp.focal_pos.shape[:2]
        p = q_pos.to(avail.device)
        if self.cfg.selection == "causal":
            return self._causal_counts(b, h, p)
        m = self.cfg.group_size
        entries = torch.searchsorted(avail.sort(-1).values, p.expand(b, h, -1).contiguous(), right=True)
        nonfocal = comp.members.reshape(b, h, -1).contiguous()
        open_members = torch.searchsorted(nonfocal, p.expand(b, h, -1).contiguous(), right=True) % m
        return entries + open_members

    def _causal_counts(self, b: int, h: int, q_pos: Tensor) -> Tensor:
        """Keys each query at ``q_pos`` sees in the causal form (statistics): its own and the previous chunk up to
        it, and the entries of the chunks before those. [B, H, Tq]."""
        c, p = self.cfg.chunk_size, q_pos
        lo = torch.clamp((p // c - 1) * c, min=0)
        seen = torch.clamp(p // c - 1, min=0) * self._entries_per_chunk()
        return (seen + p - lo + 1).expand(b, h, -1)

    def _attend(
        self, qb: Tensor, qpos_b: Tensor, ck: Tensor, cv: Tensor, avail: Tensor, lk: Tensor, lv: Tensor, lmask: Tensor
    ) -> tuple[Tensor, Tensor]:
        """Softmax over [compressed entries; local keys] for query blocks.

        qb [B, H, nb, bq, D], qpos_b [nb, bq] (-1 = padding); ck/cv [B, H, N, D], avail [B, H, N];
        lk/lv [B, H, nb, W, D], lmask broadcastable to [B, H, nb, bq, W]. Returns [B, H, nb, bq, D]
        and the number of keys each query saw.
        """
        dt = torch.promote_types(qb.dtype, torch.float32)
        qd = qb.to(dt)
        cs = torch.einsum("bhnqd,bhkd->bhnqk", qd, ck.to(dt)) * self.scale
        cmask = avail[:, :, None, None, :] <= qpos_b[None, None, :, :, None]
        ls = torch.einsum("bhnqd,bhnwd->bhnqw", qd, lk.to(dt)) * self.scale
        lmask = lmask.expand(*ls.shape)
        p = ref.masked_softmax(torch.cat([cs, ls], -1), torch.cat([cmask.expand(*cs.shape), lmask], -1))
        n = ck.shape[2]
        out = torch.einsum("bhnqk,bhkd->bhnqd", p[..., :n], cv.to(dt)) + torch.einsum(
            "bhnqw,bhnwd->bhnqd", p[..., n:], lv.to(dt)
        )
        return out.to(qb.dtype), cmask.sum(-1) + lmask.sum(-1)

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
    ) -> tuple[Tensor, Tensor]:
        """Causal form: compressed chunks <= j-2 plus the raw chunks j-1 and j (up to the query).
        k/v row p holds position p + k_base (the cache keeps raw keys from the window of its first query on).
        ``span``: the queries' positions [p0, p1) when the caller knows them from shapes; else they are read from
        ``q_pos`` (a host read: a graph break where this path is compiled, train.compile on the CPU)."""
        b, h, tq, d = q.shape
        c = self.cfg.chunk_size
        tk = k.shape[2]
        if span is None:
            p0, p1 = int(q_pos[0]), int(q_pos[-1]) + 1
        else:
            p0, p1 = span
        dev = q.device
        if tq < c:  # decode / short calls: one block, keys from the previous chunk of the first query on
            lo = max(0, (p0 // c - 1) * c)
            qb, qpos_b = q[:, :, None], q_pos.to(dev)[None]
            wpos = torch.arange(lo, p1, device=dev)[None]
            lk, lv = k[:, :, None, lo - k_base : p1 - k_base], v[:, :, None, lo - k_base : p1 - k_base]
        else:  # training / prefill: query blocks are whole chunks, each with a 2C window
            j0, j1 = p0 // c, (p1 - 1) // c
            nb = j1 - j0 + 1
            pos = torch.arange(j0 * c, (j1 + 1) * c, device=dev)
            qpos_b = torch.where((pos >= p0) & (pos < p1), pos, -1).view(nb, c)
            qb = pad_positions(q, p0, j0 * c, (j1 + 1) * c).view(b, h, nb, c, d)
            lo, hi = (j0 - 1) * c, (j1 + 1) * c
            wpos = (lo + torch.arange(hi - lo, device=dev)).unfold(0, 2 * c, c)  # [nb, 2C]
            lk = pad_positions(k, k_base, lo, hi).unfold(2, 2 * c, c).transpose(-1, -2)
            lv = pad_positions(v, k_base, lo, hi).unfold(2, 2 * c, c).transpose(-1, -2)
            wpos = torch.where((wpos >= k_base) & (wpos < k_base + tk), wpos, p1 + 1)  # padding never visible
        lmask = (wpos[:, None, :] <= qpos_b[:, :, None]) & (wpos[:, None, :] >= (qpos_b[:, :, None] // c - 1) * c)
        out, counts = self._attend(qb, qpos_b, ck, cv, avail, lk, lv, lmask)
        out, counts = out.reshape(b, h, -1, d), counts.reshape(b, h, -1)
        if tq >= c:  # the blocks' padding rows off: the queries are rows p0 - j0 C .. p1 - j0 C (a slice, no mask)
            keep = slice(p0 - j0 * c, p1 - j0 * c)
            out, counts = out[:, :, keep], counts[:, :, keep]
        return out, counts

    def _attend_complementary(
        self, q: Tensor, q_pos: Tensor, k: Tensor, v: Tensor, comp: Compressed, ck: Tensor, cv: Tensor, avail: Tensor
    ) -> tuple[Tensor, Tensor]:
        """Sequence form: focal and finished aggregates, plus the members of the query's own unfinished group
        up to it."""
        b, h, tq, d = q.shape
        m = self.cfg.group_size
        nonfocal = comp.members.reshape(b, h, -1).contiguous()  # [B, H, n_nf] ascending positions
        q_pos = q_pos.to(q.device)
        if nonfocal.shape[-1] == 0:
            lk = k.new_zeros(b, h, tq, 0, d)
            lv, lmask = lk, torch.zeros(1, 1, tq, 1, 0, dtype=torch.bool, device=q.device)
        else:
            seen = torch.searchsorted(
                nonfocal, q_pos.expand(b, h, -1).contiguous(), right=True
            )  # non-focal tokens <= query
            z = seen // m  # the query's unfinished group
            slot = (z * m)[..., None] + torch.arange(m, device=q.device)
            valid = slot < seen[..., None]
            idx = nonfocal.gather(-1, slot.clamp(max=nonfocal.shape[-1] - 1).reshape(b, h, -1)).reshape(b, h, tq, m)
            lk, lv, lmask = ref.take_rows(k, idx), ref.take_rows(v, idx), valid[:, :, :, None, :]
        out, counts = self._attend(q[:, :, :, None], q_pos[:, None], ck, cv, avail, lk, lv, lmask)
        return out.reshape(b, h, tq, d), counts.reshape(b, h, tq)

    def _stats(self, counts: Tensor | None, q_pos: Tensor) -> dict[str, Tensor]:
        if counts is None:
            return {}
        full = (q_pos.to(counts.device) + 1).to(torch.float64)
        return {"key_ratio": (counts.to(torch.float64) / full).mean().detach()}
