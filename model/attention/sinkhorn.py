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
    if scores.shape[1] == 1 and state is not None:  # decoding: the same operations on [B, K], fewer of them
        return _sinkhorn_prefix_step(scores, iters, state)
    log = scores
    masses = []
    single = scores.shape[1] == 1  # one token: the cumulative sum over it is the token
    for n in range(iters):
        cum = log if single else torch.logcumsumexp(log, dim=1)
        if state is not None:
            cum = torch.logaddexp(cum, state[:, n, None, :])
        masses.append(cum[:, -1])
        log = torch.log_softmax(log - cum, dim=-1)
    return log.exp(), torch.stack(masses, dim=1)


def _sinkhorn_prefix_step(scores: Tensor, iters: int, state: Tensor) -> tuple[Tensor, Tensor]:
    """``sinkhorn_prefix`` for one new token after ``state``: the same logaddexp / log_softmax on the same values
    (so the same result), without the per-iteration indexing that dominates a decode step's cost."""
    earlier = state.unbind(1)  # per iteration: the log group mass of the tokens already seen, [B, K]
    log = scores[:, 0]
    masses = []
    for n in range(iters):
        cum = torch.logaddexp(log, earlier[n])
        masses.append(cum)
        log = torch.log_softmax(log - cum, dim=-1)
    return log.exp()[:, None], torch.stack(masses, dim=1)


def group_imbalance(assign: Tensor) -> Tensor:
    """(largest - smallest) / mean group mass over the tokens of each sequence, averaged over the batch."""
    mass = assign.sum(dim=1)  # [B, K]
    return ((mass.max(-1).values - mass.min(-1).values) / mass.mean(-1)).mean()
