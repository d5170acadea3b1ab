"""The dense reference of pre-scored HyperAttention, as plain functions of tensors.

The approximation is one weighted softmax: query i's output is ``sum_j w_ij e^{s_ij} v_j / sum_j w_ij e^{s_ij}``
with ``w_ij`` in {0, 1, n/s} fixed by the plan (``plan.py``). ``log_weights`` materialises the plan as T x T
log-weights and ``attention`` is that softmax; ``cluster_scores_dense`` is the dense reference of the k-means /
k-median scoring (``scoring.cluster_scores``)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from model.attention.common import reference as ref
from model.attention.prescored_hyper.plan import ExactPiece, HyperPiece


def cluster_scores_dense(keys: Tensor, n_clusters: int, iters: int, *, median: bool = False) -> Tensor:
    """Reference of ``cluster_scores``: [N, T, n, D] differences, one-hot centroid updates, masked ``nanmedian``."""
    b, h, t, d = keys.shape
    x = torch.nn.functional.normalize(keys.reshape(b * h, t, d).to(torch.float64), dim=-1)
    n = min(n_clusters, t)
    centers = [x[:, 0]]
    first = (x - x[:, :1]).square().sum(-1)
    for _ in range(1, n):
        nxt = x.gather(1, first.argmax(-1)[:, None, None].expand(-1, 1, d))[:, 0]
        centers.append(nxt)
        first = torch.minimum(first, (x - nxt[:, None]).square().sum(-1))
    c0 = torch.stack(centers, 1)

    def distances(c: Tensor) -> Tensor:  # [N, T, n]
        diff = x[:, :, None, :] - c[:, None, :, :]
        return diff.abs().sum(-1) if median else diff.square().sum(-1)

    for _ in range(iters):
        assign = distances(c0).argmin(-1)  # [N, T]
        onehot = torch.nn.functional.one_hot(assign, n).to(x.dtype)  # [N, T, n]
        count = onehot.sum(1)  # [N, n]
        if median:
            member = onehot.transpose(1, 2)[..., None] > 0  # [N, n, T, 1]
            vals = torch.where(member, x[:, None], torch.nan)
            new = vals.nanmedian(dim=2).values
        else:
            new = onehot.transpose(1, 2) @ x / count.clamp(min=1)[..., None]
        c0 = torch.where(count[..., None] > 0, new, c0)
    return -distances(c0).min(-1).values.reshape(b, h, t)


# ---- the plan as one dense weighted softmax -----------------------------------------------------
def log_weights(
    pieces: list[ExactPiece | HyperPiece],
    b: int,
    hq: int,
    tq: int,
    tk: int,
    q_pos: Tensor,
    device: torch.device,
) -> Tensor:
    """[B, H, Tq, Tk]: log w_ij (0 for weight 1, log(n/s) for a sampled column, -inf for none)."""
    lw = torch.full((b, hq, tq, tk), -math.inf, dtype=torch.float64, device=device)
    for piece in pieces:
        rows = slice(piece.qs, piece.qe)
        if isinstance(piece, ExactPiece):
            keys = torch.arange(piece.klo, piece.khi, device=device)
            lw[:, :, rows, piece.klo : piece.khi] = torch.where(
                ref.causal_mask(q_pos[rows].to(device), keys), 0.0, -math.inf
            )
            continue
        rep = hq // piece.kidx.shape[1]
        kblock = piece.kblock.repeat_interleave(rep, dim=1)
        in_block = (piece.qblock[..., :, None] == kblock[..., None, :]) & (kblock[..., None, :] >= 0)
        sampled = torch.zeros_like(kblock, dtype=torch.bool).scatter_(-1, piece.samples, piece.svalid)
        part = torch.where(in_block, 0.0, torch.where(sampled[..., None, :], piece.log_w[..., None, None], -math.inf))
        full = torch.full((b, hq, piece.qe - piece.qs, tk), -math.inf, dtype=torch.float64, device=device)
        idx = piece.kidx.repeat_interleave(rep, dim=1)[..., None, :].expand_as(part)
        full.scatter_reduce_(-1, idx, part, reduce="amax")  # padded slots hold -inf: no effect
        lw[:, :, rows] = torch.maximum(lw[:, :, rows], full)
    return lw


def attention(q: Tensor, k: Tensor, v: Tensor, lw: Tensor, scale: float) -> Tensor:
    """The weighted softmax over the keys with finite log-weights ``lw`` [B, H, Tq, Tk] (``log_weights``)."""
    s = ref.scores(q, k, scale)
    p = ref.masked_softmax(s + lw.to(s.dtype), torch.isfinite(lw))
    return ref.weighted_values(p, v, q.dtype)
