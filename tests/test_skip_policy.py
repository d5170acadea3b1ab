"""The skip policy of tests/conftest.py: locally a missing dependency or data folder skips; under CI it fails with
one line naming what is missing; a test marked ``cuda`` skips without a CUDA device either way."""

from __future__ import annotations

import pytest
import torch

import tests.conftest

CONFTEST = "from tests.conftest import pytest_configure, pytest_make_collect_report, pytest_runtest_makereport"
CONFTEST += ", pytest_runtest_setup, shared_data\n"
MISSING = "focused_pretrain_absent_dependency"
FILES = {
    "test_dependency": f"import pytest\npytest.importorskip({MISSING!r})\n\ndef test_a():\n    pass\n",
    "test_tree": (
        "import pytest\n\n"
        "def test_data(shared_data):\n    pass\n\n"
        "@pytest.mark.cuda\ndef test_gpu():\n    pass\n\n"
        "def test_plain():\n    pass\n"
    ),
}


@pytest.fixture
def tree(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, tmp_path) -> pytest.Pytester:
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(**FILES)
    monkeypatch.setattr(tests.conftest, "SHARED", tmp_path / "moved")  # the data folder is not where it should be
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the cuda-marked test skips on any machine
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")  # third-party plugins cost a second per inner run
    return pytester


@pytest.mark.parametrize("ci", ["", "0", "false"])
def test_locally_missing_things_skip(tree, monkeypatch, ci):
    monkeypatch.setenv("CI", ci)
    tree.runpytest("-p", "no:cacheprovider").assert_outcomes(passed=1, skipped=3)


def test_under_ci_a_missing_dependency_fails_collection_in_one_line(tree, monkeypatch):
    monkeypatch.setenv("CI", "true")
    result = tree.runpytest("-p", "no:cacheprovider", "test_dependency.py")
    result.assert_outcomes(errors=1)
    assert result.ret != 0
    body = [line for line in result.outlines if line.startswith("CI: ")]
    assert body == [
        f"CI: a skip fails here (only @pytest.mark.cuda tests may skip): could not import {MISSING!r}: "
        f"No module named {MISSING!r}"
    ]


def test_under_ci_missing_data_fails_and_only_the_cuda_test_skips(tree, monkeypatch, tmp_path):
    monkeypatch.setenv("CI", "true")
    result = tree.runpytest("-p", "no:cacheprovider", "-rs", "test_tree.py")
    result.assert_outcomes(passed=1, skipped=1, errors=1)
    body = [line for line in result.outlines if line.startswith("CI: ")]
    assert len(body) == 1 and f"the shared data folder {tmp_path / 'moved' / 'data'} is absent" in body[0], body
    result.stdout.fnmatch_lines(["SKIPPED * needs a CUDA device"])
