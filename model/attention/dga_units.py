"""Dynamic Group Attention's pieces shared by its forward and its cache: the config, focal counts,
importance sampling offsets and the compressed (focal + aggregated) key set."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from core.errors import ConfigError, check_choice, check_min, check_range
from model.attention.base import VariantConfig

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


def sample_offsets(span: int, n_recent: int, n_random: int, seed: int) -> Tensor:
    """Sorted offsets in [0, span): the last ``n_recent`` plus ``n_random`` others drawn with a fixed seed (eq. 17)."""
    n_recent = min(n_recent, span)
    recent = torch.arange(span - n_recent, span)
    rest = span - n_recent
    if n_random <= 0 or rest <= 0:
        return recent
    g = torch.Generator().manual_seed(seed)
    others = torch.randperm(rest, generator=g)[: min(n_random, rest)]
    return torch.cat([others.sort().values, recent])


@dataclass
class Compressed:
    """Compression of U equal units of n tokens (chunks, or the whole sequence), per (batch, query head)."""

    focal_pos: Tensor  # [B, H, U, r] absolute positions, ascending
    members: Tensor  # [B, H, U, g, m] absolute positions of each group's members, ascending
    focal_k: Tensor  # [B, H, U, r, D]
    focal_v: Tensor
    agg_k: Tensor  # [B, H, U, g, D]
    agg_v: Tensor

    def entries(self, focal_avail: Tensor, agg_avail: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Flatten to one key list [focal_u0; agg_u0; focal_u1; ...] with each entry's first visible position."""
        b, h, u = self.focal_pos.shape[:3]
        d = self.focal_k.shape[-1]
        k = torch.cat([self.focal_k, self.agg_k], dim=3).reshape(b, h, -1, d)
        v = torch.cat([self.focal_v, self.agg_v], dim=3).reshape(b, h, -1, d)
        r, g = self.focal_k.shape[3], self.agg_k.shape[3]
        avail = torch.cat([focal_avail.expand(b, h, u, r), agg_avail.expand(b, h, u, g)], dim=3).reshape(b, h, -1)
        return k, v, avail


def _pad_positions(x: Tensor, x_start: int, lo: int, hi: int) -> Tensor:
    """Rows of x (holding positions x_start..) for positions [lo, hi), zero-filled outside."""
    t = x.shape[2]
    left = x_start - lo
    right = hi - (x_start + t)
    sl = x[:, :, max(0, -left) : t - max(0, -right)]
    return torch.nn.functional.pad(sl, (0, 0, max(0, left), max(0, right)))
