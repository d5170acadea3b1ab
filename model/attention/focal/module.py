"""Focal attention (papers/focal-attention-temperature.txt, section 2): a sharper softmax.

- ``constant``: logits scaled by 1 / (t * sqrt(d_h)), t = 0.4; through SDPA's ``scale``, no extra cost.
- ``learned``: tau = clip(sqrt_offset + x . w_tau, tau_min, tau_max) replaces sqrt(d_h) as the full
  divisor; w_tau (one vector per layer) starts at zero and the offset is clip(sqrt(d_h)), so training
  starts from standard attention. Where x . w_tau is reduced:
  * ``query`` (default): per query token, causal;
  * ``prefix_mean``: mean over tokens <= i, causal;
  * ``sequence_mean``: the paper's eq. 6, a mean over the whole sequence. It lets later tokens change
    earlier outputs, so it is kept only as a named option (the test suite shows the leak).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from model.attention.common.base import CPGather, KVCache, LayerSpec, SuiteCase
from model.attention.focal import naive
from model.attention.focal.config import FocalConfig
from model.attention.full.module import FullAttention


class FocalAttention(FullAttention):
    description = "Focal temperature attention"
    supports_documents = False  # its temperature reads positions and prefix statistics across documents

    def __init__(self, cfg: FocalConfig, spec: LayerSpec):
        super().__init__(cfg, spec)
        self.w_tau = nn.Parameter(torch.zeros(spec.d_model)) if cfg.mode == "learned" else None
        self.tau_offset = naive.tau_offset(spec.head_dim, cfg.tau_min, cfg.tau_max)

    @classmethod
    def suite_cases(cls) -> list[SuiteCase]:
        return [
            SuiteCase("constant"),
            SuiteCase("learned-query", {"mode": "learned"}),
            SuiteCase("learned-prefix", {"mode": "learned", "scope": "prefix_mean"}),
            SuiteCase("learned-sequence", {"mode": "learned", "scope": "sequence_mean"}, causal=False),
        ]

    def reset_parameters(self) -> None:
        if self.w_tau is not None:
            nn.init.zeros_(self.w_tau)

    def tau(self, hidden: Tensor, q_pos: Tensor, cache: KVCache | None) -> Tensor:
        """[B, Tq] divisor of each query's logits (``naive.learned_tau``); a KV cache keeps the running sum of
        x . w_tau that the prefix and sequence means continue from."""
        assert self.w_tau is not None  # learned mode: the only caller
        prior = cache.extra.get("focal_zsum") if cache is not None else None
        tau, total = naive.learned_tau(
            hidden,
            self.w_tau,
            q_pos,
            scope=self.cfg.scope,
            offset=self.tau_offset,
            tau_min=self.cfg.tau_min,
            tau_max=self.cfg.tau_max,
            prior_sum=prior,
        )
        if cache is not None and total is not None:
            cache.extra["focal_zsum"] = total.detach()
        return tau

    def clipped(self, z: Tensor) -> Tensor:
        """tau = clip(tau_offset + z, tau_min, tau_max) (eq. 6), for the whole-sequence and the CP paths."""
        return naive.clipped_tau(z, self.tau_offset, self.cfg.tau_min, self.cfg.tau_max)

    def logit_scale(self, hidden: Tensor, q_pos: Tensor, cache: KVCache | None) -> float | Tensor:
        if self.cfg.mode == "constant":
            return naive.constant_scale(self.cfg.t, self.spec.head_dim)
        return (1.0 / self.tau(hidden, q_pos, cache))[:, None, :, None]

    # Under context parallelism the prefix and sequence means read every earlier token's x . w_tau: one scalar per
    # token is gathered (cp_context); the per-query scope and the constant mode need nothing beyond K and V.
    def cp_context(
        self, q: Tensor, k: Tensor, v: Tensor, *, hidden: Tensor, gather: CPGather, positions: Tensor
    ) -> Any:
        if self.w_tau is None or self.cfg.scope == "query":
            return None
        return gather(hidden.to(self.w_tau.dtype) @ self.w_tau, 1)  # [B, T] z of every token, global order

    def cp_logit_scale(self, hidden: Tensor, q_pos: Tensor, context: Any) -> float | Tensor:
        if context is None:
            return self.logit_scale(hidden, q_pos, None)
        csum = torch.cumsum(context, dim=1)
        if self.cfg.scope == "prefix_mean":
            z = csum[:, q_pos] / (q_pos + 1).to(csum.dtype)
        else:
            z = (csum[:, -1:] / csum.shape[1]).expand(-1, q_pos.numel())
        tau = self.clipped(z)
        return (1.0 / tau)[:, None, :, None]

    def reference_weights(self, q: Tensor, k: Tensor, scale: float | Tensor, *, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """The temperature-scaled dense weights (``naive.weights``)."""
        return naive.weights(q, k, q_pos, k_pos, scale)

    def stats(self, scale: float | Tensor) -> dict[str, Tensor]:
        if isinstance(scale, Tensor):
            return {"tau": (1.0 / scale).mean().detach()}
        return {}
