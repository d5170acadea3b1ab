"""Every config key with its type, default and meaning, generated from the config dataclasses.

The meaning is the field's own comment in the source (the comment lines right above it and the
trailing ``# ...`` on its line), so documentation and defaults cannot drift apart; a test requires
one for every key.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import typing
from typing import Any

_FIELD = re.compile(r"^\s+(\w+)\s*:\s*[^=#]+(?:=[^#]*)?(?:#\s?(.*))?$")


def _comments(cls: type) -> dict[str, str]:
    """field name -> its comment, for ``cls`` and its dataclass bases."""
    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            lines = inspect.getsource(klass).splitlines()
        except (OSError, TypeError):
            continue
        above: list[str] = []  # the comment lines right above a field
        for n, line in enumerate(lines[1:], 1):
            stripped = line.strip()
            if stripped.startswith("#"):
                if not stripped.lstrip("# ").startswith("----"):  # a section divider describes no field
                    above.append(stripped.lstrip("#").strip())
                continue
            match = _FIELD.match(line)
            if match and not stripped.startswith(("def ", "@", "return")):
                own = match.group(2) or ""
                if not own and stripped.endswith("("):  # a default spread over lines: its first comment
                    own = next((x.split("#", 1)[1].strip() for x in lines[n + 1 : n + 4] if "#" in x), "")
                text = " ".join([*above, own]).strip()
                if text:
                    out[match.group(1)] = text
            above = []
    return out


def _type_name(tp: Any) -> str:
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


def _public(obj: Any) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(obj) if f.metadata.get("config", True)]


def describe(obj: Any, prefix: str = "") -> list[tuple[str, str, Any, str]]:
    """(dotted key, type, default, meaning) for every key of the config ``obj`` (an instance)."""
    rows: list[tuple[str, str, Any, str]] = []
    hints = typing.get_type_hints(type(obj))
    comments = _comments(type(obj))
    for f in _public(obj):
        value = getattr(obj, f.name)
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            rows += describe(value, f"{key}.")
        else:
            rows.append((key, _type_name(hints.get(f.name, type(value))), value, comments.get(f.name, "")))
    sections = getattr(obj, "config_sections", None)
    for name, section in (sections() if sections else {}).items():
        rows += describe(section, f"{prefix}{name}.")
    return rows


def render(obj: Any) -> str:
    """One line per key: ``key (type, default value): meaning``."""
    lines = []
    for key, tp, default, meaning in describe(obj):
        lines.append(f"{key} ({tp}, default {default!r})" + (f": {meaning}" if meaning else ""))
    return "\n".join(lines)
