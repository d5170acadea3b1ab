"""Dynamic Group Attention's compression pieces shared by its forward and its cache: importance
sampling offsets (eq. 17) and the compressed (focal + aggregated) key set."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

_P = 2_147_483_647  # 2^31 - 1: hash state stays below 2^31, so every product fits in int64 on any device
_ROUNDS = ((1_103_515_245, 12_345), (69_069, 1_013_904_223), (1_664_525, 374_761_393))


def _mix(x: Tensor) -> Tensor:
    """A counter-based hash of int64 values in [0, 2^31): a few multiply-add rounds mod a prime, each folded."""
    for a, b in _ROUNDS:
        x = (x * a + b) % _P
        x = x ^ (x >> 13)
    return x


def sample_offsets(span: int, n_recent: int, n_random: int, seeds: Tensor) -> Tensor:
    """Sorted offsets in [0, span) per unit [U, S]: the last ``n_recent`` plus ``n_random`` others drawn by a hash of
    the unit's seed (``seeds`` [U], eq. 17). Tensor arithmetic only (no generator, no host read), so the compiled
    GPU forward traces it as one graph for every length; the same seed gives the same draw on every device."""
    n_recent = min(n_recent, span)
    u = seeds.shape[0]
    recent = torch.arange(span - n_recent, span, device=seeds.device).expand(u, -1)
    rest = span - n_recent
    if n_random <= 0 or rest <= 0:
        return recent
    i = torch.arange(rest, device=seeds.device)
    key = _mix((_mix(seeds.remainder(_P))[:, None] + i * 40_503) % _P)
    # the n_random smallest keys; ``* rest + i`` makes them distinct, so no tie decides the draw
    others = torch.topk(key * rest + i, min(n_random, rest), dim=-1, largest=False).indices
    return torch.cat([others.sort(dim=-1).values, recent], dim=-1)


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


def pad_positions(x: Tensor, x_start: int, lo: int, hi: int) -> Tensor:
    """Rows of x (holding positions x_start..) for positions [lo, hi), zero-filled outside."""
    t = x.shape[2]
    left = x_start - lo
    right = hi - (x_start + t)
    sl = x[:, :, max(0, -left) : t - max(0, -right)]
    return torch.nn.functional.pad(sl, (0, 0, max(0, left), max(0, right)))
