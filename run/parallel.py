"""``[train.parallel]``: the model-parallel degrees of a run and every check a layout needs.

Data parallelism is what remains of the world size: ``dp = world / (cp * tp)``, split into
``dp_replicate = train.fsdp2.replicate`` (HSDP) and ``dp_shard = dp / dp_replicate``. The checks here
need no process: ``check_layout`` runs from the config alone (``RunConfig.validate``), and
``data_parallel_size`` once the world size is known (the launcher's ``--nodes`` x processes, or
``WORLD_SIZE`` before the process group starts). The mesh itself is ``pretrain.engines.parallel_dims``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from core.errors import ConfigError, check_min
from run.engines import ENGINE_SPECS

if TYPE_CHECKING:
    from model.config import ModelConfig


@dataclass
class ParallelConfig:
    """``[train.parallel]``"""

    tp: int = 1  # tensor parallel degree: heads and MLP columns split over tp ranks (fsdp2 only)
    cp: int = 1  # context parallel degree: each sequence split into 2 x cp chunks over cp ranks (fsdp2 only)
    # with tp > 1: the residual stream between the blocks (norms, dropout, residual adds) is split over the TP ranks
    # on the sequence dimension, all-gathered before q/k/v and the MLP, reduce-scattered after wo and down
    sequence_parallel: bool = True

    def validate(self, prefix: str) -> None:
        check_min(prefix + "tp", self.tp, 1)
        check_min(prefix + "cp", self.cp, 1)

    @property
    def model_parallel(self) -> int:
        """Ranks that hold one data-parallel replica's share of a batch: cp x tp."""
        return self.tp * self.cp


class TrainLayout(Protocol):
    """What the checks read of ``run.config.TrainConfig`` (named here, so this module does not import it)."""

    engine: str
    parallel: ParallelConfig
    compile: bool

    def options(self, engine: str) -> Any: ...


def check_layout(train: TrainLayout, model: ModelConfig, seq_len: int) -> None:
    """The layout checks that need no world size; one ``ConfigError`` line each."""
    par = train.parallel
    if par.model_parallel > 1 and not ENGINE_SPECS[train.engine].model_parallel:
        capable = ", ".join(n for n, s in ENGINE_SPECS.items() if s.model_parallel)
        key = "tp" if par.tp > 1 else "cp"
        raise ConfigError(
            f"train.parallel.{key}: {getattr(par, key)} needs an engine that hosts model parallelism; "
            f"train.engine={train.engine} cannot (use: {capable})"
        )
    if par.tp > 1 and train.compile:
        # the TP plan swaps local tensors in with forward hooks, which a compiled block does not run
        raise ConfigError("train.compile: not supported with train.parallel.tp > 1 yet; set train.compile = false")
    if model.n_heads % par.tp:
        raise ConfigError(f"train.parallel.tp: {par.tp} does not divide model.n_heads={model.n_heads}")
    if model.kv_heads % par.tp:
        raise ConfigError(f"train.parallel.tp: {par.tp} does not divide model.n_kv_heads={model.kv_heads}")
    if par.cp > 1:
        if train.compile:
            # compiled blocks around the per-layer K/V all-gather matched one process for full and Focus, but DGA's
            # compiled cp=2 run had not logged a step after 8 minutes: not verified for every variant yet
            raise ConfigError("train.compile: not supported with train.parallel.cp > 1 yet; set train.compile = false")
        from model.attention.common.context_parallel import check_context_parallel  # torch: only for a CP layout

        # the sequence splits into 2 x cp chunks, each a multiple of the variant's own chunk; the variant has a CP form
        check_context_parallel(model.attention.kind, model.attention.variant, seq_len, par.cp)
    if par.tp > 1 and par.sequence_parallel and seq_len % par.model_parallel:
        # each rank's seq_len / cp tokens split over the TP ranks between the blocks
        raise ConfigError(
            f"data.seq_len: {seq_len} is not divisible by train.parallel.cp x tp = {par.model_parallel} (sequence "
            "parallelism splits each rank's tokens over the TP ranks; or set train.parallel.sequence_parallel = false)"
        )


def data_parallel_size(train: TrainLayout, world_size: int) -> int:
    """``dp`` for ``world_size`` processes: a one-line ``ConfigError`` unless dp x cp x tp = world_size."""
    par = train.parallel
    if world_size % par.model_parallel:
        raise ConfigError(
            f"train.parallel: dp x cp x tp must equal the world size {world_size}, but cp x tp = "
            f"{par.cp} x {par.tp} = {par.model_parallel} does not divide it"
        )
    dp = world_size // par.model_parallel
    if train.engine == "fsdp2":
        replicate = train.options("fsdp2").replicate
        if dp % replicate:
            raise ConfigError(
                f"train.fsdp2.replicate: {replicate} does not divide the data-parallel size {dp} "
                f"(world {world_size} / cp {par.cp} / tp {par.tp})"
            )
    return dp


class TrainBatchLayout(TrainLayout, Protocol):
    """``TrainLayout`` plus the batch sizes ``check_world`` splits."""

    batch_size: int
    micro_batch_size: int


def check_world(train: TrainBatchLayout, world_size: int) -> int:
    """``data_parallel_size`` plus the batch split the loader will demand, checked as soon as the world size is known
    (``WORLD_SIZE`` under torchrun, ``--dry-run`` included, or the launcher's nodes x processes) rather than after
    every process has joined the group: the global batch splits over the data-parallel ranks only (the CP and TP
    ranks of a replica read the same sequences), in micro-batches of ``train.micro_batch_size`` (0: one per rank)."""
    dp = data_parallel_size(train, world_size)
    micro = train.micro_batch_size
    if micro and train.batch_size % (micro * dp):
        raise ConfigError(
            f"train.batch_size: {train.batch_size} is not divisible by train.micro_batch_size ({micro}) x "
            f"{dp} data-parallel ranks"
        )
    if train.batch_size % dp:
        raise ConfigError(f"train.batch_size: {train.batch_size} is not divisible by the {dp} data-parallel ranks")
    return dp
