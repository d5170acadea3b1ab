"""``python -m pretrain.train --config FILE [--set key=value ...]``: train (or resume) a run.

This module imports only what parsing the command line needs, so signals are caught from the
first moment (torch and the model come in under the handler, see ``main``)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from core import configlib
from core.errors import ConfigError, cli_errors, require
from core.files import atomic_write_text
from pretrain.signals import PREEMPTED_MARKER, Preempted, SignalHandler

if TYPE_CHECKING:
    from run.config import RunConfig


class _HelpConfig(argparse.Action):
    """``--help-config``: every config key with its type, default and meaning, then exit."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        from core.config_help import render
        from run.config import RunConfig

        print(render(RunConfig()))
        parser.exit()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m pretrain.train",
        description=__doc__,
        epilog="The demo: python -m pretrain.train --config launch/configs/tiny.toml. "
        "Every config key: python -m pretrain.train --help-config.",
    )
    # required: without a file every key takes its default, which is a 124M-class run (not a demo)
    p.add_argument("--config", required=True, help="TOML run config (see launch/configs/)")
    p.add_argument("--help-config", action=_HelpConfig, help="list every config key (type, default, meaning) and exit")
    configlib.add_set_argument(p, "dotted override, repeatable: --set train.max_steps=200")
    p.add_argument("--dry-run", action="store_true", help="validate the config, print it resolved and exit")
    p.add_argument(
        "--print",
        dest="print_key",
        metavar="KEY",
        help="validate the config, print one resolved value (e.g. run.dir) and exit",
    )
    p.add_argument(
        "--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS
    )  # passed by the DeepSpeed launcher
    return p.parse_args(argv)


@cli_errors
def main(argv: list[str] | None = None) -> int:
    """Signals are caught for the whole process: before training has progress they stop it at once
    (exit 75, or 130 for Ctrl-C), after it they checkpoint first (pretrain.signals)."""
    args = parse_args(argv)
    with SignalHandler() as signals:
        run_dir = _run_dir_of(args)  # cheap: the requeue marker's place, should a signal come early
        try:
            from run.config import load_run_config  # torch and the model: imported with the signals caught

            cfg = load_run_config(args.config, args.overrides)
            world = int(os.environ.get("WORLD_SIZE", "1"))
            if "WORLD_SIZE" in os.environ:  # under torchrun: the layout and the batch split, before any group
                from run.parallel import check_world

                check_world(cfg.train, world)
            from run.sizes import check_machine

            check_machine(cfg, world)  # sizes against this machine's memory, before anything is built
            if args.dry_run:
                print(cfg.to_toml(), end="")
                return 0
            if args.print_key:
                print(_resolved(cfg, args.print_key))
                return 0
            if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not _is_main_rank():  # one voice per job: rank 0's
                from pretrain.loggers import rank_log

                rank_log(cfg.run_dir, int(os.environ["RANK"]))
            return _train(cfg, signals)
        except ConfigError as exc:  # a loader worker's error arrives wrapped in its traceback: its last line
            print(f"error: {str(exc).strip().splitlines()[-1]}", file=sys.stderr)
            _leave_process_group()
            return 2
        except Preempted as exc:
            return _preempted_before_training(exc, signals, run_dir)
        except OSError as exc:  # the file system said no (a full disk during a checkpoint, a read-only run.dir)
            where = f" ({exc.filename})" if exc.filename else ""
            print(f"error: run.dir: {exc.strerror or exc}{where}", file=sys.stderr)
            _leave_process_group()
            return 2
        except BaseException:
            _leave_process_group()  # no barrier: the other ranks may be gone
            raise


def _train(cfg: RunConfig, signals: SignalHandler) -> int:
    if cfg.train.engine == "deepspeed":  # the optional packages the run needs, one line each before any work
        require("deepspeed", "train.engine = deepspeed")
    if cfg.eval.tasks:
        require("lm_eval", "eval.tasks")
    if cfg.train.float8 != "none":
        require("torchao", "train.float8")
    from pretrain.callbacks import default_callbacks  # heavy imports only once the config is known good
    from pretrain.loop import Trainer

    trainer = Trainer(cfg, callbacks=default_callbacks(cfg), signals=signals)
    trainer.setup()
    result = trainer.run()
    if result.error and trainer.stalled_ranks is not None:
        # tearing the process group down would wait on the stopped rank: leave at once, torchrun stops the others
        print(f"error: {result.error}", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(result.exit_code)
    if result.error:
        print(f"error: {result.error}", file=sys.stderr)
        _leave_process_group()
        return result.exit_code
    trainer.engine.close()
    return result.exit_code


def _preempted_before_training(exc: Preempted, signals: SignalHandler, run_dir: Path | None) -> int:
    """A signal during set-up: nothing to save. A preemption still leaves the requeue marker."""
    if signals.interrupted:
        print(f"interrupted ({exc}) before training started: nothing to save", file=sys.stderr)
    else:
        print(f"preemption signal ({exc}) before training started: nothing to save; requeue", file=sys.stderr)
        if run_dir is not None and _is_main_rank():
            run_dir.mkdir(parents=True, exist_ok=True)
            atomic_write_text(run_dir / PREEMPTED_MARKER, "0\n")
    _leave_process_group()
    return signals.exit_code


def _run_dir_of(args: argparse.Namespace) -> Path | None:
    """run.dir from the file and the overrides alone (no validation, no heavy imports)."""
    try:
        data = configlib.load_toml(args.config)
        for assignment in args.overrides:
            configlib.apply_override(data, assignment)
        return Path(data.get("run", {}).get("dir", "runs/default"))
    except (ConfigError, OSError, AttributeError, TypeError):
        return None  # the full load says what is wrong


def _is_main_rank() -> bool:
    return os.environ.get("RANK", "0") == "0"


def _resolved(cfg: RunConfig, key: str) -> str:
    if key == "run.dir":
        return str(cfg.run_dir.resolve())
    value = cfg.to_dict()
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            raise ConfigError(f"--print: no config key {key!r}")
        value = value[part]
    if isinstance(value, dict):
        raise ConfigError(f"--print: {key!r} is a section, not a value")
    return str(value)


def _leave_process_group() -> None:
    """Destroy the process group before the interpreter tears down: gloo work still holding
    tensors at finalisation aborts the process (SIGABRT) instead of exiting with our code."""
    dist = sys.modules.get("torch.distributed")  # never import it here: a signal may have cut torch's import short
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _exit(code: int) -> None:
    """A worker of a distributed run leaves without the interpreter's teardown: gloo and DeepSpeed keep C++ threads
    whose destructors can abort a finished process ("terminate called without an active exception", SIGABRT), so
    torchrun reports a failure after a complete run. By now every file is written and closed and the group is gone.
    Error exits keep the normal path: every rank's one-line message is printed before torchrun stops the others."""
    if code == 0 and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    _exit(main())
