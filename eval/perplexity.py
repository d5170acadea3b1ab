"""Token-level loss and perplexity of a model over batches of packed sequences."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from data.tokenizer import Tokenizer


@torch.no_grad()
def mean_loss(
    model: nn.Module,
    batches: Iterable[Tensor],
    *,
    device: torch.device,
    autocast: contextlib.AbstractContextManager | None = None,
    split: Callable[[Tensor, Tensor], tuple[Tensor, Tensor]] | None = None,
) -> tuple[float, int]:
    """Mean next-token cross-entropy (nats) over every target of ``batches`` ([B, T+1] each), and the token count.
    ``split(inputs, targets)``: this rank's share of each batch (a context-parallel rank's chunks); the mean and
    count are then this rank's."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    try:
        for batch in batches:
            inputs, targets = batch[:, :-1], batch[:, 1:]
            if split is not None:
                inputs, targets = split(inputs, targets)
            with autocast or contextlib.nullcontext():
                out = model(inputs.to(device), targets=targets.to(device), return_logits=False)
            total += float(out.loss_sum)
            count += out.n_tokens
    finally:
        model.train(was_training)
    if count == 0:
        raise ValueError("no tokens to evaluate")
    return total / count, count


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 700.0))


@torch.no_grad()
def strided_loss(
    model: nn.Module, tokens: Tensor, *, length: int, stride: int, device: torch.device | str
) -> tuple[float, int]:
    """(summed nats, targets) of one token sequence under sliding windows of ``length`` tokens moved
    by ``stride``: every token after the first is a target exactly once, each window scoring only
    targets no earlier window scored, so each has at least ``length - stride`` tokens of context
    (beyond the first window). ``stride == length`` is non-overlapping windows."""
    if not 0 < stride <= length:
        raise ValueError(f"stride must be in [1, length={length}], got {stride}")
    n = tokens.numel()
    total, count, scored = 0.0, 0, 1  # targets [1, scored) are done
    begin = 0
    while scored < n:
        end = min(begin + length, n - 1)
        inputs = tokens[begin:end][None].to(device)
        targets = tokens[begin + 1 : end + 1].clone()
        targets[: max(0, scored - (begin + 1))] = -100  # already scored by an earlier window
        out = model(inputs, targets=targets[None].to(device), return_logits=False)
        total += float(out.loss_sum)
        count += out.n_tokens
        scored = end + 1
        begin += stride
    return total, count


class NoDocuments(ValueError):
    """The texts hold no document of two or more tokens: nothing to score."""


def text_perplexity(
    model: nn.Module,
    texts: Iterable[str],
    tokenizer: Tokenizer,
    *,
    length: int,
    stride: int,
    device: torch.device | str,
) -> dict:
    """Token-level and per-byte figures over documents (each scored on its own, as lm-eval's rolling
    perplexity does): loss (nats / token), perplexity, bits per byte, byte perplexity."""
    was_training = model.training
    model.eval()
    total, tokens, n_bytes, docs = 0.0, 0, 0, 0
    try:
        for text in texts:
            ids = torch.tensor(tokenizer.encode(text), dtype=torch.long)
            if ids.numel() < 2:
                continue
            nats, count = strided_loss(model, ids, length=length, stride=stride, device=device)
            total, tokens, n_bytes, docs = total + nats, tokens + count, n_bytes + len(text.encode("utf-8")), docs + 1
    finally:
        model.train(was_training)
    if tokens == 0:
        raise NoDocuments("no document of two or more tokens to evaluate")
    loss = total / tokens
    return {
        "loss": loss,
        "perplexity": perplexity(loss),
        "bits_per_byte": total / n_bytes / math.log(2),
        "byte_perplexity": math.exp(min(total / n_bytes, 700.0)),
        "tokens": tokens,
        "bytes": n_bytes,
        "documents": docs,
        "length": length,
        "stride": stride,
    }
