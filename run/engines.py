"""What the run config knows about engines: their names and declared capabilities.

The implementations live in ``pretrain/engines/``; a spec lives here,
a layer below, so that config validation lists every engine without importing the trainer.
``pretrain.engines.register_engine`` adds both halves; a new engine is one spec plus one class.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from core.errors import ConfigError, check_min, check_range


@dataclass
class FSDP2Options:
    """``[train.fsdp2]``"""

    # HSDP when > 1: ranks form a (replicate x shard) mesh, parameters sharded within a group of
    # world_size / replicate ranks and replicated across the groups (1 = plain FSDP)
    replicate: int = 1

    def validate(self, prefix: str) -> None:
        check_min(prefix + "replicate", self.replicate, 1)


@dataclass
class DeepSpeedOptions:
    """``[train.deepspeed]``"""

    zero_stage: int = 0  # ZeRO stage 0-3
    # JSON file with the ZeRO options (offload, bucket sizes ...); "" = launch/deepspeed/zero.json.
    # Batch sizes, precision, gradient clipping and the stage come from the run config.
    config: str = ""

    def validate(self, prefix: str) -> None:
        check_range(prefix + "zero_stage", self.zero_stage, 0, 3)
        if self.config and not Path(self.config).is_file():
            raise ConfigError(
                f"{prefix}config: {self.config} does not exist; expected a DeepSpeed JSON file (see launch/deepspeed/)"
            )


@dataclass(frozen=True)
class EngineSpec:
    name: str
    description: str
    # the trainable parameter set may change mid-run (train.unfreeze_at): the engine rebuilds
    # whatever it derived from requires_grad (gradient buckets, sharded optimizer groups)
    changes_trainable: bool = False
    distributed: bool = False  # needs a process group (torchrun / SLURM); world size 1 still works
    # can leave out a step's update after seeing its gradients (train.nonfinite = skip)
    skips_updates: bool = True
    # the engine's own options, the table [train.<name>] (a dataclass with validate(prefix)); None: none
    options_cls: type | None = None
    # hosts train.parallel.tp / cp > 1 (one device mesh: tensor / context parallel inside data parallel)
    model_parallel: bool = False
    # hosts train.float8 (torchao's Float8Linear inside the engine's own wrap)
    float8: bool = True


ENGINE_SPECS: dict[str, EngineSpec] = {}


def register_engine_spec(spec: EngineSpec) -> EngineSpec:
    ENGINE_SPECS[spec.name] = spec
    return spec


for _spec in (
    EngineSpec("single", "one process, one device", changes_trainable=True),
    EngineSpec(
        "ddp",
        "DistributedDataParallel: replicated weights, all-reduced gradients",
        changes_trainable=True,  # re-wraps: the reducer covers the parameters that required grad at wrap time
        distributed=True,
    ),
    EngineSpec(
        "fsdp2",
        "fully_shard (FSDP2; HSDP with train.fsdp2.replicate > 1), DCP checkpoints",
        changes_trainable=True,  # fully_shard follows requires_grad at every all-gather; gradient dtypes re-derived
        distributed=True,
        options_cls=FSDP2Options,
        model_parallel=True,
    ),
    EngineSpec(
        "deepspeed",
        "DeepSpeed ZeRO 0-3 (train.deepspeed.zero_stage), optional CPU offload",
        distributed=True,
        options_cls=DeepSpeedOptions,
        skips_updates=False,  # DeepSpeed steps inside backward's accumulation boundary
        # no train.unfreeze_at: ZeRO flattens the parameters that require grad into its partitions (one AdamW state,
        # one step count per flat group) at initialize; a parameter unfrozen later would never be reduced or stepped
        changes_trainable=False,
        # no train.float8: DeepSpeed casts and partitions the module itself (bf16 / ZeRO-3 parameter hooks), which
        # torchao's Float8Linear and its float8 weight casts are not built or tested for
        float8=False,
    ),
):
    register_engine_spec(_spec)
