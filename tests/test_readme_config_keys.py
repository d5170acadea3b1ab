"""The README's config-key table against the config schema that ``--help-config`` prints (core/config_help.py
``describe(RunConfig())``): every key has a row, and every key a row names exists. Keys are derived from the
schema, so a new section (``[train.parallel]``, say) fails here until the README names it."""

from __future__ import annotations

import fnmatch
import re

from tests.conftest import REPO

TABLE_START = "Config keys (the stable ones"
_CODE = re.compile(r"`([^`]+)`")


def _without_parentheses(cell: str) -> str:
    """A cell's text outside (...): values and notes, not keys (``model.rope.scaling`` (``none``, ...))."""
    out, depth = [], 0
    for ch in cell:
        depth += ch == "("
        if depth == 0:
            out.append(ch)
        depth -= ch == ")" and depth > 0
    return "".join(out)


def table_keys(readme: str) -> list[str]:
    """The keys of the table's first column, in order. A bare name after a dotted key shares its parent
    (``model.rope.beta_fast`` / ``beta_slow`` names ``model.rope.beta_slow``); ``<kind>`` and ``*`` are
    wildcards."""
    lines = readme.split(TABLE_START, 1)[1].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| key"))
    keys: list[str] = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        parent = ""
        for token in _CODE.findall(_without_parentheses(line.split("|")[1])):
            if "." in token:
                keys.append(token)
                parent = token.rsplit(".", 1)[0] + "."
            else:
                assert parent, f"README config table: {token!r} is not a dotted key"
                keys.append(parent + token)
    return keys


def schema_keys() -> list[str]:
    from core.config_help import describe
    from run.config import RunConfig

    return [key for key, _, _, _ in describe(RunConfig())]


def _matches(pattern: str, key: str) -> bool:
    return fnmatch.fnmatchcase(key, pattern.replace("<kind>", "*"))


def test_readme_config_table_names_every_schema_key_and_no_other():
    listed = table_keys((REPO / "README.md").read_text(encoding="utf-8"))
    schema = schema_keys()
    missing = [key for key in schema if not any(_matches(p, key) for p in listed)]
    unknown = [p for p in listed if not any(_matches(p, key) for key in schema)]
    assert not missing, f"README.md's config-key table lacks {missing} (python -m pretrain.train --help-config)"
    assert not unknown, f"README.md's config-key table names {unknown}, which the config schema does not have"


def test_the_parser_reads_shorthand_wildcards_and_skips_values():
    readme = (
        f"{TABLE_START}:\n\n| key | meaning |\n| --- | --- |\n"
        "| `a.b` (`x`, `y.z`), `a.c.d` / `e` | one |\n| `m.<kind>.*` | two |\n\nafter `q.r`\n"
    )
    assert table_keys(readme) == ["a.b", "a.c.d", "a.c.e", "m.<kind>.*"]
    assert _matches("m.<kind>.*", "m.focus.window") and not _matches("a.b", "a.bc")
