"""Lazy attention's fast path where FlexAttention is compiled (CUDA): two FlexAttention passes (appendix F) over
the same causal block mask.

Pass 1 gives each row's logsumexp ``lse`` of the biased scores, so ``p = exp(s - lse)``; pass 2
uses the score ``log(relu(p - tau/n))`` (-inf where ``p <= tau/n``), so its softmax numerators
are exactly the Elastic-Softmax weights and its logsumexp ``lse2`` is the log of their row sum;
the output is ``out2 * exp(lse2)`` = sum_j relu(p_ij - tau/n_i) v_j, for every sign of tau (a
negative tau lifts every visible weight by |tau|/n, so nothing is -inf). Gradients reach q, k, the
bias table and tau through both passes (pass 1's ``lse`` is a captured tensor of pass 2). The
causal block mask is built once per (query, key) length and shared by every layer; a single
query (decode) needs none. It runs where FlexAttention is compiled (CUDA), compiled once for
dynamic lengths (``compiled_two_pass``); tests run this composition on CPU through eager FlexAttention
for values and gradients.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from model.attention.common.flex import causal_block_mask as shared_causal_block_mask

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask


def elastic_flex(
    q: Tensor, k: Tensor, v: Tensor, bias: Tensor, tau: Tensor, q_pos: Tensor, scale: float, last: int
) -> Tensor:
    """The module's FlexAttention path: ``elastic_two_pass`` compiled on CUDA (``compiled_two_pass``), eager elsewhere
    (tests: CPU, eager FlexAttention), over the cached causal block mask of these lengths."""
    two_pass = compiled_two_pass() if q.is_cuda else elastic_two_pass
    return two_pass(
        q, k, v, bias, tau, q_pos.to(q.device), causal_block_mask(q.shape[2], k.shape[2], q.device), scale, last
    )


def elastic_two_pass(
    q: Tensor, k: Tensor, v: Tensor, bias: Tensor, tau: Tensor, q_pos: Tensor, block_mask: BlockMask | None,
    scale: float, last: int,
) -> Tensor:  # fmt: skip
    """sum_j relu(softmax_j(s_ij) - tau_h / (q_pos_i + 1)) v_j with s = q.k * scale - bias[h, clamp(i - j, 0, last)],
    as two FlexAttention calls (module docstring); keys at positions 0 .. Tk - 1, ``block_mask`` causal."""
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention

    def biased(score: Tensor, b: Tensor, h: Tensor, qi: Tensor, kv: Tensor) -> Tensor:
        return score - bias[h, (q_pos[qi] - kv).clamp(0, last)].to(score.dtype)

    kwargs: dict[str, Any] = dict(
        block_mask=block_mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1], return_aux=AuxRequest(lse=True)
    )
    out1, aux1 = flex_attention(q, k, v, score_mod=biased, **kwargs)
    lse = aux1.lse

    def elastic(score: Tensor, b: Tensor, h: Tensor, qi: Tensor, kv: Tensor) -> Tensor:
        # s <= lse on every visible key, so the bound never changes a weight; it keeps future keys
        # (masked out after this mod) finite, so that their zero gradient stays zero
        p = torch.exp(torch.clamp(biased(score, b, h, qi, kv) - lse[b, h, qi].to(score.dtype), max=1.0))
        # the first query sees one key: p = 1 exactly, not lse's rounding of it (at tau = 1, the paper's
        # init, that weight sits exactly on the threshold, and the reference's zero gradient needs p = 1)
        p = torch.where(q_pos[qi] == 0, 1.0, p)
        d = p - tau[h].to(score.dtype) / (q_pos[qi] + 1).to(score.dtype)
        keep = d > 0
        return torch.where(keep, torch.log(torch.where(keep, d, 1.0)), float("-inf"))

    out2, aux = flex_attention(q, k, v, score_mod=elastic, **kwargs)
    # out2 = sum_j relu(p_ij - tau/n_i) v_j / sum_j relu(...) and lse2 = log sum_j relu(...); a row with
    # nothing above the threshold has lse2 = -inf (weight 0) and a zero (or NaN) out2
    weight = torch.exp(aux.lse)[..., None]
    out = torch.where(weight > 0, out2, 0.0) * weight.to(out2.dtype)
    # + 0 x the first pass's output: inductor's FlexAttention backward (torch 2.11, CUDA) fails on a call whose
    # output has no gradient, and only its logsumexp is used
    return (out + 0.0 * out1).to(q.dtype)


_COMPILED: Callable[..., Tensor] | None = None
# lengths are symbolic: decode and variable-length evaluation do not recompile
COMPILE_OPTIONS: dict[str, Any] = dict(dynamic=True)


def compiled_two_pass() -> Callable[..., Tensor]:
    """``elastic_two_pass`` compiled (the fused FlexAttention kernels). A compiled frame of its own, so its few graphs
    (decode without a block mask, one or many query / key blocks, with and without grad) do not share dynamo's
    per-function recompile budget (8) with other FlexAttention users; past it dynamo runs a function eagerly."""
    global _COMPILED
    if _COMPILED is None:
        _COMPILED = torch.compile(elastic_two_pass, **COMPILE_OPTIONS)
    return _COMPILED


def causal_block_mask(tq: int, tk: int, device: torch.device | str) -> BlockMask | None:
    """FlexAttention block mask for queries at positions ``tk - tq .. tk - 1`` over keys ``0 .. tk - 1``: the shared
    one built from block arithmetic (``common.flex.causal_block_mask``, cached per shape, shared by every layer and
    module; traceable inside a compiled, activation-checkpointed block, where ``create_block_mask`` is not); None for
    one query (it sees every key)."""
    if tq == 1:
        return None
    return shared_causal_block_mask(tq, tk, device)
