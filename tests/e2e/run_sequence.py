"""``python -m tests.e2e.run_sequence SPEC.json`` (alone, or under torchrun on every rank): several training runs on
``launch/configs/tiny.toml`` one after another in this process, so a test matrix pays for the interpreter, its
imports and the process group once per launch rather than once per run.

SPEC: ``{"runs": {name: [["--config", FILE], ["--copy-run", DIR], "--set", "key=value", ...]}, "status": path}``
(FILE: tiny.toml unless given; a derived ``<preset>_<variant>.toml`` works as with ``pretrain.train``; DIR: a run
directory, usually an earlier run's of the same launch, that rank 0 copies to ``run.dir`` first, so a run stopped
under one layout resumes under another in the same launch; or one of its checkpoints, ``DIR/checkpoints/step_N``:
the run directory as it stood after that checkpoint, the later ones left out, so a run resumes from an
uninterrupted run's middle). Each run is what ``pretrain.train`` does
(the standard callbacks, checkpoints, ``train.stop_at``, resume from the run directory's latest checkpoint),
except that the process group stays up between runs. Rank 0 writes ``{name: "ok" | the error's last line}`` to
the status file after every run, so one failing run is named and the ones after it still run, and each run's
wall seconds to ``<status>.seconds.json`` beside it (where a launch's time goes: docs/testing.md).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback
from pathlib import Path

from core import collector
from tests.e2e.test_train_cli import TINY


def _train(args: list[str]) -> None:
    import torch

    from pretrain.loop import Trainer
    from run.config import load_run_config

    pairs = list(zip(args[::2], args[1::2]))
    config = next((value for flag, value in pairs if flag == "--config"), TINY)
    cfg = load_run_config(config, [value for flag, value in pairs if flag == "--set"])
    copy = next((value for flag, value in pairs if flag == "--copy-run"), None)
    if copy is not None:
        _copy_run(Path(copy), Path(cfg.run.dir))
    torch._dynamo.reset()  # each run compiles its own blocks afresh (no recompile limit across runs)
    trainer = Trainer(cfg)
    trainer.setup()
    result = trainer.run()
    if result.error or result.exit_code:
        raise RuntimeError(result.error or f"exit code {result.exit_code}")


def copy_run(source: Path, dest: Path) -> None:
    """``source`` (a run directory) copied to ``dest``; a checkpoint as ``source``, ``RUN/checkpoints/step_N``: its
    run directory as it stood after that checkpoint, the later checkpoints left out."""
    import shutil

    if source.parent.name != "checkpoints":
        shutil.copytree(source, dest)
        return
    checkpoints = source.parent

    def later(folder: str, names: list[str]) -> list[str]:  # step_%08d: zero-padded, so names sort as steps
        return [n for n in names if Path(folder) == checkpoints and n.startswith("step_") and n > source.name]

    shutil.copytree(checkpoints.parent, dest, ignore=later)


def _copy_run(source: Path, dest: Path) -> None:
    """Rank 0 runs ``copy_run``; the others wait for it (the process group of the earlier runs)."""
    import torch.distributed as dist

    if dist.is_initialized():
        if dist.get_rank() == 0:
            copy_run(source, dest)
        dist.barrier()
    elif int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise RuntimeError("--copy-run under torchrun needs an earlier run in the launch (its process group)")
    else:
        copy_run(source, dest)


def main(spec_path: str) -> int:
    # as pretrain.train's main (cli_errors) does; torch itself came with this module's imports (two cheap full
    # collections), its compiler stack, where the costly ones were, comes with the first run
    collector.for_programs()
    import torch.distributed as dist

    spec = json.loads(Path(spec_path).read_text())
    status: dict[str, str] = {}
    seconds: dict[str, float] = {}
    for name, args in spec["runs"].items():
        start = time.perf_counter()
        try:
            _train(args)
            status[name] = "ok"
        except Exception as exc:  # named in the status; the next run still runs
            last = (str(exc).strip().splitlines() or [type(exc).__name__])[-1]
            status[name] = f"{type(exc).__name__}: {last}"
            traceback.print_exc()
        # what survives a run (modules, caches) is never rescanned: without this, each later run's full
        # collections walked every earlier run's survivors (the matrix's 18 single-process runs, with the
        # thresholds above: 6.6-7.4 -> 4.2-4.6 s)
        gc.collect()
        gc.freeze()
        seconds[name] = round(time.perf_counter() - start, 2)
        if not dist.is_initialized() or dist.get_rank() == 0:
            Path(spec["status"]).write_text(json.dumps(status, indent=1))
            Path(spec["status"]).with_suffix(".seconds.json").write_text(json.dumps(seconds, indent=1))
        if dist.is_initialized():
            dist.barrier()
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
