"""Options of ``focal`` (``[model.attention.focal]``): a constant temperature t, or a learned tau and its scope."""

from __future__ import annotations

from dataclasses import dataclass

from core.errors import ConfigError, check_choice, check_min
from model.attention.common.base import VariantConfig

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
