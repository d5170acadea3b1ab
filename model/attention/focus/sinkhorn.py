"""Log-domain Sinkhorn normalisation of token-to-group scores (Focus, paper section 3.6).

Each iteration subtracts a logsumexp over tokens (every group gets the same mass), then a
logsumexp over groups (every token's row sums to 1).

- ``sequence`` scope is the paper's Algorithm 1: the token normaliser runs over the whole
  sequence, so token i's assignment depends on later tokens (a leak in a causal LM).
- ``prefix`` scope normalises token i's group mass over tokens <= i only (a logcumsumexp), so
  an assignment never changes once computed. ``state`` carries, per iteration, the log group mass
  of the tokens already seen, which makes chunked prefill and decoding equal the full pass.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor


def sinkhorn_sequence(scores: Tensor, iters: int) -> Tensor:
    """scores [B, T, K] -> assignments [B, T, K] (rows sum to 1, group masses equalised)."""
    log = scores
    for _ in range(iters):
        log = log - torch.logsumexp(log, dim=1, keepdim=True)
        log = log - torch.logsumexp(log, dim=-1, keepdim=True)
    return log.exp()


def sinkhorn_prefix(scores: Tensor, iters: int, state: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """scores [B, T, K] of the new tokens -> (assignments [B, T, K], state [B, iters, K]).

    ``state`` from a previous call holds the earlier tokens' log masses; None = the sequence starts here.
    """
    if scores.shape[1] == 1 and state is not None:
        return _sinkhorn_token(scores, iters, state)
    log = scores
    masses = []
    for n in range(iters):
        cum = logcumsumexp(log, dim=1)
        if state is not None:
            cum = torch.logaddexp(cum, state[:, n : n + 1])
        masses.append(cum[:, -1])
        log = log - cum
        log = log - torch.logsumexp(log, dim=-1, keepdim=True)  # log_softmax, 2x faster over a short last dim on CPU
    return log.exp(), torch.stack(masses, dim=1)


EXP_RANGE = 300.0  # |x| up to which exp(x) and the gradients through it stay well inside float64's range


def logcumsumexp(x: Tensor, dim: int) -> Tensor:
    """``torch.logcumsumexp``; on CPU for float32 and narrower, log(cumsum(exp(x))) in float64 (4x faster: the
    library's scan is not vectorised), the same to float32 rounding. Positions from the first |x| > EXP_RANGE on
    (or a non-finite x) take ``torch.logcumsumexp``, so a position's value never depends on later ones. Under
    ``torch.compile`` the library op too: that check reads a flag on the host (a graph break)."""
    if x.device.type != "cpu" or x.dtype == torch.float64 or torch.compiler.is_compiling():
        return scan_last(x, dim)
    wide = x.double()
    out = torch.log(torch.cumsum(torch.exp(wide), dim)).to(x.dtype)
    bad = ~(wide.abs() <= EXP_RANGE)
    if bool(bad.any()):
        after = torch.cummax(bad.to(torch.uint8), dim).values.bool()
        out = torch.where(after, torch.logcumsumexp(x, dim), out)
    return out


def scan_last(x: Tensor, dim: int) -> Tensor:
    """``torch.logcumsumexp(x, dim)`` computed along the last dimension. CUDA scans a non-last dimension with one
    thread per column walking every position in order (a [B, T, K] prefix over T: B x K threads, T serial steps, the
    Focus forward's cost linear in T on the first GPU run); along the last dimension each row is a parallel scan."""
    last = x.dim() - 1
    if dim % x.dim() == last:
        return torch.logcumsumexp(x, dim)
    return torch.logcumsumexp(x.movedim(dim, -1).contiguous(), -1).movedim(-1, dim)


def _sinkhorn_token(scores: Tensor, iters: int, state: Tensor) -> tuple[Tensor, Tensor]:
    """``sinkhorn_prefix`` of one new token (decoding): the cumulative mass is the earlier tokens' plus its own, and
    each iteration's [B, 1, K] mass is kept as it is and joined once at the end (a decode step is a few kernels
    around a fixed cost of small operations; per-iteration indexing and stacking were a large part of it)."""
    log = scores
    masses = []
    for earlier in state.unsqueeze(2).unbind(1):  # [B, 1, K] per iteration
        cum = torch.logaddexp(log, earlier)
        masses.append(cum)
        log = torch.log_softmax(log - cum, dim=-1)
    return log.exp(), torch.cat(masses, dim=1)


def sinkhorn_token_host(
    scores: list[float],
    state: list[list[float]],
    exp: Callable[[float], float] = math.exp,
    log: Callable[[float], float] = math.log,
    log1p: Callable[[float], float] = math.log1p,
) -> tuple[list[float], list[list[float]]] | None:
    """``_sinkhorn_token`` of one sequence's token on host floats (float64): scores [K] and that sequence's state
    [iters][K] (finite: the caller checks a state it did not get from here) -> (assignment [K], the new state
    [iters][K]). For decoding on the CPU without autograd: the same arithmetic as 34 tensor operations on
    [1, 1, K], each costing more to dispatch than its K numbers take to compute. None when a score is not finite
    (the tensor path keeps the library's inf / NaN rules)."""
    if not math.isfinite(sum(scores)):
        return None
    lg, masses = scores, []
    for earlier in state:
        # x = l - logaddexp(l, e) = -softplus(e - l), and the mass logaddexp(l, e) = l - x
        x = [-log1p(exp(e - a)) if e <= a else a - e - log1p(exp(a - e)) for a, e in zip(lg, earlier)]
        masses.append([a - y for a, y in zip(lg, x)])
        top = max(x)
        lse = top + log(sum([exp(y - top) for y in x]))
        lg = [y - lse for y in x]
    return [exp(y) for y in lg], masses


def group_imbalance(assign: Tensor) -> Tensor:
    """(largest - smallest) / mean group mass over the tokens of each sequence, averaged over the batch."""
    mass = assign.sum(dim=1)  # [B, K]
    return ((mass.max(-1).values - mass.min(-1).values) / mass.mean(-1)).mean()
