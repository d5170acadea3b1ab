"""The fast path of pre-scored HyperAttention: the plan (``plan.py``) evaluated piece by piece and block by block
(gathered kept keys, sorted-LSH blocks, sampled residual columns), merged by logsumexp. Eager on every device: the
plan is built on the host, so there is no separate GPU (FlexAttention) path."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from model.attention.common import reference as ref
from model.attention.prescored_hyper.plan import ExactPiece, HyperPiece
from model.attention.prescored_hyper.scoring import _CHUNK_ELEMS  # one memory bound for the scoring and the pieces

_EMPTY = -1e4  # logsumexp of a row with no key: exp(_EMPTY - real lse) is 0 in every float type


def _in_row_chunks(
    fn: Callable[[int, int], tuple[Tensor, Tensor]], n: int, per_row: int, dim: int = 2
) -> tuple[Tensor, Tensor]:
    """``fn(i, j)`` -> (out, lse) of rows [i, j) along ``dim``, over chunks of about ``_CHUNK_ELEMS`` score
    entries, concatenated: the scores of a long piece never exist at once (one call when it fits)."""
    step = max(1, _CHUNK_ELEMS // max(per_row, 1))
    if step >= n:
        return fn(0, n)
    parts = [fn(i, min(n, i + step)) for i in range(0, n, step)]
    return torch.cat([o for o, _ in parts], dim), torch.cat([l_ for _, l_ in parts], dim)


def attention(
    q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, pieces: list[ExactPiece | HyperPiece], scale: float, block_size: int
) -> Tensor:
    """The approximate output of queries ``q`` at ``q_pos``: every piece's (output, logsumexp), merged per query row."""
    b, hq, tq, d = q.shape
    dt = torch.promote_types(q.dtype, torch.float32)
    out = q.new_zeros(b, hq, tq, d, dtype=dt)
    lse = q.new_full((b, hq, tq), -math.inf, dtype=dt)
    if not (torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))):
        # no autograd: merge each piece into a running (out, lse) in place as it comes, holding one piece's
        # output at a time (not every piece's, nor a new [B, H, T, D] per piece)
        for piece in pieces:
            o, l_ = _piece(q, k, v, q_pos, piece, scale, block_size)
            cur = lse[:, :, piece.qs : piece.qe]
            new = torch.logaddexp(cur, l_)
            dst = out[:, :, piece.qs : piece.qe]
            dst.mul_(torch.exp(cur - new)[..., None]).add_(o * torch.exp(l_ - new)[..., None])
            cur.copy_(new)
        return out.to(q.dtype)
    outs, lses = [], []  # per piece, merged per query row below (no in-place writes: autograd)
    for piece in pieces:
        o, l_ = _piece(q, k, v, q_pos, piece, scale, block_size)
        outs.append((piece.qs, piece.qe, o))
        lses.append(l_)
    # merge: lse_i = logsumexp over pieces; out_i = sum_p o_p exp(lse_p - lse_i)
    total = lse
    for (qs, qe, _), l_ in zip(outs, lses):
        total = torch.cat([total[:, :, :qs], torch.logaddexp(total[:, :, qs:qe], l_), total[:, :, qe:]], dim=2)
    for (qs, qe, o), l_ in zip(outs, lses):
        w = torch.exp(l_ - total[:, :, qs:qe])[..., None]
        out = torch.cat([out[:, :, :qs], out[:, :, qs:qe] + o * w, out[:, :, qe:]], dim=2)
    return out.to(q.dtype)


def _piece(
    q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, piece: ExactPiece | HyperPiece, scale: float, block_size: int
) -> tuple[Tensor, Tensor]:
    """Normalised output and logsumexp of one piece's rows."""
    if isinstance(piece, HyperPiece):
        return _hyper(q, k, v, piece, scale, block_size)
    return _exact(
        q[:, :, piece.qs : piece.qe],
        k[:, :, piece.klo : piece.khi],
        v[:, :, piece.klo : piece.khi],
        q_pos[piece.qs : piece.qe],
        piece.klo,
        scale,
    )


def _softmax(s: Tensor, mask: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """Normalised output and logsumexp of masked scores. An empty row gives zeros and a very
    negative (finite) lse, so merges and their gradients never meet inf - inf."""
    if s.shape[-1] == 0:
        return s.new_zeros(*s.shape[:-1], v.shape[-1]), s.new_full(s.shape[:-1], _EMPTY)
    s = s.masked_fill(~mask, -math.inf)
    mx = s.detach().amax(-1, keepdim=True)
    mx = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))
    e = torch.exp(s - mx)
    den = e.sum(-1)
    tiny = torch.finfo(den.dtype).tiny
    lse = torch.where(den > 0, torch.log(den.clamp(min=tiny)) + mx[..., 0], torch.full_like(den, _EMPTY))
    return (e @ v) / den.clamp(min=tiny)[..., None], lse


def _exact(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, klo: int, scale: float) -> tuple[Tensor, Tensor]:
    dt = torch.promote_types(q.dtype, torch.float32)
    b, hq, tq, _ = q.shape
    ve = ref.expand_kv(v, hq).to(dt)
    kpos = torch.arange(klo, klo + k.shape[2], device=q.device)

    def rows(i: int, j: int) -> tuple[Tensor, Tensor]:
        s = ref.scores(q[:, :, i:j], k, scale)
        return _softmax(s, ref.causal_mask(q_pos[i:j].to(q.device), kpos), ve)

    return _in_row_chunks(rows, tq, b * hq * k.shape[2])


def _hyper(q: Tensor, k: Tensor, v: Tensor, piece: HyperPiece, scale: float, block_size: int) -> tuple[Tensor, Tensor]:
    b, hq, _, d = q.shape
    hkv = k.shape[1]
    rep = hq // hkv
    dt = torch.promote_types(q.dtype, torch.float32)
    nq, nb, bq = piece.qe - piece.qs, piece.nb, block_size
    qp = q[:, :, piece.qs : piece.qe].to(dt)
    # block-diagonal part: sorted queries in blocks of bq against their block of sorted keys
    qsorted = qp.gather(2, piece.qorder[..., None].expand(-1, -1, -1, d))
    qsorted = torch.nn.functional.pad(qsorted, (0, 0, 0, nb * bq - nq)).view(b, hq, nb, bq, d)
    qvalid = (torch.arange(nb * bq, device=q.device) < nq).view(nb, bq)
    width = int((piece.kstart[..., 1:] - piece.kstart[..., :-1]).max()) if nb else 0
    slot = piece.kstart[..., :-1, None] + torch.arange(width, device=q.device)  # [B, Hkv, nb, w]
    bvalid = slot < piece.kstart[..., 1:, None]
    nk = piece.kidx.shape[-1]
    sorted_slot = piece.korder.gather(-1, slot.clamp(max=max(nk - 1, 0)).reshape(b, hkv, -1))
    pos = piece.kidx.gather(-1, sorted_slot).reshape(slot.shape)
    kb = ref.take_rows(k, pos).repeat_interleave(rep, dim=1).to(dt)  # [B, H, nb, w, D]
    vb = ref.take_rows(v, pos).repeat_interleave(rep, dim=1).to(dt)
    bvalid_h = bvalid.repeat_interleave(rep, dim=1)

    def blocks(i: int, j: int) -> tuple[Tensor, Tensor]:  # LSH blocks i..j-1
        s = torch.einsum("bhnqd,bhnwd->bhnqw", qsorted[:, :, i:j], kb[:, :, i:j]) * scale
        mask = qvalid[None, None, i:j, :, None] & bvalid_h[:, :, i:j, None, :]
        return _softmax(s, mask, vb[:, :, i:j])

    ob, lb = _in_row_chunks(blocks, nb, b * hq * bq * width, dim=2)
    ob, lb = ob.reshape(b, hq, nb * bq, d)[:, :, :nq], lb.reshape(b, hq, nb * bq)[:, :, :nq]
    inv = torch.argsort(piece.qorder, dim=-1)  # back to position order
    ob, lb = ob.gather(2, inv[..., None].expand(-1, -1, -1, d)), lb.gather(2, inv)
    if piece.samples.shape[-1] == 0:
        return ob, lb
    # residual part: sampled columns outside the query's block, weighted n/s
    kidx_h = piece.kidx.repeat_interleave(rep, dim=1)
    cols = kidx_h.gather(-1, piece.samples)
    ks = ref.expand_kv(k, hq).gather(2, cols[..., None].expand(-1, -1, -1, d)).to(dt)
    vs = ref.expand_kv(v, hq).gather(2, cols[..., None].expand(-1, -1, -1, d)).to(dt)
    sblock = piece.kblock.repeat_interleave(rep, dim=1).gather(-1, piece.samples)
    log_w = piece.log_w.to(dt)[..., None, None]

    def rows(i: int, j: int) -> tuple[Tensor, Tensor]:
        rs = torch.matmul(qp[:, :, i:j], ks.transpose(-1, -2)) * scale + log_w
        rmask = piece.svalid[:, :, None, :] & (sblock[:, :, None, :] != piece.qblock[:, :, i:j, None])
        return _softmax(rs, rmask, vs)

    orr, lr = _in_row_chunks(rows, nq, b * hq * ks.shape[2])
    lse = torch.logaddexp(lb, lr)
    o = ob * torch.exp(lb - lse)[..., None] + orr * torch.exp(lr - lse)[..., None]
    return o, lse
