"""The engine protocol: the one place that knows how a model is wrapped, stepped and saved.

The loop calls the same few methods whatever the engine: ``micro_step`` for
forward+backward (gradient sync only on the last micro-batch), ``optimizer_step``
(clip, step, schedule), ``write_state`` / ``read_state`` for checkpoints, and
``all_reduce_sum`` for global counts. Implementations: ``single.py``, ``parallel.py``
(ddp, fsdp2), ``deepspeed.py``; the registry is ``pretrain.engines``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from core.device import autocast_dtype
from model.attention.common.context_parallel import ContextParallel, shard_batch
from model.attention.common.sdpa import sdpa_backends
from model.transformer import Transformer
from pretrain.engines.parallelize import parallelize
from pretrain.optim import build_optimizer, build_scheduler
from run.parallel import ParallelLayout

if TYPE_CHECKING:
    from run.config import TrainConfig


@dataclass
class MicroStepOut:
    loss_sum: Tensor  # detached summed token loss of this micro-batch
    n_tokens: int
    aux_loss: Tensor | None = None  # detached
    stats: dict[str, Tensor] = field(default_factory=dict)


class Engine:
    name = ""
    rank = 0
    world_size = 1
    # the processes' layout (dp_replicate x dp_shard x cp x tp): one process unless a data-parallel engine sets it;
    # every degree, rank and product below is read off it
    layout = ParallelLayout()
    # context parallelism: this rank's CP group (set by ``parallelize``); None = every rank takes whole sequences.
    # Every CP rank of a replica loads the same windows and keeps its chunks of them (``local_batch``).
    context_parallel: ContextParallel | None = None

    def __init__(self, model: Transformer, cfg: TrainConfig, device: torch.device):
        """The one set-up every engine goes through; engines change it by overriding the hooks below."""
        self.cfg = cfg
        self.device = device
        self.raw_model = model
        self.amp_dtype = self.autocast_dtype()
        # TP, CP, activation checkpointing, compile, then the data-parallel wrap, before the optimizer sees the
        # parameters (pretrain.engines.parallelize)
        self.wrapped = self.parallelize(model)
        # train.float8: the conversion's one line (what converted, what stayed high precision), for the trainer's log
        self.float8_summary: str | None = getattr(model, "float8_summary", None)
        self.context_parallel = model.context_parallel
        self.model: nn.Module = self.wrapped
        self.optimizer, self.scheduler = self.make_optimizer(model)

    # ---- set-up hooks -----------------------------------------------------------------
    def autocast_dtype(self) -> torch.dtype | None:
        """The forward's autocast dtype; None = none (full fp32, or the engine casts itself)."""
        return autocast_dtype(self.cfg.precision, self.device)

    def parallelize(self, model: Transformer) -> nn.Module:
        """The module the forward runs through: ``parallelize`` with what this engine applies (by default activation
        checkpointing and compile only, no wrap)."""
        return parallelize(model, self.cfg)

    def make_optimizer(self, model: Transformer) -> tuple[Any, Any]:
        """(optimizer, LR scheduler) over the (wrapped) model's parameters."""
        optimizer = build_optimizer(model, self.cfg, self.device)
        return optimizer, build_scheduler(optimizer, self.cfg)

    def trainable_changed(self) -> None:
        """The trainable set changed after wrapping (``train.unfreeze_at``, or a resume across it): rebuild what the
        wrapping derived from ``requires_grad``. Only engines whose spec declares ``changes_trainable`` are asked;
        nothing to do in one process (frozen parameters stay in the optimizer with no gradient)."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

    def attention_backends(self) -> contextlib.AbstractContextManager:
        """The training forward's SDPA backends on CUDA, in ``train.sdpa_backend``'s priority (``sdpa_backends``)."""
        return sdpa_backends(self.cfg.sdpa_backend, self.device.type)

    def no_sync(self, sync: bool) -> contextlib.AbstractContextManager:
        """Skip gradient synchronisation on all but the last micro-batch (data-parallel engines)."""
        return contextlib.nullcontext()

    @property
    def grad_average_ranks(self) -> int:
        """Data-parallel engines average gradients over ranks (FSDP2 over ``dp x cp``); the loss is scaled up by this
        so the update is the gradient of (global token loss sum / global target tokens) on every engine."""
        return self.layout.dp_cp

    @property
    def data_rank(self) -> int:
        """The data-parallel rank: the loader's index (the TP / CP ranks of a replica share it)."""
        return self.layout.coordinates(self.rank).dp

    @property
    def data_world_size(self) -> int:
        return self.layout.dp

    @property
    def tp_size(self) -> int:
        """A variant's aux loss is computed alike on every TP rank and its gradients summed over them, so each rank
        adds 1 / tp of it."""
        return self.layout.tp

    @property
    def cp_size(self) -> int:
        """The context-parallel degree: a micro-batch's targets are split over this many ranks."""
        return self.layout.cp

    def local_batch(self, inputs: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
        """This rank's share of a micro-batch's [B, T] inputs and targets: all of it, or under context parallelism
        the CP rank's two chunks of every sequence (the model derives their global positions itself)."""
        if self.context_parallel is None:
            return inputs, targets
        inputs, targets = shard_batch(self.context_parallel, inputs, targets)
        return inputs, targets

    def micro_step(
        self, inputs: Tensor, targets: Tensor, *, loss_scale: float, aux_scale: float, sync: bool
    ) -> MicroStepOut:
        """Forward + backward of one micro-batch. The LM loss is ``loss_sum * loss_scale``
        (1 / global target tokens of the step), so accumulation equals one large batch. ``inputs`` and ``targets``
        are the whole windows; under context parallelism this rank keeps its chunks (``local_batch``)."""
        inputs, targets = self.local_batch(inputs, targets)
        inputs, targets = inputs.to(self.device, non_blocking=True), targets.to(self.device, non_blocking=True)
        with self.no_sync(sync):
            with self.autocast(), self.attention_backends():
                out = self.model(inputs, targets=targets, return_logits=False)
            loss = out.loss_sum * (loss_scale * self.grad_average_ranks)
            if out.aux_loss is not None:
                loss = loss + out.aux_loss * (aux_scale / self.tp_size)
            loss.backward()
        aux = out.aux_loss.detach() if out.aux_loss is not None else None
        return MicroStepOut(out.loss_sum.detach(), out.n_tokens, aux, out.stats)

    def clip_gradients(self, grad_clip: float) -> Tensor:
        """Clip (or just measure, grad_clip 0) the gradient norm; the pre-clip norm as a device tensor
        (reading it is a host sync). Every rank gets the same norm."""
        params = [p for p in self.raw_model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else float("inf"))
        full = getattr(norm, "full_tensor", None)  # a DTensor norm under FSDP2
        return (full() if full else norm).detach()

    def apply_update(self, *, skip: bool = False) -> None:
        """Step the optimizer (unless ``skip``: a non-finite step leaves the weights and the optimizer
        state alone) and the schedule, and clear the gradients."""
        if not skip:
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

    def optimizer_step(self, grad_clip: float) -> Tensor:
        """Clip, step the optimizer and the schedule; the pre-clip norm."""
        norm = self.clip_gradients(grad_clip)
        self.apply_update()
        return norm

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def all_reduce_sum(self, value: Tensor) -> Tensor:
        return value

    def all_reduce_data_sum(self, value: Tensor) -> Tensor:
        """A per-replica quantity (token counts, loss sums) summed over the data-parallel (and CP) ranks: the TP
        ranks of one replica hold the same value, so they count once."""
        return self.all_reduce_sum(value)

    def barrier(self) -> None:
        pass

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        return obj

    def gather_object(self, obj: Any) -> list:
        """Every rank's ``obj``, in rank order (on every rank)."""
        return [obj]

    def close(self) -> None:
        pass

    # ---- stalled ranks -----------------------------------------------------------------
    def set_collective_timeout(self, seconds: float) -> None:
        """How long a collective waits for the other ranks (nothing to wait for in one process)."""

    def heartbeat(self, step: int) -> None:
        """Record that this rank reached ``step`` where the other ranks can read it."""

    def stalled(self) -> str | None:
        """After a collective failed: a phrase naming the rank(s) that stopped answering, if one can tell."""
        return None

    def end_stalled(self) -> None:
        """End the processes of the ranks ``stalled`` named, where this rank can (the job is ending)."""

    # ---- checkpoint state -----------------------------------------------------------
    def write_state(self, directory: Path) -> None:
        raise NotImplementedError

    def read_state(self, directory: Path) -> None:
        raise NotImplementedError
