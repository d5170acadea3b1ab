"""Which parameters train at a given step: ``train.freeze`` / ``train.trainable`` name patterns
(fnmatch on ``model.named_parameters()`` names) and ``train.unfreeze_at`` for two-phase recipes.

Centroid-only Focus training is ``train.trainable = ["*.core.*"]`` (only the attention variant's
own parameters: W_g, C, lambda); two-phase adds ``train.unfreeze_at = N``. Frozen parameters stay
in the optimizer with no gradient, so AdamW leaves them bitwise unchanged (no decay either), and
unfreezing later needs no new optimizer.
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import TYPE_CHECKING

from torch import nn

from core.errors import ConfigError
from model.attention.common.base import Attention

if TYPE_CHECKING:
    from run.config import TrainConfig

VARIANT_PARAMETERS = "*.core.*"  # an attention variant's own parameters (Focus: W_g, C, lambda); the rest: backbone


def check_patterns(model: nn.Module, cfg: TrainConfig) -> None:
    """Every pattern must name at least one parameter (a typo would silently train everything)."""
    names = [name for name, _ in model.named_parameters()]
    for key in ("freeze", "trainable"):
        for pattern in getattr(cfg, key):
            if not any(fnmatchcase(name, pattern) for name in names):
                raise ConfigError(
                    f"train.{key}: pattern {pattern!r} matches no parameter (names look like {names[-1]!r})"
                )


def is_trainable(name: str, cfg: TrainConfig, step: int) -> bool:
    if cfg.unfreeze_at and step >= cfg.unfreeze_at:
        return True
    if cfg.trainable and not any(fnmatchcase(name, p) for p in cfg.trainable):
        return False
    return not any(fnmatchcase(name, p) for p in cfg.freeze)


def apply_trainable(model: nn.Module, cfg: TrainConfig, step: int) -> tuple[int, int] | None:
    """Set ``requires_grad`` for optimizer step ``step`` and tell the attention variants whether the backbone
    (everything but their own ``*.core.*`` parameters) trains. Returns (trainable, total) parameter counts when
    something changed, else None."""
    changed, backbone, trainable, total = False, False, 0, 0
    for name, p in model.named_parameters():
        flag = is_trainable(name, cfg, step)
        changed |= p.requires_grad != flag
        p.requires_grad_(flag)
        backbone |= flag and not fnmatchcase(name, VARIANT_PARAMETERS)
        total += p.numel()
        trainable += p.numel() if flag else 0
    for module in model.modules():
        if isinstance(module, Attention):
            module.set_backbone_trains(backbone)
    return (trainable, total) if changed else None
