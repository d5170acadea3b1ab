"""``python -m tests.e2e.stall_in_save STOP_FILE STEP [pretrain.train arguments]`` under torchrun: ``pretrain.train``,
except that rank 1 stops itself (SIGSTOP, as a hung node would) inside the checkpoint save of step ``STEP``, before it
writes its share, after writing the time of the stop and its pid to ``STOP_FILE``. The test that launches it
(tests/e2e/test_stalled_rank.py) checks that the other rank ends the job within the save's timeout."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path


def main() -> int:
    stop_file, step, argv = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
    from pretrain.loop import Trainer
    from pretrain.train import _exit
    from pretrain.train import main as train

    write = Trainer._write_checkpoint_files

    def stall_then_write(self: Trainer, directory: Path) -> None:
        if self.engine.rank == 1 and self.step == step:
            stop_file.write_text(f"{time.time()} {os.getpid()}\n")
            os.kill(os.getpid(), signal.SIGSTOP)
        write(self, directory)

    Trainer._write_checkpoint_files = stall_then_write  # type: ignore[method-assign]
    _exit(train(argv))
    return 0


if __name__ == "__main__":
    main()
