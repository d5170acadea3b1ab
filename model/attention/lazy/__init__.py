"""Lazy attention (papers/lazy-attention-elastic-softmax.md, section 4): positional
discrimination plus Elastic-Softmax.

- Logits ``q_i . k_j / sqrt(d_h) - b_h[i - j]``: RoPE (set a large ``model.rope.theta``, e.g.
  500000, as the paper does) plus a learnable per-head bias over distances 0..max_distance-1;
  longer distances use the table's last entry, so contexts past the table still work.
- Elastic-Softmax ``a_ij = relu(softmax_j(s_ij) - tau_h / n_i)`` with ``n_i`` the number of keys
  query i attends (i + 1 at 0-based position i) and a learnable per-head ``tau_h`` (init 1).
  With tau > 0 rows sum to at most 1 and weak weights become exactly 0; a negative tau (the paper
  reports learned negative offsets) adds |tau|/n to every visible weight (rows sum to 1 + |tau|).

Fast path (appendix F), two FlexAttention passes over the same causal block mask:
pass 1 gives each row's logsumexp ``lse`` of the biased scores, so ``p = exp(s - lse)``; pass 2
uses the score ``log(relu(p - tau/n))`` (-inf where ``p <= tau/n``), so its softmax numerators
are exactly the Elastic-Softmax weights and its logsumexp ``lse2`` is the log of their row sum;
the output is ``out2 * exp(lse2)`` = sum_j relu(p_ij - tau/n_i) v_j, for every sign of tau (a
negative tau lifts every visible weight by |tau|/n, so nothing is -inf). Gradients reach q, k, the
bias table and tau through both passes (pass 1's ``lse`` is a captured tensor of pass 2). The
causal block mask is built once per (query, key) length and shared by every layer; a single
query (decode) needs none. It runs where FlexAttention is compiled (CUDA), compiled once for
dynamic lengths (``compiled_two_pass``); tests run this composition on CPU through eager FlexAttention
for values and gradients.

CPU fast path (``cpu``): the same two passes over block diagonals of the score matrix with a
recomputing backward (a ``torch.autograd.Function``), exact, memory linear in T; from ``MIN_ROWS``
queries (training, prefill, chunked prefill); decode and shorter chunks take the reference, which is
O(Tq * Tk) there. Sink ratio and density come from its weights (a row sum per block, on logging steps).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from core.errors import check_choice, check_min
from model.attention.common import reference as ref
from model.attention.common.base import Attention, AttnOut, KVCache, LayerSpec, VariantConfig, register_attention
from model.attention.common.flex import flex_supports
from model.attention.lazy.cpu import MIN_ROWS, elastic_blockwise, kernel_dtypes

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

BIAS_INITS = ("zeros", "alibi")


@dataclass
class LazyConfig(VariantConfig):
    max_distance: int = 0  # bias table length; 0 = model.max_seq_len
    bias_init: str = "zeros"  # zeros | alibi (head slopes 2^(-8h/H), as ALiBi)
    tau_init: float = 1.0  # Elastic-Softmax offset tau per head at init

    def validate(self, prefix: str) -> None:
        check_min(prefix + "max_distance", self.max_distance, 0, note=" (0 = model.max_seq_len)")
        check_choice(prefix + "bias_init", self.bias_init, BIAS_INITS)


def alibi_slopes(n_heads: int) -> Tensor:
    return torch.tensor([2.0 ** (-8.0 * (h + 1) / n_heads) for h in range(n_heads)])


@register_attention("lazy", LazyConfig)
class LazyAttention(Attention):
    description = "Lazy attention: distance bias + Elastic-Softmax; a large RoPE base, as the paper trains with"

    @classmethod
    def launch_overrides(cls, family: str) -> dict[str, Any]:
        return {"model.rope.theta": 500000.0} if family == "llama" else {}

    no_weight_decay = ("distance_bias", "tau")

    def __init__(self, cfg: LazyConfig, spec: LayerSpec):
        super().__init__(cfg, spec)
        self.table = cfg.max_distance or spec.max_seq_len
        self.distance_bias = nn.Parameter(torch.zeros(spec.n_heads, self.table))
        self.tau = nn.Parameter(torch.full((spec.n_heads,), float(cfg.tau_init)))
        self.reset_parameters()

    def head_sharded_parameters(self) -> dict[str, int]:
        return {"distance_bias": 0, "tau": 0}  # one row per head: split with the heads under tensor parallelism

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.tau.fill_(float(self.cfg.tau_init))
            if self.cfg.bias_init == "alibi":
                distances = torch.arange(self.table, dtype=torch.float32, device=self.distance_bias.device)
                self.distance_bias.copy_(alibi_slopes(self.spec.n_heads).to(distances.device)[:, None] * distances)
            else:
                self.distance_bias.zero_()

    def bias(self, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """[H, Tq, Tk] bias for each query/key distance, clamped to the table."""
        distance = (q_pos[:, None] - k_pos[None, :]).clamp(0, self.table - 1)
        return self.distance_bias[:, distance]

    def weights(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """Elastic-Softmax weights [B, H, Tq, Tk], dense."""
        mask = ref.causal_mask(q_pos, k_pos)
        s = ref.scores(q, k, 1.0 / math.sqrt(self.spec.head_dim)) - self.bias(q_pos, k_pos).to(
            torch.promote_types(q.dtype, torch.float32)
        )
        p = ref.masked_softmax(s, mask)
        n = (q_pos + 1).to(p.dtype)  # keys attended by each query
        a = torch.relu(p - self.tau.to(p.dtype)[None, :, None, None] / n[None, None, :, None])
        return a.masked_fill(~mask, 0.0)  # a negative tau must not open the future

    def reference(
        self, q: Tensor, k: Tensor, v: Tensor, *, hidden: Tensor, q_pos: Tensor, k_pos: Tensor, cache: KVCache | None
    ) -> AttnOut:
        a = self.weights(q, k, q_pos, k_pos)
        stats: dict[str, Tensor] = {}
        if self.collect_stats:
            stats = {**ref.sink_and_density(a, k_pos), "tau": self.tau.mean().detach()}
        return AttnOut(ref.weighted_values(a, v, q.dtype), stats=stats)

    def has_fast_path(self, q: Tensor, cache: KVCache | None) -> bool:
        return flex_supports(q) or self.blockwise_supports(q)

    @staticmethod
    def blockwise_supports(q: Tensor) -> bool:
        """CPU, from MIN_ROWS queries (decode and short chunks take the reference: O(Tq * Tk) is small there)."""
        # not while torch.compile traces (compile on CPU: the dense reference, as before the blockwise path)
        cpu = q.device.type == "cpu" and not torch.compiler.is_compiling()
        return cpu and q.dtype in kernel_dtypes() and q.shape[2] >= MIN_ROWS

    def fast(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        hidden: Tensor | None,
        q_pos: Tensor,
        k_pos: Tensor,
        cache: KVCache | None,
    ) -> AttnOut:
        """Queries are at positions ``Tk - Tq .. Tk - 1`` and keys at ``0 .. Tk - 1``, which is what the base
        class passes (training, prefill, decode): blockwise on CPU, else two FlexAttention passes."""
        if flex_supports(q):  # first: gpu_paths_forced() traces the GPU path on CPU tensors
            return self.flex(q, k, v, hidden=hidden, q_pos=q_pos, k_pos=k_pos, cache=cache)
        return self.blockwise(q, k, v, hidden=hidden, q_pos=q_pos, k_pos=k_pos, cache=cache)

    def blockwise(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        hidden: Tensor | None,
        q_pos: Tensor,
        k_pos: Tensor,
        cache: KVCache | None,
    ) -> AttnOut:
        """Exact two-pass Elastic-Softmax over block diagonals, memory linear in T (``cpu.py``)."""
        stats: dict[str, Tensor] | None = {} if self.collect_stats else None
        out = elastic_blockwise(q, k, v, self.distance_bias, self.tau, 1.0 / math.sqrt(self.spec.head_dim), stats=stats)
        if stats is not None:
            stats = {name: value.detach() for name, value in stats.items()} | {"tau": self.tau.mean().detach()}
        return AttnOut(out, stats=stats or {})

    def flex(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        hidden: Tensor | None,
        q_pos: Tensor,
        k_pos: Tensor,
        cache: KVCache | None,
    ) -> AttnOut:
        """Two FlexAttention passes (module docstring)."""
        two_pass = compiled_two_pass() if q.is_cuda else elastic_two_pass
        out = two_pass(
            q,
            k,
            v,
            self.distance_bias,
            self.tau,
            q_pos.to(q.device),
            causal_block_mask(q.shape[2], k.shape[2], q.device),
            1.0 / math.sqrt(self.spec.head_dim),
            self.table - 1,
        )
        # sink ratio and density need the dense weights: the reference path and eval.run attention_stats give them
        stats = {"tau": self.tau.mean().detach()} if self.collect_stats else {}
        return AttnOut(out, stats=stats)


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


_BLOCK_MASKS: dict[tuple[int, int, str], BlockMask] = {}
BLOCK_MASKS_KEPT = 8  # distinct (query, key) lengths kept; the oldest is dropped first


def causal_block_mask(tq: int, tk: int, device: torch.device | str) -> BlockMask | None:
    """FlexAttention block mask for queries at positions ``tk - tq .. tk - 1`` over keys ``0 .. tk - 1``,
    cached per shape and shared by every layer and module; None for one query (it sees every key)."""
    if tq == 1:
        return None
    from torch.nn.attention.flex_attention import create_block_mask

    key = (tq, tk, str(device))
    if torch.compiler.is_compiling():  # traced whole: a dict keyed by the lengths would specialise them (recompiles)
        return create_block_mask(lambda b, h, qi, kv: kv <= qi + (tk - tq), None, None, tq, tk, device=device)
    mask = _BLOCK_MASKS.pop(key, None)
    if mask is None:
        offset = torch.tensor(tk - tq, device=device)  # a tensor, so a compiled flex does not specialise on it

        def causal(b: Tensor, h: Tensor, qi: Tensor, kv: Tensor) -> Tensor:
            return kv <= qi + offset

        mask = create_block_mask(causal, None, None, tq, tk, device=device)
        while len(_BLOCK_MASKS) >= BLOCK_MASKS_KEPT:
            _BLOCK_MASKS.pop(next(iter(_BLOCK_MASKS)))
    _BLOCK_MASKS[key] = mask  # most recently used last
    return mask
