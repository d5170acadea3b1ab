"""``python -m launch.torchrun ARGS``: torchrun (``torch.distributed.run``, same arguments) whose preemption ends as
the trainer's does: exit 75 and the trainer's one line, not torchrun's traceback and exit 1.

On SIGTERM or SIGUSR1 (a SLURM preemption, ``kill`` of ``launch/torchrun.sh``) torchrun's own handler raises
``SignalException`` in the launcher, kills the workers after its shutdown grace and prints a 25-line traceback; the
workers' exit codes are lost. Here those two signals are ours (torchrun's ``--signals-to-handle`` names the others):
each is forwarded to the workers, which save at the next step boundary and exit 75 (``pretrain.signals``); torchrun
then reports them as failed children, and when every failure is that exit the launcher exits 75 quietly. Anything
else (a worker's real failure, Ctrl-C) is torchrun's as before.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from pathlib import Path
from types import FrameType

PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
PREEMPTED_EXIT_CODE = 75  # pretrain.signals.PREEMPTED_EXIT_CODE (not imported: the launcher loads no trainer code)
# torchrun's default set (torch.distributed.elastic.multiprocessing.api) less SIGTERM, which this launcher handles
TORCHRUN_SIGNALS = "SIGINT,SIGHUP,SIGQUIT"


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (torchrun starts each worker in its own session, so no process group
    reaches them all)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "(comm)", which may hold spaces
        except (OSError, IndexError):
            continue  # gone meanwhile
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    received: list[int] = []

    def forward(signum: int, frame: FrameType | None) -> None:
        if not received:  # torchrun's log lines about the workers' exit would follow the trainer's one line
            logging.disable(logging.ERROR)  # a real failure still raises, with its table of failed workers
        received.append(signum)
        workers = _children(os.getpid())
        if not workers:  # none started yet, so nothing to save: the signal's default action, as without this
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        for pid in workers:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    for sig in PREEMPT_SIGNALS:
        signal.signal(sig, forward)
    argv = sys.argv[1:] if argv is None else argv
    try:
        torchrun([f"--signals-to-handle={TORCHRUN_SIGNALS}", *argv])  # given again in argv, the user's wins
    except ChildFailedError as exc:
        codes = {failure.exitcode for failure in exc.failures.values()}
        if received and codes == {PREEMPTED_EXIT_CODE}:
            return PREEMPTED_EXIT_CODE
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
