"""What the run config knows about engines: their names and declared capabilities.

The implementations live in ``pretrain/engines/``; a spec lives here,
a layer below, so that config validation lists every engine without importing the trainer.
``pretrain.engines.register_engine`` adds both halves; a new engine is one spec plus one class.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineSpec:
    name: str
    description: str
    # the trainable parameter set may change mid-run (train.unfreeze_at): the engine rebuilds
    # whatever it derived from requires_grad (gradient buckets, sharded optimizer groups)
    changes_trainable: bool = False
    distributed: bool = False  # needs a process group (torchrun / SLURM); world size 1 still works


ENGINE_SPECS: dict[str, EngineSpec] = {}


def register_engine_spec(spec: EngineSpec) -> EngineSpec:
    ENGINE_SPECS[spec.name] = spec
    return spec


for _spec in (
    EngineSpec("single", "one process, one device", changes_trainable=True),
    EngineSpec("ddp", "DistributedDataParallel: replicated weights, all-reduced gradients", distributed=True),
    EngineSpec("fsdp2", "fully_shard (FSDP2; HSDP with train.fsdp_replicate > 1), DCP checkpoints", distributed=True),
    EngineSpec("deepspeed", "DeepSpeed ZeRO 0-3 (train.zero_stage), optional CPU offload", distributed=True),
):
    register_engine_spec(_spec)
