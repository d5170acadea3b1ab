"""Activation checkpointing per block: ``none``, ``selective`` or ``full``.

``full`` keeps only each block's input and recomputes the whole block in backward.
``selective`` (op-level, as torchtitan's "selective op" mode) keeps the outputs of the
compute-bound ops (matmuls, fused attention) and recomputes the cheap memory-bound ones (norms,
activations, RoPE, elementwise), which removes most of the saved activations for a small
recompute cost. Both use the non-reentrant implementation, which FSDP2 and torch.compile support.
A variant's forward must have no side effects beyond its outputs: it runs twice. Under ``selective`` the replay
gets the forward's own output tensor of every kept op (``saved_ops()``), so a forward must never modify such an output
in place (``torch.matmul(...).mul_(...)``): the replay would apply the change twice and compute different values
for the backward, silently (``test_activation_checkpointing_keeps_values_and_gradients`` runs every variant).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

MODES = ("none", "selective", "full")

# _scaled_mm: train.float8's matmuls (torchao's Float8Linear)
_MATMULS = ("mm", "addmm", "bmm", "baddbmm", "_scaled_mm")
MATMUL_OPS = frozenset(getattr(torch.ops.aten, name).default for name in _MATMULS if hasattr(torch.ops.aten, name))


def saved_ops() -> frozenset[Any]:
    """What ``selective`` keeps: the matmuls and every registered variant's attention kernels
    (``Attention.attention_ops``), so the backward never re-runs an attention forward."""
    from model.attention import registry

    return MATMUL_OPS.union(*(entry.cls.attention_ops() for entry in registry.values()))


def _selective_policy(
    saved: frozenset[Any], ctx: object, op: object, *args: object, **kwargs: object
) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE


def checkpointed(block: Callable[..., Any], mode: str, *args: Any, **kwargs: Any) -> Any:
    """``block(*args, **kwargs)`` under the given checkpointing mode (not ``none``)."""
    if mode == "full":
        return checkpoint(block, *args, use_reentrant=False, **kwargs)
    if mode == "selective":
        return checkpoint(
            block,
            *args,
            use_reentrant=False,
            context_fn=partial(create_selective_checkpoint_contexts, partial(_selective_policy, saved_ops())),
            **kwargs,
        )
    raise ValueError(f"activation checkpointing mode {mode!r}; allowed: {', '.join(MODES)}")
