"""The engine registry: ``train.engine`` names an entry, ``build_engine`` builds it.

An engine is a spec (name, description, capabilities; ``run.engines``, so config validation lists it
without importing the trainer) plus an ``Engine`` subclass registered here under the same name.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from core.device import resolve_device
from model.transformer import Transformer
from pretrain.engines.base import Engine, MicroStepOut
from pretrain.engines.deepspeed import DeepSpeedEngine
from pretrain.engines.parallel import DDPEngine, FSDP2Engine, init_process_group
from pretrain.engines.single import SingleEngine
from run.engines import ENGINE_SPECS, EngineSpec, register_engine_spec

if TYPE_CHECKING:
    from run.config import TrainConfig

__all__ = ["ENGINES", "Engine", "MicroStepOut", "build_engine", "register_engine"]

ENGINES: dict[str, type[Engine]] = {}


def register_engine(cls: type[Engine], spec: EngineSpec | None = None) -> type[Engine]:
    """Register ``cls`` under ``cls.name``; ``spec`` declares a new engine's name and capabilities."""
    if spec is not None:
        if spec.name != cls.name:
            raise ValueError(f"engine spec {spec.name!r} does not name class {cls.__name__} ({cls.name!r})")
        register_engine_spec(spec)
    if cls.name not in ENGINE_SPECS:
        raise ValueError(f"engine {cls.name!r} has no spec in run.engines.ENGINE_SPECS; pass one")
    ENGINES[cls.name] = cls
    return cls


for _cls in (SingleEngine, DDPEngine, FSDP2Engine, DeepSpeedEngine):
    register_engine(_cls)


@contextlib.contextmanager
def rank_zero_first() -> Iterator[None]:
    """Rank 0 runs the block first (training a tokenizer, writing caches), the others then read
    what it wrote, so every rank tokenises with the same model. A no-op in one process."""
    import torch.distributed as dist

    active = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    if active and dist.get_rank() != 0:
        dist.barrier()
    try:
        yield
    finally:
        if active and dist.get_rank() == 0:
            dist.barrier()


def prepare_device(cfg: TrainConfig) -> torch.device:
    """This process's device; for the data-parallel engines, after joining the process group."""
    if not ENGINE_SPECS[cfg.engine].distributed:
        return resolve_device(cfg.device)
    return init_process_group(cfg)


def build_engine(model: Transformer, cfg: TrainConfig, device: torch.device) -> Engine:
    return ENGINES[cfg.engine](model, cfg, device)
