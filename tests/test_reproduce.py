"""``python -m bench.reproduce`` (the papers' claims at tiny scale) stays runnable, and its verdict rule
says what docs/reproduce.md says it does."""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from bench.reproduce_claims import FAILS, HOLDS, UNSURE, verdict
from tests.conftest import REPO


def test_verdict_compares_the_gap_with_the_seed_spread():
    assert verdict([1.0, 1.1], [2.0, 2.1])[0] == HOLDS  # claimed lower, lower by more than the spread
    assert verdict([2.0, 2.1], [1.0, 1.1])[0] == FAILS  # the other way round
    assert verdict([1.0, 1.5], [1.2, 1.3])[0] == UNSURE  # the gap (0) is inside the spread
    assert verdict([1.0], [2.0])[0] == UNSURE  # one seed: no spread to compare with
    assert verdict([1.0, 1.0], [1.0004, 1.0004], resolution=0.001)[0] == UNSURE  # below the last digit shown


def test_missing_data_is_one_line_naming_the_option(tmp_path, capsys):
    from bench.reproduce import main

    code = main(["--quick", "--data", str(tmp_path / "absent"), "--out", str(tmp_path / "r.md")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("error: --data:") and "\n" not in err
    assert not (tmp_path / "r.md").exists()


@pytest.mark.slow
def test_quick_prescored_hyper_claims_run_end_to_end(tmp_path):
    """The command in its --quick --only form, on eight of the embedded plays (no ../shared needed)."""
    data = tmp_path / "plays"
    data.mkdir()
    with tarfile.open(REPO / "data" / "embedded" / "shakespeare_plays.tar.xz") as tar:
        members = sorted((m for m in tar.getmembers() if m.isfile() and m.name.endswith(".txt")), key=lambda m: m.name)
        for member in members[:8]:
            (data / Path(member.name).name).write_bytes(tar.extractfile(member).read())
    out = tmp_path / "reproduce.md"
    cmd = [sys.executable, "-m", "bench.reproduce", "--quick", "--only", "prescored_hyper", "--data", str(data)]
    cmd += ["--out", str(out), "--cache-dir", str(tmp_path / "cache")]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = out.read_text()
    assert "| paper | claim | paper's figure (source) | our figure | verdict | seeds |" in text
    assert "Command: `python -m bench.reproduce --quick --only prescored_hyper" in text
    payload = json.loads((tmp_path / "reproduce" / "results.json").read_text())
    claims = payload["claims"]
    assert len(claims) == 4 and all(c["group"] == "Pre-scored HyperAttention" for c in claims)
    assert {c["verdict"] for c in claims} <= {HOLDS, FAILS, UNSURE}
    assert all(c["seeds"] == 2 for c in claims)
    assert (tmp_path / "reproduce" / "prescored.png").stat().st_size > 0
