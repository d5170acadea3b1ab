"""What a rank actually holds: the local bytes of its parameters, gradients and optimizer state, and the bytes its
autograd graph saves for the backward (the activations). The layout planner (``launch.plan``) predicts these; its test
compares. Set ``PRETRAIN_STATE_SIZES=1`` and the trainer writes ``state_sizes/rank<R>.json`` in the run directory
after its first optimizer step.

Bytes are counted per storage, each once (``untyped_storage().nbytes()``, deduplicated by address): what is allocated,
FSDP2's padding included (its sharded parameters live in one padded buffer each; a group's sharded gradients are views
of one reduce-scatter output). Activations: every tensor autograd saves during the forward passes through a
``saved_tensors_hooks`` pack hook; the storages that are not parameters, counted once, are what the graph holds when
the forward ends, which without activation checkpointing is the peak of saved activations (the backward only frees
them). Transient buffers (an op's workspace, the gradients flowing back) are not in it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

ENV = "PRETRAIN_STATE_SIZES"


def probe_enabled() -> bool:
    return os.environ.get(ENV, "") not in ("", "0")


def _plain(t: Tensor) -> list[Tensor]:
    """The plain tensors holding ``t``'s data: a wrapper subclass (DTensor, a collective's async result) has no
    storage of its own, its inner tensors do."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if not is_traceable_wrapper_subclass(t):
        return [t]
    attrs, _ = t.__tensor_flatten__()
    inners = [getattr(t, attr) for attr in attrs]
    return [plain for inner in inners if isinstance(inner, Tensor) for plain in _plain(inner)]


def _storage_key(t: Tensor) -> int:
    storage = t.untyped_storage()
    return storage.data_ptr() or id(storage)


def storage_bytes(tensors: list[Tensor]) -> int:
    """Bytes of the storages behind ``tensors`` (DTensors: their local tensors), each storage once."""
    seen: dict[int, int] = {}
    for t in tensors:
        for local in _plain(t):
            if local.device.type != "meta":
                seen[_storage_key(local)] = local.untyped_storage().nbytes()
    return sum(seen.values())


def parameter_bytes(model: nn.Module) -> int:
    return storage_bytes(list(model.parameters()))


def gradient_bytes(model: nn.Module) -> int:
    return storage_bytes([p.grad for p in model.parameters() if p.grad is not None])


def optimizer_bytes(optimizer: torch.optim.Optimizer) -> int:
    return storage_bytes([v for state in optimizer.state.values() for v in state.values() if isinstance(v, Tensor)])


class SavedActivations:
    """Bytes of the storages autograd saves inside the ``with`` block (parameters' storages excluded)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.seen: dict[int, int] = {}

    def _weights(self) -> set[int]:
        """The storages of what the modules hold as parameters and buffers right now: FSDP2 registers the gathered
        parameters for the forward, tensor parallelism swaps in local tensors; each is read when a tensor is saved."""
        keys: set[int] = set()
        for module in self.model.modules():
            for t in [*module._parameters.values(), *module._buffers.values()]:
                if isinstance(t, Tensor):
                    keys.update(_storage_key(local) for local in _plain(t))
        return keys

    def _pack(self, t: Tensor) -> Tensor:
        weights = None
        for local in _plain(t):
            if local.device.type == "meta":
                continue
            key = _storage_key(local)
            if key not in self.seen:
                weights = self._weights() if weights is None else weights
                if key not in weights:
                    self.seen[key] = local.untyped_storage().nbytes()
        return t

    @property
    def nbytes(self) -> int:
        return sum(self.seen.values())

    @contextmanager
    def measure(self) -> Iterator[SavedActivations]:
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
            yield self


class StateProbe:
    """The trainer's side (``PRETRAIN_STATE_SIZES``): the first micro-step's saved activations, the parameters and
    gradients before the first update, the optimizer state after it; one JSON file per rank."""

    def __init__(self, model: nn.Module, run_dir: Path, rank: int):
        self.model, self.path = model, run_dir / "state_sizes" / f"rank{rank}.json"
        self.record: dict[str, Any] = {"rank": rank}
        self.saved: SavedActivations | None = None

    @contextmanager
    def micro_step(self) -> Iterator[None]:
        if self.saved is not None:  # the first micro-step only
            yield
            return
        self.saved = SavedActivations(self.model)
        with self.saved.measure():
            yield
        self.record["activations"] = self.saved.nbytes

    def before_update(self) -> None:
        self.record["parameters"] = parameter_bytes(self.model)
        self.record["gradients"] = gradient_bytes(self.model)

    def after_update(self, optimizer: torch.optim.Optimizer) -> None:
        self.record["optimizer"] = optimizer_bytes(optimizer)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.record))
