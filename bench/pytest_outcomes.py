"""A pytest plugin (``-p bench.pytest_outcomes``) for ``bench.gpu``'s test item: each test's outcome is appended to
the file ``BENCH_PYTEST_OUTCOMES`` names, one JSON line as soon as it is known, so that a run the suite's budget
cuts off still counts the tests it finished."""

from __future__ import annotations

import json
import os

import pytest

OUTCOMES_ENV = "BENCH_PYTEST_OUTCOMES"


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    path = os.environ.get(OUTCOMES_ENV)
    # one line per test: its call, or the setup that failed or skipped it, or a failing teardown (an error)
    if not path or not (report.when == "call" or report.outcome != "passed"):
        return
    outcome: str = report.outcome if report.when == "call" or report.outcome == "skipped" else "error"
    with open(path, "a") as f:
        f.write(json.dumps({"id": report.nodeid, "outcome": outcome}) + "\n")
