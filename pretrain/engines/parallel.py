"""Data-parallel engines: ``ddp`` (DistributedDataParallel) and ``fsdp2`` (``fully_shard``).

Both are launched by ``torchrun`` (or ``srun`` + ``torchrun``): the process group comes from
the launcher's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``), NCCL on
CUDA and gloo on CPU. Checkpoints use torch.distributed.checkpoint (DCP): every rank writes its
shards of the model and optimizer under ``dcp/``, which reshards on load, so a run saved by N
processes resumes on M. Rank 0 also writes the consolidated ``model.safetensors`` that
evaluation and ``train.init_from`` read, as for the single engine.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import socket
import time
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn

from core.device import resolve_device
from core.errors import ConfigError
from core.files import plain_mode
from core.torch_compat import disable_redistribute_transform_optimization
from pretrain.checkpoint import MODEL_FILE, untie
from pretrain.engines.base import Engine
from pretrain.engines.float8 import plain_state, plain_tree, precompute_scales, uses_float8_all_gather
from pretrain.engines.parallelize import apply_ddp, parallelize
from run.parallel import ParallelLayout

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    from model.transformer import Transformer
    from run.config import TrainConfig

DCP_DIR = "dcp"
HEARTBEAT = "focused_pretrain/heartbeat"
STARTUP_COLLECTIVE_TIMEOUT = 1800.0  # seconds: the first step (compiling) and checkpoint saves
SCHEDULER_FILE = "scheduler.pt"


def init_process_group(cfg: TrainConfig) -> torch.device:
    """Join the launcher's process group (idempotent) and return this rank's device. The layout is not checked here:
    ``pretrain.train`` checks it against ``WORLD_SIZE`` before (``run.parallel.check_world``), and the engine derives
    it (``ParallelLayout.of``, the same line for an impossible one) before its first collective."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise ConfigError(
            f"train.engine: {cfg.engine} needs a distributed launcher (torchrun, or launch/torchrun.sh); "
            "RANK/WORLD_SIZE are not set"
        )
    device = resolve_device(cfg.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend,
            timeout=timedelta(seconds=STARTUP_COLLECTIVE_TIMEOUT),
            device_id=device if device.type == "cuda" else None,
        )
    return device


def check_written_by(directory: Path, own: str, engine: str) -> None:
    """A one-line error unless checkpoint ``directory`` holds the folder ``own`` that ``engine`` writes."""
    if not (directory / own).is_dir():
        raise ConfigError(
            f"train.engine: checkpoint {directory} was not written by {engine}; resume it with the engine that wrote it"
        )


class DataParallelEngine(Engine):
    """What DDP and FSDP2 share: collectives, DCP checkpoints, the consolidated weights."""

    def __init__(self, model: Transformer, cfg: TrainConfig, device: torch.device):
        if not dist.is_initialized():
            raise ConfigError(f"train.engine: {cfg.engine} needs the process group (start it with torchrun)")
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.layout = ParallelLayout.of(cfg, self.world_size)  # (checked before the process group, pretrain.train)
        self.data_group: dist.ProcessGroup | None = None  # None: every rank holds its own data (no model parallelism)
        super().__init__(model, cfg, device)

    # ---- collectives ------------------------------------------------------------------
    def all_reduce_sum(self, value: Tensor) -> Tensor:
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        return value

    def all_reduce_data_sum(self, value: Tensor) -> Tensor:
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM, group=self.data_group)
        return value

    def barrier(self) -> None:
        dist.barrier()

    def broadcast_object(self, obj: Any) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather_object(self, obj: Any) -> list:
        out: list = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def set_collective_timeout(self, seconds: float) -> None:
        # torchtitan does the same after its first step: the long start-up timeout only while compiling. Every
        # group this rank is in (the mesh's tp / cp / shard groups too): each has its own timeout
        bound = timedelta(seconds=seconds)
        for group in list(dist.distributed_c10d._world.pg_map):
            if not dist.distributed_c10d._rank_not_in_group(group):
                dist.distributed_c10d._set_pg_timeout(bound, group)
        self.collective_timeout = seconds

    def heartbeat(self, step: int) -> None:
        # one small write to the launcher's key-value store per step, readable while a rank is stopped; the host
        # and pid let a rank on the same host end a stalled one (end_stalled)
        beat = f"{step} {time.time():.3f} {socket.gethostname()} {os.getpid()}"
        dist.distributed_c10d._get_default_store().set(f"{HEARTBEAT}/{self.rank}", beat)

    def stalled(self) -> str | None:
        try:
            store = dist.distributed_c10d._get_default_store()
            beats, where = {}, {}
            for rank in range(self.world_size):
                key = f"{HEARTBEAT}/{rank}"
                if store.check([key]):
                    step, when, *host_pid = store.get(key).decode().split()
                    beats[rank] = (int(step), float(when))
                    where[rank] = tuple(host_pid)
        except Exception:  # the store itself may be gone with the launcher
            return None
        if self.rank not in beats:
            return None
        now, (mine, _) = time.time(), beats[self.rank]
        behind = sorted(r for r, (step, _) in beats.items() if step < mine) + sorted(
            set(range(self.world_size)) - set(beats)
        )
        if not behind:  # the same step: the ones silent for longest
            oldest = min(when for _, when in beats.values())
            behind = [r for r, (_, when) in beats.items() if r != self.rank and when - oldest < 1.0]
        if not behind:
            return None
        host = socket.gethostname()
        self._stalled_pids = [int(where[r][1]) for r in behind if len(where.get(r, ())) == 2 and where[r][0] == host]
        parts = []
        for rank in behind:
            seen = f"last at step {beats[rank][0]}, {now - beats[rank][1]:.0f} s ago" if rank in beats else "no step"
            parts.append(f"rank {rank} ({seen})")
        return ", ".join(parts)

    def end_stalled(self) -> None:
        """SIGKILL the stalled ranks that ``stalled`` found on this host, when they are workers of this rank's own
        launcher: the job is ending, and torchrun's SIGTERM cannot reach a stopped process (it would wait its
        30-second shutdown grace, then kill it)."""
        for pid in getattr(self, "_stalled_pids", []):
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[1]) == os.getppid():  # a sibling: the same torchrun agent started it
                    os.kill(pid, signal.SIGKILL)
            except (OSError, IndexError, ValueError):
                pass  # gone already, or not ours to end

    def close(self) -> None:
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()

    # ---- checkpoints ------------------------------------------------------------------
    def write_state(self, directory: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict

        model_sd, optim_sd = get_state_dict(self.wrapped, self.optimizer)
        if self.cfg.float8 != "none":  # ordinary tensors in the shards, not torchao's float8 all-gather wrapper
            model_sd, optim_sd = plain_tree(model_sd), plain_tree(optim_sd)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(directory / DCP_DIR))
        # a parameter that FSDP2 and TP split on the same dimension (_StridedShard, Shard) gathers in two all-gathers
        # that torch cannot merge into one and warns so on every rank at each save; its merge pass has nothing to merge
        # in these state dicts (the other placements gather once, or on different dimensions): skip it
        with disable_redistribute_transform_optimization():
            full = get_model_state_dict(self.wrapped, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.is_main:
            # a full state dict: tensors only (plain ones: the float8 all-gather's weight wrapper unwrapped)
            self._write_consolidated(directory, plain_state(cast("dict[str, Tensor]", full)))

    def _write_consolidated(self, directory: Path, full: dict[str, Tensor]) -> None:
        """The main rank's share of a checkpoint: the whole weights ``full`` (``MODEL_FILE``) and the scheduler."""
        from safetensors.torch import save_file

        save_file(untie(full, self.raw_model), str(directory / MODEL_FILE))
        plain_mode(directory / MODEL_FILE)
        torch.save(self.scheduler.state_dict(), directory / SCHEDULER_FILE)

    def read_state(self, directory: Path) -> None:
        check_written_by(directory, DCP_DIR, "a DCP engine (ddp / fsdp2)")
        read_dcp_state(self.wrapped, self.optimizer, self.scheduler, directory)


def read_dcp_state(model: nn.Module, optimizer: Any, scheduler: Any, directory: Path, *, no_dist: bool = False) -> None:
    """Model, optimizer and schedule from a DCP checkpoint ``directory`` (written by ddp / fsdp2 on any layout: DCP
    reshards onto this one). ``no_dist``: one process without a process group (the single engine)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from run.safe_load import dcp_load, torch_load

    model_sd, optim_sd = get_state_dict(model, optimizer)
    state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
    restore = _saved_scalars_as_views(state, directory / DCP_DIR)
    # torch's reader unpickles .metadata unchecked; this one does not
    dcp_load(state, directory / DCP_DIR, no_dist=no_dist)
    for container, key, tensor in restore:
        container[key] = tensor
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    scheduler.load_state_dict(torch_load(directory / SCHEDULER_FILE, map_location="cpu"))


def _saved_scalars_as_views(state: dict[str, Any], dcp_dir: Path) -> list[tuple[dict, str, Tensor]]:
    """Parameters that were 0-dim when the checkpoint was written and are shape [1] now (Focus's lambda; FSDP2 cannot
    shard a scalar): DCP refuses the size change, so such a plain-tensor entry (model or optimizer state) becomes a
    0-dim view of itself for the load, which fills the [1] tensor. Returns (container, key, tensor) to put back."""
    from run.safe_load import read_dcp_metadata

    saved = read_dcp_metadata(dcp_dir).state_dict_metadata
    out = []

    def visit(container: dict, prefix: str) -> None:
        for key, value in container.items():
            name = f"{prefix}.{key}"
            if isinstance(value, dict):
                visit(value, name)
            elif isinstance(value, Tensor) and value.shape == (1,) and type(value) is Tensor:
                size = getattr(saved.get(name), "size", None)
                if size is not None and len(size) == 0:
                    out.append((container, key, value))
                    container[key] = value.view(())

    for section in ("model", "optim"):
        visit(state[section], section)
    return out


class DDPEngine(DataParallelEngine):
    """Replicated weights, gradients all-reduced (averaged) once per optimizer step."""

    name = "ddp"

    def parallelize(self, model: Transformer) -> nn.Module:
        return parallelize(model, self.cfg, data_parallel="ddp", device=self.device)

    def no_sync(self, sync: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if sync else cast("DistributedDataParallel", self.wrapped).no_sync()

    def trainable_changed(self) -> None:
        """DDP's reducer (gradient buckets and the autograd hooks that all-reduce them) covers the parameters that
        required grad at wrap time: a new wrapper over the new set. The old reducer removes its hooks when it is
        freed, so each gradient is reduced once. The weights are identical on every rank, and the optimizer holds
        the parameters themselves, so it carries over with its state."""
        old = self.wrapped
        self.wrapped = self.model = apply_ddp(self.raw_model, self.device)
        del old
        gc.collect()


class FSDP2Engine(DataParallelEngine):
    """Parameters, gradients and optimizer state sharded over ranks: ``fully_shard`` per block,
    then the root (embeddings, final norm and the tied head in one unit). bf16 parameters with
    fp32 gradient reduction on CUDA; fp32 on CPU. One device mesh (``parallel_dims``, over the run's
    ``ParallelLayout``): ``train.fsdp2.replicate`` > 1 makes it HSDP (replicate x shard), ``train.parallel.tp`` > 1
    splits heads and MLP columns first (``tensor_parallel``), ``train.parallel.cp`` > 1 splits every sequence over
    the CP ranks (``model.attention.common.context_parallel``: K and V all-gathered per layer), and FSDP2 shards over
    the data-parallel dimensions (CP's included); ``parallelize`` applies them in that order."""

    name = "fsdp2"

    def parallelize(self, model: Transformer) -> nn.Module:
        from pretrain.engines.parallel_dims import ParallelDims

        self.dims = ParallelDims.build(self.layout, self.device.type)
        if self.layout.model_parallel > 1:  # the TP ranks of a replica count once; each CP rank its own targets
            self.data_group = self.dims.data_group()
        param_dtype = None
        if self.amp_dtype is not None and self.device.type == "cuda":
            param_dtype, self.amp_dtype = self.amp_dtype, None  # FSDP2's policy casts; no autocast on top
        wrapped = parallelize(model, self.cfg, dims=self.dims, data_parallel="fsdp", param_dtype=param_dtype)
        # train.float8 tensorwise: the weights all-gather in float8 with scales precomputed for all of them at once
        self.float8_scales = uses_float8_all_gather(model)
        if self.float8_scales:
            precompute_scales(model)
        return wrapped

    def apply_update(self, *, skip: bool = False) -> None:
        super().apply_update(skip=skip)
        if self.float8_scales and not skip:  # the weights changed: the next all-gather's scales, once per step
            precompute_scales(self.raw_model)

    def read_state(self, directory: Path) -> None:
        super().read_state(directory)
        if self.float8_scales:  # the loaded weights' scales
            precompute_scales(self.raw_model)

    def no_sync(self, sync: bool) -> contextlib.AbstractContextManager:
        cast("FSDPModule", self.wrapped).set_requires_gradient_sync(sync)
        return contextlib.nullcontext()

    def trainable_changed(self) -> None:
        """fully_shard copies each sharded parameter's ``requires_grad`` to its gathered (unsharded) form at every
        all-gather and reduce-scatters only the gradients there are, so a new trainable set needs no re-wrap, provided
        the flags sit on the sharded parameters. A group with nothing to train (the root's embeddings during
        centroid-only training) is never resharded after backward, so the trainer set the flags on its gathered
        parameters, which the next all-gather would overwrite: every group is resharded and the flags moved to the
        sharded parameters. What fully_shard derived once, at the first forward, is each group's gradient dtypes
        (None for a group with nothing to train): derived again, so a group unfrozen under a bf16 policy reduces in
        fp32 and hands fp32 gradients to its fp32 shards."""
        from torch.distributed.fsdp import FSDPModule

        flags = {name: p.requires_grad for name, p in self.raw_model.named_parameters()}
        modules = [m for m in self.raw_model.modules() if isinstance(m, FSDPModule)]
        for module in modules:
            module.reshard()
        for name, param in self.raw_model.named_parameters():
            param.requires_grad_(flags[name])
        for module in modules:
            group = module._get_fsdp_state()._fsdp_param_group
            if group is not None:
                group._init_mp_dtypes()
