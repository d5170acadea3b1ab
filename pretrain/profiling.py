"""``profile.*``: a ``torch.profiler`` trace of a few training steps, and CUDA memory snapshots, from inside the loop.

The trace covers steps ``profile.start .. start + steps - 1`` (the step before them warms the profiler up, as
``torch.profiler.schedule``'s warmup does) and is written by ``tensorboard_trace_handler`` under
``<run.dir>/profile/`` as ``<rank>.<time>.pt.trace.json``: TensorBoard's profiler plugin reads the folder, Perfetto
(ui.perfetto.dev) and chrome://tracing read a file. Rank 0 traces unless ``profile.all_ranks``. On CUDA,
``profile.memory_snapshot`` records the allocator's history and dumps it (``memory_rank<N>_*.pickle``, for
pytorch.org/memory_viz) after the traced steps and / or when an out-of-memory error is raised, as torchtitan does.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from pretrain.hooks import Callback, Trainer
from run.config import ProfileConfig

PROFILE_DIR = "profile"
SNAPSHOT_ENTRIES = 100_000  # allocator events kept in the history (torchtitan's default)


class Profiler(Callback):
    """The ``profile.*`` keys as a training-loop callback."""

    def __init__(self, cfg: ProfileConfig):
        self.cfg = cfg
        self.prof: Any = None
        self.out: Path | None = None
        self.snapshots = False

    def _traces(self, trainer: Trainer) -> bool:
        return bool(self.cfg.start) and (self.cfg.all_ranks or trainer.engine.is_main)

    def pre_train(self, trainer: Trainer) -> None:
        self.out = trainer.run_dir / PROFILE_DIR
        cuda = trainer.device.type == "cuda"
        if self.cfg.memory_snapshot != "none" and not cuda:
            if trainer.engine.is_main:
                print(
                    f"note: profile.memory_snapshot={self.cfg.memory_snapshot!r} records CUDA memory; this run is on "
                    f"{trainer.device.type}, so it writes none"
                )
        elif self.cfg.memory_snapshot != "none" and (self.cfg.all_ranks or trainer.engine.is_main):
            self.out.mkdir(parents=True, exist_ok=True)
            torch.cuda.memory._record_memory_history(max_entries=SNAPSHOT_ENTRIES)
            self.snapshots = True
            if self.cfg.memory_snapshot in ("oom", "both"):
                # CUDA builds only (torchtitan's hook for the snapshot at an out-of-memory error)
                torch._C._cuda_attach_out_of_memory_observer(  # type: ignore[attr-defined]
                    lambda *_: self._snapshot(trainer, "oom")
                )

    def pre_step(self, trainer: Trainer) -> None:
        upcoming = trainer.step + 1
        warmup = 1 if self.cfg.start > 1 else 0
        if self.prof is None and self._traces(trainer) and upcoming == self.cfg.start - warmup:
            assert self.out is not None
            self.out.mkdir(parents=True, exist_ok=True)
            activities = [torch.profiler.ProfilerActivity.CPU]
            if trainer.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(
                activities=activities,
                schedule=torch.profiler.schedule(wait=0, warmup=warmup, active=self.cfg.steps, repeat=1),
                on_trace_ready=torch.profiler.tensorboard_trace_handler(
                    str(self.out), worker_name=f"rank{trainer.engine.rank}"
                ),
                record_shapes=True,
                profile_memory=True,
            )
            self.prof.__enter__()

    def post_step(self, trainer: Trainer, record: dict[str, Any]) -> None:
        if self.prof is None:
            return
        self.prof.step()
        if trainer.step >= self.cfg.start + self.cfg.steps - 1:
            self._finish(trainer)

    def post_train(self, trainer: Trainer) -> None:
        self._finish(trainer)  # a run that ended inside the traced steps still writes what it traced
        if self.snapshots:
            torch.cuda.memory._record_memory_history(enabled=None)

    def _finish(self, trainer: Trainer) -> None:
        if self.prof is None:
            return
        prof, self.prof = self.prof, None
        prof.__exit__(None, None, None)
        if self.snapshots and self.cfg.memory_snapshot in ("traced", "both"):
            self._snapshot(trainer, f"steps_{self.cfg.start}-{trainer.step}")
        if trainer.engine.is_main:
            print(f"profile: steps {self.cfg.start}-{trainer.step} traced under {self.out} (TensorBoard, Perfetto)")

    def _snapshot(self, trainer: Trainer, what: str) -> None:
        assert self.out is not None
        file = self.out / f"memory_rank{trainer.engine.rank}_{what}_{time.strftime('%Y%m%d-%H%M%S')}.pickle"
        torch.cuda.memory._dump_snapshot(str(file))
        print(f"profile: CUDA memory snapshot {file} (pytorch.org/memory_viz)")
