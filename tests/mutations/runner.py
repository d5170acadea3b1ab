"""``python -m tests.mutations.runner ROOT OUT.json NAME...``: the named mutations of ``table.py``, one after another,
in ONE process, against the copy of the packages in ROOT (first on ``sys.path``).

Per mutation: write the mutated file, drop every project module from ``sys.modules`` (so the next import reads the
copy as it now is), run the test that the table names as its catcher with ``pytest.main``; only if that one passes,
run the mutation's test files (``-x``: up to the first failure); put the file back. A fresh interpreter per mutation
would pay torch's import and pytest's start-up each time: most of the check's cost. Under the name ``(unmutated)``
the pins and every named catcher run on the copy as it is, which must pass, else every mutation would look caught.
OUT gets, per name, the exit code, the first failing test and the output's tail.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import re
import sys
from pathlib import Path

import pytest

PACKAGES = ("core", "model", "data", "run", "pretrain", "eval", "launch", "bench", "tests")
UNMUTATED = "(unmutated)"


def purge() -> None:
    keep = {__name__, "tests", "tests.mutations", "tests.mutations.table"}
    for name in list(sys.modules):
        if name.split(".")[0] in PACKAGES and name not in keep:
            del sys.modules[name]
    importlib.invalidate_caches()


def run(files: list[str]) -> tuple[int, str]:
    purge()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = pytest.main(["-x", "-q", "-m", "not slow", "-p", "no:cacheprovider", *files])
    return int(code), out.getvalue()


def first_failure(output: str) -> str:
    found = re.search(r"^(?:FAILED|ERROR) (\S+)", output, re.MULTILINE)
    return found.group(1) if found else "?"


def main(root: Path, out: Path, names: list[str]) -> None:
    from tests.mutations.table import MUTATIONS

    by_name = {m.name: m for m in MUTATIONS}
    results = {}
    for name in names:
        if name == UNMUTATED:
            code, text = run(sorted({m.tests[0] for m in MUTATIONS} | {m.caught_by for m in MUTATIONS}))
        else:
            mutation = by_name[name]
            path = root / mutation.path
            original = path.read_text()
            src = original
            for fragment, replacement in mutation.edits:
                count = src.count(fragment)
                if count != 1:
                    raise SystemExit(f"{name}: {fragment!r} occurs {count} times in {mutation.path}")
                src = src.replace(fragment, replacement)
            path.write_text(src)
            try:
                code, text = run([mutation.caught_by])
                if code != 1:  # the named test no longer catches it: does anything in the list?
                    code, text = run(list(mutation.tests))
            finally:
                path.write_text(original)
        results[name] = {"code": code, "first": first_failure(text), "tail": text[-3000:]}
        out.write_text(json.dumps(results))  # as it goes: a crash leaves what was done
    purge()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:])
