"""``[train.parallel]``, and the arithmetic of a layout: ``ParallelLayout``, the one place that multiplies, divides
and numbers ``dp_replicate x dp_shard x cp x tp``.

Data parallelism is what remains of the world size: ``dp = world / (cp * tp)``, split into
``dp_replicate = train.fsdp2.replicate`` (HSDP) and ``dp_shard = dp / dp_replicate``. Nothing here needs a process
or torch: ``check_layout`` runs from the config alone (``RunConfig.validate``) on one data-parallel replica's layout
(``ParallelLayout.replica``), ``check_world`` once the world size is known (``WORLD_SIZE`` before the process group
starts, or the launcher's ``--nodes`` x processes). The engines derive their layout with ``ParallelLayout.of`` and
number their ranks with ``coordinates``; ``pretrain.engines.parallel_dims`` builds the device mesh from it;
``launch.plan`` enumerates and sizes layouts with it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from core.errors import ConfigError, check_min
from run.engines import ENGINE_SPECS

if TYPE_CHECKING:
    from model.config import ModelConfig

# the mesh's dimensions, outermost first, named as torchtitan names them: tp innermost (TP ranks are neighbours)
MESH_DIMS = ("dp_replicate", "dp_shard", "cp", "tp")


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


class TrainLayout(Protocol):
    """What the checks read of ``run.config.TrainConfig`` (named here, so this module does not import it)."""

    engine: str
    parallel: ParallelConfig
    compile: bool

    def options(self, engine: str) -> Any: ...


class TrainBatchLayout(TrainLayout, Protocol):
    """``TrainLayout`` plus the batch sizes ``check_world`` splits."""

    batch_size: int
    micro_batch_size: int


class RankCoordinates(NamedTuple):
    """A rank's index along each mesh dimension (``MESH_DIMS``)."""

    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    dp: int  # among the data-parallel replicas (``dp_replicate x dp_shard``): the loader's rank
    dp_shard_cp: int  # among the ranks FSDP2 shards a parameter over (``dp_shard x cp``)


@dataclass(frozen=True)
class ParallelLayout:
    """``dp_replicate x dp_shard x cp x tp`` processes: the degrees, their products, the checks that they divide
    what they split, and each rank's coordinates. Frozen, plain integers: importable and usable without
    torch.distributed (the config check, ``launch.plan``); the engines' mesh is built from it."""

    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1

    @classmethod
    def replica(cls, parallel: ParallelConfig) -> ParallelLayout:
        """One data-parallel replica's layout (dp = 1): all the config alone fixes, before the world size."""
        return cls(cp=parallel.cp, tp=parallel.tp)

    @classmethod
    def of(cls, train: TrainLayout, world_size: int) -> ParallelLayout:
        """The layout of ``world_size`` processes: a one-line ``ConfigError`` unless dp x cp x tp = world_size and
        ``train.fsdp2.replicate`` divides dp."""
        par = train.parallel
        model_parallel = cls.replica(par).model_parallel
        if world_size % model_parallel:
            raise ConfigError(
                f"train.parallel: dp x cp x tp must equal the world size {world_size}, but cp x tp = "
                f"{par.cp} x {par.tp} = {model_parallel} does not divide it"
            )
        dp = world_size // model_parallel
        replicate = train.options("fsdp2").replicate if train.engine == "fsdp2" else 1
        if dp % replicate:
            raise ConfigError(
                f"train.fsdp2.replicate: {replicate} does not divide the data-parallel size {dp} "
                f"(world {world_size} / cp {par.cp} / tp {par.tp})"
            )
        return cls(replicate, dp // replicate, par.cp, par.tp)

    @staticmethod
    def model_parallel_degrees(world_size: int, max_tp: int) -> Iterator[tuple[int, int]]:
        """Every (cp, tp) whose product divides ``world_size``, ``tp <= max_tp`` (TP within a node); tp ascending,
        then cp ascending."""
        for tp in _divisors(world_size):
            if tp <= max_tp:
                for cp in _divisors(world_size // tp):
                    yield cp, tp

    # ---- products ----------------------------------------------------------------------------------------------
    @property
    def dp(self) -> int:
        """The data-parallel replicas: ``dp_replicate x dp_shard`` (the loader's world)."""
        return self.dp_replicate * self.dp_shard

    @property
    def model_parallel(self) -> int:
        """The ranks that hold one replica's share of a batch: ``cp x tp``."""
        return self.cp * self.tp

    @property
    def dp_shard_cp(self) -> int:
        """The ranks FSDP2 shards a parameter over: ``dp_shard x cp`` (CP ranks hold different tokens)."""
        return self.dp_shard * self.cp

    @property
    def dp_cp(self) -> int:
        """The ranks whose token counts and losses add up, and that FSDP2 averages gradients over: ``dp x cp``."""
        return self.dp * self.cp

    @property
    def world(self) -> int:
        return self.dp * self.model_parallel

    @property
    def mesh_shape(self) -> tuple[int, int, int, int]:
        """The sizes along ``MESH_DIMS``."""
        return (self.dp_replicate, self.dp_shard, self.cp, self.tp)

    def label(self) -> str:
        return "x".join(str(n) for n in self.mesh_shape)

    def describe(self, engine: str) -> str:
        """The console's one line naming the layout a run trains on: ``layout: dp_replicate 1 x dp_shard 1 x cp 1 x
        tp 2 (world 2, fsdp2)``."""
        dims = " x ".join(f"{name} {size}" for name, size in zip(MESH_DIMS, self.mesh_shape, strict=True))
        return f"layout: {dims} (world {self.world}, {engine})"

    def coordinates(self, rank: int) -> RankCoordinates:
        """Global ``rank``'s place in the mesh: ranks fill ``mesh_shape`` in row-major order, tp innermost, as
        ``init_device_mesh`` lays out ``arange(world)``."""
        rest, tp = divmod(rank, self.tp)
        rest, cp = divmod(rest, self.cp)
        replicate, shard = divmod(rest, self.dp_shard)
        return RankCoordinates(replicate, shard, cp, tp, replicate * self.dp_shard + shard, shard * self.cp + cp)

    # ---- what the degrees must divide --------------------------------------------------------------------------
    def check_heads(self, model: ModelConfig) -> None:
        """tp splits the query heads and the KV heads (GQA's groups stay on one rank)."""
        if model.n_heads % self.tp:
            raise ConfigError(f"train.parallel.tp: {self.tp} does not divide model.n_heads={model.n_heads}")
        if model.kv_heads % self.tp:
            raise ConfigError(f"train.parallel.tp: {self.tp} does not divide model.n_kv_heads={model.kv_heads}")

    def check_sequence_split(self, seq_len: int, sequence_parallel: bool) -> None:
        """Under sequence parallelism each rank's ``seq_len / cp`` tokens split over the TP ranks between the
        blocks. (The 2 x cp chunks of a sequence are context parallelism's own check, ``check_context_parallel``.)"""
        if self.tp > 1 and sequence_parallel and seq_len % self.model_parallel:
            raise ConfigError(
                f"data.seq_len: {seq_len} is not divisible by train.parallel.cp x tp = {self.model_parallel} "
                "(sequence parallelism splits each rank's tokens over the TP ranks; or set "
                "train.parallel.sequence_parallel = false)"
            )

    def check_batch(self, batch_size: int, micro_batch_size: int) -> None:
        """The global batch splits over the data-parallel ranks only (the CP and TP ranks of a replica read the same
        sequences), in micro-batches of ``micro_batch_size`` (0: one per rank)."""
        if micro_batch_size and batch_size % (micro_batch_size * self.dp):
            raise ConfigError(
                f"train.batch_size: {batch_size} is not divisible by train.micro_batch_size ({micro_batch_size}) x "
                f"{self.dp} data-parallel ranks"
            )
        if batch_size % self.dp:
            raise ConfigError(f"train.batch_size: {batch_size} is not divisible by the {self.dp} data-parallel ranks")


MAX_WORLD = 2**20  # devices in one job: far past any job run (the largest have ~2^17)


def check_world_size(world: int, key: str) -> None:
    """A device / process count: >= 1 and at most ``MAX_WORLD``."""
    if world < 1:
        raise ConfigError(f"{key}: must be >= 1, got {world}")
    if world > MAX_WORLD:
        raise ConfigError(f"{key}: {world:,} devices is beyond {MAX_WORLD:,} (2^20, a sane upper bound for one job)")


def _divisors(n: int) -> list[int]:
    """The divisors of ``n`` ascending, by trial division up to sqrt(n): a planner's search over a million devices
    stays instant."""
    low, high = [], []
    k = 1
    while k * k <= n:
        if n % k == 0:
            low.append(k)
            if k != n // k:
                high.append(n // k)
        k += 1
    return low + high[::-1]


def check_layout(train: TrainLayout, model: ModelConfig, seq_len: int) -> None:
    """The layout checks that need no world size (``RunConfig.validate``); one ``ConfigError`` line each."""
    par = train.parallel
    layout = ParallelLayout.replica(par)
    if layout.model_parallel > 1 and not ENGINE_SPECS[train.engine].model_parallel:
        capable = ", ".join(n for n, s in ENGINE_SPECS.items() if s.model_parallel)
        key = "tp" if par.tp > 1 else "cp"
        raise ConfigError(
            f"train.parallel.{key}: {getattr(par, key)} needs an engine that hosts model parallelism; "
            f"train.engine={train.engine} cannot (use: {capable})"
        )
    if par.tp > 1 and train.compile:
        # the TP plan swaps local tensors in with forward hooks, which a compiled block does not run
        raise ConfigError("train.compile: not supported with train.parallel.tp > 1 yet; set train.compile = false")
    layout.check_heads(model)
    if par.cp > 1:
        if train.compile:
            # compiled blocks around the per-layer K/V all-gather matched one process for full and Focus, but DGA's
            # compiled cp=2 run had not logged a step after 8 minutes: not verified for every variant yet
            raise ConfigError("train.compile: not supported with train.parallel.cp > 1 yet; set train.compile = false")
        from model.attention.common.context_parallel import check_context_parallel  # torch: only for a CP layout

        # the sequence splits into 2 x cp chunks, each a multiple of the variant's own chunk; the variant has a CP form
        check_context_parallel(model.attention.kind, model.attention.variant, seq_len, par.cp)
    layout.check_sequence_split(seq_len, par.sequence_parallel)


def check_world(train: TrainBatchLayout, world_size: int) -> ParallelLayout:
    """The layout of ``world_size`` processes plus the batch split the loader will demand, checked as soon as the
    world size is known (``WORLD_SIZE`` under torchrun, ``--dry-run`` included, or the launcher's nodes x processes)
    rather than after every process has joined the group."""
    check_world_size(world_size, "world size")
    layout = ParallelLayout.of(train, world_size)
    layout.check_batch(train.batch_size, train.micro_batch_size)
    return layout
