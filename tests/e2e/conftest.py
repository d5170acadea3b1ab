"""Everything here runs the CLIs end to end (subprocesses, torchrun, SLURM): the slow tier."""

import pytest


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "tests/e2e/" in item.nodeid:
            item.add_marker(pytest.mark.slow)
