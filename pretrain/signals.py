"""Preemption: SIGTERM / SIGUSR1 ask the loop to checkpoint and exit at the next step boundary."""

from __future__ import annotations

import signal
from types import FrameType

# EX_TEMPFAIL: the sbatch script requeues the job when the trainer exits with this code.
PREEMPTED_EXIT_CODE = 75
# Written in the run directory (holding the step) once the preemption checkpoint is complete and
# removed when a run starts: torchrun reports any worker's non-zero exit as 1, so a launcher
# behind torchrun (launch/slurm/train.sbatch) reads this file rather than the exit code.
PREEMPTED_MARKER = "preempted"


class PreemptionHandler:
    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = signum

    @property
    def requested(self) -> bool:
        return self.received is not None

    def __enter__(self) -> PreemptionHandler:
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
