"""Dynamic Group Attention's config and its focal count (section 5.1)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from core.errors import ConfigError, check_choice, check_min, check_range
from model.attention.common.base import VariantConfig

SELECTIONS = ("causal", "sequence")


@dataclass
class DGAConfig(VariantConfig):
    selection: str = "causal"  # causal (training) | sequence (the paper's form: prefill only, leaks the future)
    gamma: float = 0.1  # focal share per selection unit (a chunk, or the whole sequence)
    min_focal: int = 1  # at least this many focal tokens per unit (the paper uses max(gamma L, 1k))
    group_size: int = 16  # m
    sample_recent: int = 16  # importance queries: the most recent ones of the unit ...
    sample_random: int = 16  # ... plus this many random others (fixed seed: decisions are reproducible)
    chunk_size: int = 128  # C, causal form only
    decode_fold: float = 1.1  # sequence-form decode folds a group every m' = ceil(decode_fold * m) tokens
    seed: int = 0  # seed of the random importance queries

    def validate(self, prefix: str) -> None:
        key = prefix
        check_choice(key + "selection", self.selection, SELECTIONS)
        check_range(key + "gamma", self.gamma, 0.0, 1.0, open_low=True)
        check_min(key + "min_focal", self.min_focal, 0)
        check_min(key + "group_size", self.group_size, 1)
        check_min(key + "sample_recent", self.sample_recent, 1, note=" (the last query must be sampled)")
        check_min(key + "sample_random", self.sample_random, 0)
        check_min(key + "chunk_size", self.chunk_size, 1)
        if self.chunk_size < self.group_size:
            raise ConfigError(
                f"{key}chunk_size: must be >= group_size={self.group_size} (a group lives inside one chunk), "
                f"got {self.chunk_size}"
            )
        check_min(key + "decode_fold", self.decode_fold, 1.0)


def focal_count(n: int, gamma: float, min_focal: int, m: int) -> int:
    """Focal tokens among ``n``: top gamma share, at least ``min_focal``, and the non-divisible
    remainder of the non-focal tokens also made focal (section 5.1) so every group has m members."""
    r = min(n, max(math.ceil(round(gamma * n, 9)), min_focal))
    return r + (n - r) % m
