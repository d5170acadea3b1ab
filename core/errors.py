"""The one error type for bad user input, shared by every package.

A ConfigError's message is a single line that names the offending field
(``data.path``, ``model.n_heads`` ...) and says what is allowed; the CLIs
print it without a traceback and exit with status 2.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable, Iterable
from typing import Any, NoReturn


class ConfigError(ValueError):
    """Invalid configuration or input, detected before any work starts."""


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
    """A CLI's ``main``: a ``ConfigError`` becomes ``error: <line>`` on stderr and exit code 2."""

    @functools.wraps(main)
    def run(*args: Any, **kwargs: Any) -> int:
        try:
            return main(*args, **kwargs) or 0
        except ConfigError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2

    return run
