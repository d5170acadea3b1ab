"""Typed configuration: TOML + dotted ``--set`` overrides -> nested dataclasses.

Everything is checked before any work runs: unknown keys (with a near-miss
suggestion), wrong types, and then each section's own ``validate()``. Errors
are one-line ``ConfigError``s that name the dotted key.

A dataclass may expose extra sub-tables whose names are only known at run time
(attention variants register their own option tables) by defining
``config_sections() -> dict[str, dataclass instance]``; fields whose metadata
has ``config=False`` are internal and not part of the file format.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import sys
import types
import typing
from pathlib import Path
from typing import Any

from core.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, as a package (a dependency there)
    import tomli as tomllib


def _public_fields(cls_or_obj: Any) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls_or_obj) if f.metadata.get("config", True)]


def _sections(obj: Any) -> dict[str, Any]:
    getter = getattr(obj, "config_sections", None)
    return getter() if getter is not None else {}


def _suggest(key: str, allowed: list[str]) -> str:
    close = difflib.get_close_matches(key, allowed, n=1, cutoff=0.6)
    return f"did you mean '{close[0]}'? " if close else ""


def _type_name(tp: Any) -> str:
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(
        tp, getattr(tp, "__name__", str(tp))
    )


def _coerce(value: Any, tp: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None and len(options) < len(typing.get_args(tp)):
            return None
        errors = []
        for option in options:
            try:
                return _coerce(value, option, key)
            except ConfigError as exc:
                errors.append(exc)
        raise errors[0]
    if origin in (list, tuple):
        (item_tp, *_) = typing.get_args(tp) or (Any,)
        if isinstance(item_tp, type) and dataclasses.is_dataclass(item_tp):  # an array of tables: [[data.mixture]]
            if not isinstance(value, list):
                raise ConfigError(f"{key}: expected a list of tables, got {value!r}")
            return [from_dict(item_tp, v, f"{key}[{i}].") for i, v in enumerate(value)]
        if isinstance(value, str):  # --set train.freeze=a,b
            value = [v for v in value.split(",") if v]
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return [_coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value):  # nan passes every `<` check a validate() makes, inf most of them
                raise ConfigError(f"{key}: expected a finite number, got {value}")
            return float(value)
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    raise ConfigError(f"{key}: unsupported config type {_type_name(tp)}")


def require_table(data: Any, prefix: str) -> None:
    """``data`` (the value at dotted ``prefix``) must be a table: ``model = 5`` is one line, not a traceback."""
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a table, got {data!r}")


def from_dict(cls: type, data: dict[str, Any], prefix: str = "", base: Any = None) -> Any:
    """Build ``cls`` from ``data``; fields missing from data keep ``base``'s (or the defaults)."""
    require_table(data, prefix)
    obj = base if base is not None else cls()
    data = _move_keys(data, getattr(cls, "moved_keys", {}), prefix)
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in _public_fields(cls)}
    sections = _sections(obj)
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if key in sections:
            section = sections[key]
            sections[key] = from_dict(type(section), value, f"{dotted}.", base=section)
            continue
        if key not in fields:
            allowed = sorted(list(fields) + list(sections))
            raise ConfigError(f"{dotted}: unknown key; {_suggest(key, allowed)}allowed keys: {', '.join(allowed)}")
        tp = hints[key]
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            setattr(obj, key, from_dict(tp, value, f"{dotted}.", base=getattr(obj, key)))
        else:
            setattr(obj, key, _coerce(value, tp, dotted))
    return obj


def _move_keys(data: dict[str, Any], moved: dict[str, str], prefix: str) -> dict[str, Any]:
    """Keys a section renamed (``moved_keys``: old -> new dotted path within the section) are read at
    their new place, with a one-line note on stderr."""
    if not any(old in data for old in moved):
        return data
    data = dict(data)
    for old, new in moved.items():
        if old not in data:
            continue
        value = data.pop(old)
        *tables, leaf = new.split(".")
        target = data
        for table in tables:
            target[table] = dict(target.get(table, {}))
            target = target[table]
        if leaf in target and target[leaf] != value:
            raise ConfigError(f"{prefix}{old}: moved to {prefix}{new}, which is set too; keep only {prefix}{new}")
        target[leaf] = value
        print(f"note: {prefix}{old} is deprecated; use {prefix}{new}", file=sys.stderr)
    return data


def to_dict(obj: Any) -> dict[str, Any]:
    """Dataclass -> the nested dict a TOML file would hold (round-trips through from_dict)."""
    out: dict[str, Any] = {}
    for f in _public_fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            value = to_dict(value)
        elif isinstance(value, list) and value and dataclasses.is_dataclass(value[0]):
            value = [to_dict(v) for v in value]
        out[f.name] = value
    for name, section in _sections(obj).items():
        out[name] = to_dict(section)
    return out


def add_set_argument(parser: Any, help: str = "dotted override, repeatable: --set train.max_steps=200") -> None:
    """The ``--set KEY=VALUE`` option every CLI shares (collected into ``args.overrides``)."""
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=help)


def parse_value(raw: str) -> Any:
    """A ``--set`` value: a TOML literal when it parses (7, 0.1, true, "x", [1, 2]), else the raw string."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def apply_override(data: dict[str, Any], assignment: str) -> None:
    """Apply ``a.b.c=value`` to a nested dict in place."""
    if "=" not in assignment:
        raise ConfigError(f"--set {assignment}: expected key=value, e.g. --set train.max_steps=200")
    key, raw = assignment.split("=", 1)
    parts = [p for p in key.strip().split(".") if p]
    if not parts:
        raise ConfigError(f"--set {assignment}: empty key")
    node = data
    for i, part in enumerate(parts[:-1]):
        nxt = node.setdefault(part, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"{'.'.join(parts[: i + 1])}: is a value, not a table; cannot set {key}")
        node = nxt
    node[parts[-1]] = parse_value(raw.strip())


def load_toml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--config: no such file {str(path)!r}")
    try:
        text = path.read_bytes().decode("utf-8-sig")  # a byte-order mark some editors write is not an error
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"--config: {path} is not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset {exc.start}); "
            "TOML files are UTF-8"
        ) from None
    except OSError as exc:
        raise ConfigError(f"--config: cannot read {path} ({exc.strerror or exc})") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"--config: {path} is not valid TOML: {exc}") from None


def dump_toml(data: dict[str, Any]) -> str:
    import tomli_w

    return tomli_w.dumps(data)
