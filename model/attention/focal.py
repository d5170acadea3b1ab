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

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from core.errors import ConfigError, check_choice, check_min
from model.attention.common.base import CPGather, KVCache, LayerSpec, SuiteCase, VariantConfig, register_attention
from model.attention.full import FullAttention

MODES = ("constant", "learned")
SCOPES = ("query", "prefix_mean", "sequence_mean")


@dataclass
class FocalConfig(VariantConfig):
    mode: str = "constant"  # constant (a fixed temperature t) | learned (a per-query temperature)
    t: float = 0.4  # constant mode: temperature scale
    tau_min: float = 5.0  # learned mode: clip range of the divisor
    tau_max: float = 10.0  # learned mode: upper clip of the divisor
    scope: str = "query"  # learned mode: query | prefix_mean | sequence_mean (non-causal)

    def validate(self, prefix: str) -> None:
        check_choice(prefix + "mode", self.mode, MODES)
        check_choice(prefix + "scope", self.scope, SCOPES)
        check_min(prefix + "t", self.t, 0.0, strict=True)
        check_min(prefix + "tau_min", self.tau_min, 0.0, strict=True)
        if self.tau_max < self.tau_min:
            raise ConfigError(f"{prefix}tau_max: {self.tau_max} is below tau_min={self.tau_min}")


@register_attention("focal", FocalConfig)
class FocalAttention(FullAttention):
    description = "Focal temperature attention"
    supports_documents = False  # its temperature reads positions and prefix statistics across documents

    def __init__(self, cfg: FocalConfig, spec: LayerSpec):
        super().__init__(cfg, spec)
        self.w_tau = nn.Parameter(torch.zeros(spec.d_model)) if cfg.mode == "learned" else None
        self.tau_offset = min(max(math.sqrt(spec.head_dim), cfg.tau_min), cfg.tau_max)

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
        """[B, Tq] divisor of each query's logits."""
        assert self.w_tau is not None  # learned mode: the only caller
        z = hidden.to(self.w_tau.dtype) @ self.w_tau  # [B, Tq]
        if self.cfg.scope != "query":
            csum = torch.cumsum(z, dim=1)
            if cache is not None and "focal_zsum" in cache.extra:  # sum over the tokens already cached
                csum = csum + cache.extra["focal_zsum"][:, None]
            if cache is not None:
                cache.extra["focal_zsum"] = csum[:, -1].detach()
            if self.cfg.scope == "prefix_mean":
                z = csum / (q_pos + 1).to(z.dtype)
            else:  # the mean over every token of the sequence (so far, when decoding)
                z = (csum[:, -1:] / (q_pos[-1] + 1).to(z.dtype)).expand_as(z)
        return self.clipped(z)

    def clipped(self, z: Tensor) -> Tensor:
        """tau = clip(tau_offset + z, tau_min, tau_max) (eq. 6), for the whole-sequence and the CP paths."""
        return torch.clamp(self.tau_offset + z, self.cfg.tau_min, self.cfg.tau_max)

    def logit_scale(self, hidden: Tensor, q_pos: Tensor, cache: KVCache | None) -> float | Tensor:
        if self.cfg.mode == "constant":
            return 1.0 / (self.cfg.t * math.sqrt(self.spec.head_dim))
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

    def stats(self, scale: float | Tensor) -> dict[str, Tensor]:
        if isinstance(scale, Tensor):
            return {"tau": (1.0 / scale).mean().detach()}
        return {}
