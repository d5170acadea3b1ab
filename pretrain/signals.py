"""Signals over the whole life of a training process.

SIGTERM / SIGUSR1 (SLURM preemption) and SIGINT (Ctrl-C) are caught from the moment
``pretrain.train`` starts. Before training has progress to lose (config, data, model set-up) a
signal stops the process at once with ``Preempted``; once the trainer calls ``defer()`` a signal
only sets a flag that the loop reads at step boundaries (and the end-of-run callbacks between
their pieces of work), so the run checkpoints and exits cleanly.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from types import FrameType
from typing import Any

# EX_TEMPFAIL: the sbatch script requeues the job when the trainer exits with this code.
PREEMPTED_EXIT_CODE = 75
# Ctrl-C: the shell's convention (128 + SIGINT); no requeue marker.
INTERRUPTED_EXIT_CODE = 130
# Written in the run directory (holding the step) once the preemption checkpoint is complete and
# removed when a run starts: torchrun reports any worker's non-zero exit as 1, so a launcher
# behind torchrun (launch/slurm/train.sbatch) reads this file rather than the exit code.
PREEMPTED_MARKER = "preempted"


class Preempted(Exception):
    """A signal before the trainer had anything to save."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class SignalHandler:
    PREEMPT = (signal.SIGTERM, signal.SIGUSR1)
    SIGNALS = (*PREEMPT, signal.SIGINT)

    def __init__(self, *, deferred: bool = False) -> None:
        self.received: int | None = None
        self.deferred = deferred
        self._previous: dict[int, Callable[[int, FrameType | None], Any] | int | None] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = signum
        if not self.deferred:
            raise Preempted(signum)

    def defer(self) -> None:
        """From now on a signal only asks to stop at the next safe point."""
        self.deferred = True

    @property
    def requested(self) -> bool:
        return self.received is not None

    @property
    def interrupted(self) -> bool:
        """Ctrl-C rather than a preemption: no requeue."""
        return self.received == signal.SIGINT

    @property
    def exit_code(self) -> int:
        return INTERRUPTED_EXIT_CODE if self.interrupted else PREEMPTED_EXIT_CODE

    def describe(self) -> str:
        return "" if self.received is None else signal.Signals(self.received).name

    def __enter__(self) -> SignalHandler:
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            # None: a handler installed outside Python, which cannot be put back; the default then
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
