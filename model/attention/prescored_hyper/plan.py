"""The plan of pre-scored HyperAttention: the pieces of one weighted softmax (section 2, Algorithm 2).

Recursive halving of the queries into exact causal diagonal blocks (``ExactPiece``) and non-causal blocks against
the previous half's kept keys (``HyperPiece``: sorted-LSH blocks plus seeded residual columns weighted n/s). The
plan is discrete and carries no gradient; ``naive.log_weights`` turns it into the dense T x T log-weights and
``hyper.attention`` evaluates it block by block."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from model.attention.prescored_hyper.config import PrescoredHyperConfig


@dataclass
class ExactPiece:
    qs: int  # query rows [qs, qe)
    qe: int
    klo: int  # key positions [klo, khi), causal
    khi: int


@dataclass
class HyperPiece:
    qs: int
    qe: int
    kidx: Tensor  # [B, Hkv, K'] key positions (a slice of the kept keys), valid where kvalid
    kvalid: Tensor  # [B, Hkv, K']
    qblock: Tensor  # [B, H, nq] LSH block of each query (rows qs..qe-1)
    qorder: Tensor  # [B, H, nq] queries in (bucket rank, position) order
    kblock: Tensor  # [B, Hkv, K'] LSH block of each key, -1 where invalid
    korder: Tensor  # [B, Hkv, K'] valid keys in (bucket rank, position) order first
    kstart: Tensor  # [B, Hkv, nb + 1] where each block starts in korder
    nb: int
    samples: Tensor  # [B, H, s] residual columns (indices into K')
    svalid: Tensor  # [B, H, s]
    log_w: Tensor  # [B, H] log(n / s) of a sampled column


def make(
    q: Tensor, q_pos: Tensor, kept: Tensor, qrank: Tensor, krank: Tensor, cfg: PrescoredHyperConfig
) -> list[ExactPiece | HyperPiece]:
    """The pieces for queries ``q`` at ``q_pos`` (a cache's past first), given the kept key positions
    ``kept`` [B, Hkv, K] and the LSH bucket ranks of the queries and of all keys."""
    tq = q.shape[2]
    p0 = int(q_pos[0])
    pieces: list[ExactPiece | HyperPiece] = []
    if p0 > 0:  # a cache's past: one non-causal block for every new query
        pieces.append(hyper_piece(q, 0, tq, 0, p0, kept, qrank, krank, cfg))

    def halve(qs: int, qe: int) -> None:
        if qe - qs <= cfg.min_seq_len:
            pieces.append(ExactPiece(qs, qe, p0 + qs, p0 + qe))
            return
        mid = (qs + qe) // 2
        halve(qs, mid)
        pieces.append(hyper_piece(q, mid, qe, p0 + qs, p0 + mid, kept, qrank, krank, cfg))
        halve(mid, qe)

    halve(0, tq)
    return pieces


def hyper_piece(
    q: Tensor, qs: int, qe: int, lo: int, hi: int, kept: Tensor, qrank: Tensor, krank: Tensor, cfg: PrescoredHyperConfig
) -> HyperPiece:
    """Queries qs..qe-1 against the kept keys at positions [lo, hi), all of them before every query."""
    b, hq = q.shape[:2]
    rep = hq // kept.shape[1]
    dev = q.device
    start = torch.searchsorted(kept, torch.full(kept.shape[:2] + (1,), lo, device=dev)).min()
    end = torch.searchsorted(kept, torch.full(kept.shape[:2] + (1,), hi, device=dev)).max()
    kidx = kept[..., start:end]
    kvalid = (kidx >= lo) & (kidx < hi)
    nv = kvalid.sum(-1)  # [B, Hkv]
    nk = kidx.shape[-1]
    nq = qe - qs
    nb = -(-nq // cfg.block_size)
    qorder = torch.argsort(qrank[:, :, qs:qe], dim=-1, stable=True)
    qblock = torch.empty_like(qorder).scatter_(
        -1, qorder, (torch.arange(nq, device=dev) // cfg.block_size).expand(b, hq, nq)
    )
    big = torch.iinfo(torch.long).max
    korder = torch.argsort(torch.where(kvalid, krank.gather(-1, kidx), big), dim=-1, stable=True)
    kslot = torch.empty_like(korder).scatter_(-1, korder, torch.arange(nk, device=dev).expand_as(korder))
    kblock = torch.where(kvalid, kslot * nb // nv.clamp(min=1)[..., None], -1)  # equal-count blocks
    kstart = -(-(torch.arange(nb + 1, device=dev) * nv[..., None]) // nb)  # first slot of each block
    # residual columns: uniform over the valid kept keys, per query head, from a seeded generator
    s = min(cfg.sample_size, nk)
    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + qs * 7919 + lo)
    prio = torch.rand(b, hq, nk, generator=g, dtype=torch.float64).to(dev)
    valid_h = kvalid.repeat_interleave(rep, dim=1)
    samples = torch.where(valid_h, prio, -1.0).topk(s, dim=-1).indices
    svalid = valid_h.gather(-1, samples)
    nv_h = nv.repeat_interleave(rep, dim=1).to(torch.float64)
    s_eff = nv_h.clamp(max=cfg.sample_size).clamp(min=1)
    return HyperPiece(
        qs,
        qe,
        kidx,
        kvalid,
        qblock,
        qorder,
        kblock,
        korder,
        kstart,
        nb,
        samples,
        svalid,
        torch.log(nv_h.clamp(min=1) / s_eff),
    )
