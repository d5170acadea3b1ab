"""The one error type for bad user input, shared by every package.

A ConfigError's message is a single line that names the offending field
(``data.path``, ``model.n_heads`` ...) and says what is allowed; the CLIs
print it without a traceback and exit with status 2.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import sys
from collections.abc import Callable, Iterable
from typing import Any, NoReturn

from core import collector


class ConfigError(ValueError):
    """Invalid configuration or input, detected before any work starts."""


# The optional packages by import name, and the extra of setup.cfg that installs each (a journey each: hf for the
# Hugging Face export / import, eval for lm-eval tasks, ...); tests/test_extras.py keeps this table and setup.cfg equal.
EXTRAS = {
    "transformers": "hf",
    "lm_eval": "eval",
    "accelerate": "eval",
    "deepspeed": "deepspeed",
    "flash_attn": "flash",
    "torchao": "float8",
}


class MissingExtra(ConfigError):
    """An optional package is not installed: one line naming the extra that installs it."""


def install_hint(extra: str) -> str:
    return f"pip install -e '.[{extra}]'"


def missing_extra(module: str, needed_for: str = "") -> MissingExtra:
    """The one-line error for optional ``module`` (an import name of ``EXTRAS``, or a submodule of one)."""
    top = module.split(".")[0]
    hint = install_hint(EXTRAS[top])
    if needed_for:
        return MissingExtra(f"{needed_for} needs {top}, which is not installed: {hint}")
    return MissingExtra(f"{top} is not installed: {hint}")


def require(module: str, needed_for: str) -> None:
    """Stop with one line naming the extra when optional ``module`` is not installed (it is not imported here)."""
    if importlib.util.find_spec(module.split(".")[0]) is None:
        raise missing_extra(module, needed_for)


def optional_import_error(exc: BaseException) -> MissingExtra | None:
    """``exc`` as a missing extra when it is an import of one of ``EXTRAS`` that failed for want of the package."""
    if isinstance(exc, ModuleNotFoundError) and (exc.name or "").split(".")[0] in EXTRAS:
        return missing_extra(exc.name or "")
    return None


class OneLineParser(argparse.ArgumentParser):
    """The CLIs' argument parser: a usage error is one line, ``error: PROG: message`` (``error: message`` with
    ``name_prog=False``), and exit status 2; argparse's default also prints the usage."""

    def __init__(self, *args: Any, name_prog: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.name_prog = name_prog

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {self.prog}: {message}\n" if self.name_prog else f"error: {message}\n")


def check_choice(key: str, value: object, allowed: Iterable[object]) -> None:
    """``key`` must be one of ``allowed``."""
    allowed = tuple(allowed)
    if value not in allowed:
        raise ConfigError(f"{key}: {value!r} is not one of {', '.join(map(str, allowed))}")


def check_min(key: str, value: float, minimum: float, *, strict: bool = False, note: str = "") -> None:
    """``key`` must be >= ``minimum`` (or > with ``strict``)."""
    if value < minimum or (strict and value == minimum):
        raise ConfigError(f"{key}: must be {'>' if strict else '>='} {minimum}{note}, got {value}")


def check_range(
    key: str, value: float, low: float, high: float, *, open_low: bool = False, open_high: bool = False
) -> None:
    """``key`` must lie in the interval from ``low`` to ``high`` (closed unless said open)."""
    if value < low or value > high or (open_low and value == low) or (open_high and value == high):
        interval = f"{'(' if open_low else '['}{low}, {high}{')' if open_high else ']'}"
        raise ConfigError(f"{key}: must be in {interval}, got {value}")


def cli_errors(main: Callable[..., int | None]) -> Callable[..., int]:
    """A CLI's ``main``: a ``ConfigError``, or an optional package of ``EXTRAS`` found missing on import, becomes
    ``error: <line>`` on stderr (the latter naming the extra to install) and exit code 2. The program runs under
    the programs' garbage-collector thresholds (``core.collector``), set before its imports."""

    @functools.wraps(main)
    def run(*args: Any, **kwargs: Any) -> int:
        collector.for_programs()
        try:
            return main(*args, **kwargs) or 0
        except ConfigError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        except ModuleNotFoundError as exc:
            missing = optional_import_error(exc)
            if missing is None:
                raise
            print(f"error: {missing}", file=sys.stderr)
            return 2

    return run
