"""Lazy attention's options: the distance-bias table, its initialisation, and Elastic-Softmax's offset tau."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from core.errors import check_choice, check_min
from model.attention.common.base import VariantConfig

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
