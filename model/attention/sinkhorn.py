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
    log = scores
    masses = []
    single = scores.shape[1] == 1  # decoding: the cumulative sum over one token is the token
    # the earlier tokens' log mass per iteration, indexed once ([B, 1, K] each): per-iteration indexing was most of
    # a decode step's cost
    earlier = state.unsqueeze(2).unbind(1) if state is not None else None
    for n in range(iters):
        cum = log if single else torch.logcumsumexp(log, dim=1)
        if earlier is not None:
            cum = torch.logaddexp(cum, earlier[n])
        masses.append(cum[:, -1])
        log = torch.log_softmax(log - cum, dim=-1)
    return log.exp(), torch.stack(masses, dim=1)


def group_imbalance(assign: Tensor) -> Tensor:
    """(largest - smallest) / mean group mass over the tokens of each sequence, averaged over the batch."""
    mass = assign.sum(dim=1)  # [B, K]
    return ((mass.max(-1).values - mass.min(-1).values) / mass.mean(-1)).mean()
