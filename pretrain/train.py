"""``python -m pretrain.train --config FILE [--set key=value ...]``: train (or resume) a run."""

from __future__ import annotations

import argparse
import sys

from core import configlib
from core.errors import ConfigError
from run.config import load_run_config


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m pretrain.train", description=__doc__)
    p.add_argument("--config", help="TOML run config (see launch/configs/)")
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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        cfg = load_run_config(args.config, args.overrides)
        if args.dry_run:
            print(cfg.to_toml(), end="")
            return 0
        if args.print_key:
            print(_resolved(cfg, args.print_key))
            return 0
        from pretrain.callbacks import default_callbacks  # heavy imports only once the config is known good
        from pretrain.loop import Trainer

        trainer = Trainer(cfg, callbacks=default_callbacks(cfg))
        trainer.setup()
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        _leave_process_group()
        return 2
    try:
        result = trainer.run()
    except ConfigError as exc:  # data found wanting mid-run; a loader worker's error arrives wrapped in its traceback
        print(f"error: {str(exc).strip().splitlines()[-1]}", file=sys.stderr)
        _leave_process_group()
        return 2
    except BaseException:
        _leave_process_group()  # no barrier: the other ranks may be gone
        raise
    trainer.engine.close()
    return result.exit_code


def _resolved(cfg, key: str) -> str:
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
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
