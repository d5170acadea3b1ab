"""Token-level loss and perplexity of a model over batches of packed sequences."""

from __future__ import annotations

import contextlib
import math
from typing import Iterable

import torch
from torch import Tensor, nn


@torch.no_grad()
def mean_loss(model: nn.Module, batches: Iterable[Tensor], *, device: torch.device, autocast: contextlib.AbstractContextManager | None = None) -> tuple[float, int]:
    """Mean next-token cross-entropy (nats) over every target of ``batches`` ([B, T+1] each), and the token count."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        for batch in batches:
            batch = batch.to(device)
            with autocast or contextlib.nullcontext():
                out = model(batch[:, :-1], targets=batch[:, 1:], return_logits=False)
            total += float(out.loss_sum)
            count += out.n_tokens
    finally:
        model.train(was_training)
    if count == 0:
        raise ValueError("no tokens to evaluate")
    return total / count, count


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 700.0))
