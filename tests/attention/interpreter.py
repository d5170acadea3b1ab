"""Triton kernels tested on CPU tensors: ``TRITON_INTERPRET=1`` must be set before triton is imported, so a test file
runs its kernel tests in a child pytest over itself. ``@interpreted`` tests exist only in that child, ``@parent`` ones
only in the ordinary run (a module attribute of None is not collected: no skip is reported in either)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable

import pytest

from tests.conftest import REPO

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@pytest.fixture(scope="module", autouse=True)
def numpy_scalars():
    """Triton 3.6's interpreter converts a scalar (a one-element array) to an int with ``int(array)``, which numpy 2.4
    refuses (triton-lang/triton#9171, fixed after 3.6); a loop bound from ``program_id`` or an argument needs it: take
    the element explicitly while a module that imports this fixture runs."""
    if not INTERPRETED:
        yield
        return
    from triton.runtime import interpreter as interp

    original = interp._patch_lang_tensor

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(interp, "_patch_lang_tensor", patch_lang_tensor)
        yield


def interpreted(test: Callable[..., None]) -> Callable[..., None] | None:
    return test if INTERPRETED else None


def parent(test: Callable[..., None]) -> Callable[..., None] | None:
    return None if INTERPRETED else test


def run_child(path: str, marker: str | None = None, *, timeout: int = 900) -> None:
    """The interpreted tests of test file ``path`` (``-m marker`` when given) in a child pytest: all pass, none skip."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist"]
    cmd += [*(["-m", marker] if marker else []), path]
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-20000:] + result.stderr[-5000:]
    last = result.stdout.splitlines()[-1]
    assert " passed" in last and " skipped" not in last, result.stdout[-5000:]
