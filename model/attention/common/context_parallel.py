"""Context parallelism (CP) for every attention variant: the load-balanced sequence layout, the per-layer
all-gather of K and V, and the driver that runs a variant's queries at their global positions.

Layout (Llama 3's causal load balance): a sequence of T tokens is cut into 2 * cp chunks of c = T / (2 cp);
CP rank r holds chunks r and 2 cp - 1 - r, in that order, so every rank holds T / cp tokens and the same
amount of causal work. Positions and document ids stay global.

Per layer (``context_parallel_attention``): K and V (after RoPE) are all-gathered over the CP group with the
functional collective ``all_gather_single_autograd`` (its backward is ``reduce_scatter_tensor``: dK and dV
summed back onto the rank that holds the tokens; gloo and NCCL alike) and put back in global order. What a
variant needs beyond them comes from its ``cp_context`` hook (gathered the same way). Each of the rank's two
query chunks is one contiguous run of global positions [s, s + c), attended by the variant's ``cp_attend``
against the keys [0, s + c): the chunked-prefill shape every variant already computes.

Losses. Each rank's token loss is a partial sum (its own targets); a variant's aux loss is a mean over query
tokens, and a rank returns the mean over its own queries (the mean of its two chunks'), as a data-parallel rank
does over its own batch. So the engines need nothing CP-specific beyond counting the CP ranks among the ranks
gradients are averaged over (``grad_average_ranks`` = dp x cp, the LM loss normalised by the global target
count): the average of the aux gradients over the CP ranks is the whole sequence's, and the averaged token-loss
gradients times dp x cp are the global sum's.

Nothing here reads a rank on its own: the caller hands a process group (or a 1-D DeviceMesh) over.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from core.errors import ConfigError
from core.torch_compat import all_gather_single_autograd
from model.attention.common.base import Attention, AttnOut, registry


@dataclass(frozen=True)
class ContextParallel:
    """A CP group: its size and this process's rank in it (``group`` None only when ``size`` is 1)."""

    group: Any  # torch.distributed.ProcessGroup
    size: int
    rank: int

    @classmethod
    def of(cls, group_or_mesh: Any) -> ContextParallel:
        """From a process group or a 1-D ``DeviceMesh`` (its one dimension is the CP group)."""
        group = group_or_mesh.get_group() if hasattr(group_or_mesh, "get_group") else group_or_mesh
        return cls(group, dist.get_world_size(group), dist.get_rank(group))

    def chunk_ids(self) -> tuple[int, int]:
        """The two global chunks this rank holds, in local order."""
        return self.rank, 2 * self.size - 1 - self.rank

    def chunk_starts(self, local_len: int) -> tuple[int, int]:
        """Global position of the first token of each local chunk (local_len = T / cp tokens here)."""
        c = local_len // 2
        return self.chunk_ids()[0] * c, self.chunk_ids()[1] * c

    def positions(self, local_len: int, device: torch.device | str) -> Tensor:
        """[local_len] global positions of this rank's tokens."""
        c = local_len // 2
        a, b = self.chunk_starts(local_len)
        return torch.cat([torch.arange(a, a + c, device=device), torch.arange(b, b + c, device=device)])

    def shard(self, x: Tensor, dim: int = 1) -> Tensor:
        return shard_sequence(x, self.size, self.rank, dim)

    def gather(self, x: Tensor, dim: int) -> Tensor:
        """This rank's [..., T / cp, ...] -> the whole [..., T, ...] in global order, autograd-aware: the gradient
        of every rank's copy is summed back onto the rank that holds those tokens."""
        if self.size == 1:
            return x
        gathered = all_gather_single_autograd(x.contiguous(), dim, self.group)  # rank-ordered along dim
        return restore_sequence(list(gathered.chunk(self.size, dim)), dim)

    def attend(
        self,
        core: Attention,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        hidden: Tensor,
        positions: Tensor,
        documents: Tensor | None = None,
    ) -> AttnOut:
        """``core``'s attention under this layout (``context_parallel_attention``); ``Attention.forward`` calls it."""
        return context_parallel_attention(core, self, q, k, v, hidden=hidden, positions=positions, documents=documents)

    def gather_no_grad(self, x: Tensor, dim: int) -> Tensor:
        """``gather`` for tensors without a gradient (token ids, document ids)."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return restore_sequence(parts, dim)


def shard_sequence(x: Tensor, cp: int, rank: int, dim: int = 1) -> Tensor:
    """The whole sequence along ``dim`` -> rank ``rank``'s chunks ``rank`` and ``2 cp - 1 - rank``, concatenated."""
    chunks = x.chunk(2 * cp, dim)
    if len(chunks) != 2 * cp or x.shape[dim] % (2 * cp):
        raise ValueError(f"a sequence of {x.shape[dim]} tokens does not split into 2 x cp = {2 * cp} equal chunks")
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]], dim)


def restore_sequence(parts: list[Tensor], dim: int = 1) -> Tensor:
    """Every rank's local tensor, in rank order -> the whole sequence in global order (``shard_sequence``'s
    inverse)."""
    cp = len(parts)
    halves = [p.chunk(2, dim) for p in parts]
    order = [halves[j][0] if j < cp else halves[2 * cp - 1 - j][1] for j in range(2 * cp)]
    return torch.cat(order, dim)


def shard_batch(cp: ContextParallel, *tensors: Tensor) -> tuple[Tensor, ...]:
    """The training loop's call: each [B, T] tensor of a micro-batch (inputs, targets) -> this rank's [B, T / cp].
    Every CP rank of a data-parallel group passes the same whole batch. Positions and document ids need no
    sharding by the caller: the model derives them from the CP layout (``Transformer.forward``)."""
    return tuple(cp.shard(t, 1) for t in tensors)


def check_context_parallel(kind: str, variant_cfg: Any, seq_len: int, cp: int) -> None:
    """The CP layout checks of ``data.seq_len`` and the variant (``train.parallel.cp`` > 1), one ``ConfigError``
    line each: the sequence must split into 2 cp chunks, each a multiple of the variant's ``cp_chunk_multiple``,
    and the variant's configuration must have a CP form (``cp_unsupported``)."""
    if cp <= 1:
        return
    cls = registry[kind].cls
    reason = cls.cp_unsupported(variant_cfg)
    if reason:
        raise ConfigError(f"model.attention.{kind}: no context parallelism (train.parallel.cp={cp}): {reason}")
    per_chunk = cls.cp_chunk_multiple(variant_cfg)
    if seq_len % (2 * cp * per_chunk):
        rule = f"2 x train.parallel.cp = {2 * cp}"
        if per_chunk > 1:
            rule = (
                f"{2 * cp * per_chunk} (2 x train.parallel.cp = {2 * cp} chunks of a multiple of {kind}'s {per_chunk})"
            )
        raise ConfigError(f"data.seq_len: {seq_len} is not divisible by {rule}")


def context_parallel_attention(
    core: Attention,
    cp: ContextParallel,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    hidden: Tensor,
    positions: Tensor,
    documents: Tensor | None = None,
) -> AttnOut:
    """One layer's attention under CP. q/k/v/hidden hold this rank's T / cp tokens in the CP layout; positions
    [T / cp] are their global positions; documents, when masking by document, is the WHOLE sequence's [B, T]
    global document ids (the model computes them once per forward)."""
    reason = type(core).cp_unsupported(core.cfg)
    if reason:
        raise ValueError(f"attention variant {core.name!r} has no context parallelism: {reason}")
    if documents is not None and not core.supports_documents:
        raise ValueError(f"attention variant {core.name!r} has no document-aware masking")
    t_local = q.shape[2]
    if t_local % 2:
        raise ValueError(f"context parallelism: {t_local} local tokens do not make two equal chunks")
    c = t_local // 2
    k_all, v_all = cp.gather(k, 2), cp.gather(v, 2)
    context = (
        core.cp_context(q, k, v, hidden=hidden, gather=cp.gather, positions=positions) if documents is None else None
    )
    outs: list[Tensor] = []
    aux: Tensor | None = None
    stats: dict[str, Tensor] = {}
    for i, start in enumerate(cp.chunk_starts(t_local)):
        sl = slice(i * c, (i + 1) * c)
        end = start + c
        k_pos = torch.arange(end, device=q.device)
        qi, ki, vi = q[:, :, sl], k_all[:, :, :end], v_all[:, :, :end]
        if documents is not None:
            out = core.cp_document_attention(
                qi, ki, vi, q_pos=positions[sl], k_pos=k_pos, q_docs=documents[:, start:end], k_docs=documents[:, :end]
            )
        else:
            out = core.cp_attend(qi, ki, vi, hidden=hidden[:, sl], q_pos=positions[sl], k_pos=k_pos, context=context)
        outs.append(out.output)
        if out.aux_loss is not None:
            part = out.aux_loss / 2  # this rank's mean: averaged over the CP ranks, the sequence's
            aux = part if aux is None else aux + part
        for key, value in out.stats.items():  # this rank's chunks only: logged statistics, not exact over T
            stats[key] = stats.get(key, 0.0) + value / 2
    return AttnOut(torch.cat(outs, dim=2), aux_loss=aux, stats=stats)
