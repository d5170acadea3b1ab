"""Everything here runs the CLIs end to end (subprocesses, torchrun, SLURM): the slow tier."""

from pathlib import Path

import pytest


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "tests/e2e/" in item.nodeid:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="module")
def root(request, tmp_path_factory) -> Path:
    """A temporary folder the module's tests share, named after the module (test_matrix.py: matrix)."""
    return tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1].removeprefix("test_"))
