"""AdamW with decay / no-decay parameter groups, and learning-rate schedules."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from model.attention import Attention

if TYPE_CHECKING:
    from run.config import TrainConfig


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices only: no weight decay on norms, biases, embeddings, or what a module lists in
    its ``no_weight_decay`` attribute (an attention variant's hook: (attention bias tables, centroids, offsets)."""
    no_decay_ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    attention = [m for m in model.modules() if isinstance(m, Attention)]
    no_decay_ids |= {id(getattr(m, name)) for m in attention for name in m.no_weight_decay}
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    seen: set[int] = set()
    for _, p in model.named_parameters():
        if id(p) in seen:  # frozen parameters stay in: no gradient means AdamW leaves them untouched
            continue
        seen.add(id(p))
        (decay if p.dim() >= 2 and id(p) not in no_decay_ids else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay, "name": "decay"},
        {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"},
    ]


def build_optimizer(model: nn.Module, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    # Tied LM head shares the embedding's tensor: it is counted once, as an embedding (no decay).
    return torch.optim.AdamW(
        param_groups(model, cfg.weight_decay),
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        fused=device.type in ("cuda", "cpu"),
    )


def lr_multiplier(step: int, cfg: TrainConfig) -> float:
    """Multiplier of ``cfg.lr`` for optimizer step ``step`` (0-based): linear warmup, then the schedule to the floor."""
    floor = cfg.min_lr_ratio
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    span = max(1, cfg.max_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    if cfg.schedule == "constant":
        return 1.0
    if cfg.schedule == "linear":
        return floor + (1.0 - floor) * (1.0 - progress)
    if cfg.schedule == "cosine":
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    # wsd: warmup, stable at the peak, then a linear decay over the last decay_fraction of all steps
    decay_start = cfg.max_steps - int(round(cfg.decay_fraction * cfg.max_steps))
    if step < decay_start:
        return 1.0
    return floor + (1.0 - floor) * (1.0 - (step - decay_start) / max(1, cfg.max_steps - decay_start))


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(step, cfg))


def apply_hyperparameters(scheduler: torch.optim.lr_scheduler.LambdaLR, cfg: TrainConfig) -> None:
    """Write ``cfg``'s learning rate, betas, eps and weight decay into an optimizer restored from a checkpoint
    (its state carries the values it was saved with), keeping the schedule's position: a relaunch's new
    ``train.lr`` applies from the resume step on."""
    optimizer = scheduler.optimizer
    scheduler.base_lrs = [cfg.lr for _ in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["initial_lr"] = cfg.lr
        group["lr"] = cfg.lr * lr_multiplier(scheduler.last_epoch, cfg)
        group["betas"] = (cfg.beta1, cfg.beta2)
        group["eps"] = cfg.eps
        if group.get("name") == "decay":
            group["weight_decay"] = cfg.weight_decay
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]  # what get_last_lr() reports
