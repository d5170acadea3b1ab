"""core.collector: every command-line program runs under the programs' garbage-collector thresholds, set before
its imports, in a fresh interpreter as a user starts it."""

from __future__ import annotations

import gc
import subprocess
import sys

from core import collector
from core.errors import cli_errors
from tests.conftest import REPO


def test_a_cli_main_sets_the_thresholds_before_it_runs():
    seen = []

    @cli_errors
    def main() -> int:
        seen.append(gc.get_threshold())
        return 0

    before = gc.get_threshold()
    try:
        gc.set_threshold(700, 10, 10)  # Python's default
        assert main() == 0
    finally:
        gc.set_threshold(*before)
    assert seen == [collector.THRESHOLDS]


def test_the_training_program_imports_torch_under_the_programs_thresholds():
    """``python -m pretrain.train --help-config``: no full collection while it starts (the default thresholds run
    about five over torch's import)."""
    probe = (
        "import gc, runpy, sys\n"
        "full = []\n"
        "def count(phase, info):\n"
        "    if phase == 'stop' and info['generation'] == 2:\n"
        "        full.append(1)\n"
        "gc.callbacks.append(count)\n"
        "sys.argv = ['pretrain.train', '--help-config']\n"
        "try:\n"
        "    runpy.run_module('pretrain.train', run_name='__main__')\n"
        "except SystemExit:\n"
        "    pass\n"
        "assert 'torch' in sys.modules\n"
        "print('full collections', len(full), gc.get_threshold())\n"
    )
    proc = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"full collections 0 {collector.THRESHOLDS}" in proc.stdout, proc.stdout[-500:]
