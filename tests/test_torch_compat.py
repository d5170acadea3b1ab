"""Every package imports on the GPU image's older torch (2.11): each symbol ``core.torch_compat.POST_2_11`` names
is removed from torch before anything of the project is imported, then every module of every package is imported
(issue 36, item 1: the first GPU run could not start because one such import failed)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from core.torch_compat import POST_2_11
from tests.conftest import REPO

PACKAGES = ("core", "model", "data", "run", "eval", "pretrain", "launch", "bench")

SCRIPT = textwrap.dedent(
    """
    import importlib, pkgutil, sys
    removed = {removed!r}
    for module_name, attr in removed:
        module = importlib.import_module(module_name)
        if hasattr(module, attr):
            delattr(module, attr)
    failed = []
    count = 0
    for package in {packages!r}:
        root = importlib.import_module(package)
        for info in pkgutil.walk_packages(root.__path__, package + "."):
            if info.name.endswith("__main__"):
                continue
            count += 1
            try:
                importlib.import_module(info.name)
            except ImportError as exc:
                failed.append(f"{{info.name}}: {{exc}}")
    from core import torch_compat
    from torch.distributed import _functional_collectives as fc
    assert torch_compat.all_gather_single_autograd is fc.all_gather_tensor_autograd, "fallback not taken"
    import contextlib
    assert torch_compat.disable_redistribute_transform_optimization is contextlib.nullcontext, "fallback not taken"
    print(count, "modules")
    if failed:
        print("\\n".join(failed))
        sys.exit(1)
    """
)


def test_every_package_imports_without_the_post_2_11_symbols():
    script = SCRIPT.format(removed=list(POST_2_11), packages=PACKAGES)
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert int(proc.stdout.split()[0]) > 100  # every module was visited, not an empty walk


def test_the_guarded_symbols_exist_on_this_torch():
    import importlib

    for module_name, attr in POST_2_11:
        assert hasattr(importlib.import_module(module_name), attr), f"{module_name}.{attr}: no longer in torch"
