"""``python -m data.prepare`` as a user runs it: end to end, killed mid-run and resumed, bad arguments."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from data.shards import open_prepared
from tests.conftest import REPO
from tests.data.test_prepare import folder_bytes


def cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "data.prepare", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )


@pytest.mark.slow
def test_cli_end_to_end(tmp_path, corpus):
    out = tmp_path / "shards"
    done = cli(
        "--source", "local", "--path", str(corpus), "--out", str(out), "--vocab-size", "300", "--shard-tokens", "200"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"prepared {out}: 9 documents") and done.stdout.count("\n") == 1
    train, val, index = open_prepared(out, 32)
    assert len(train) > 0 and len(val) > 0 and index["vocab_size"] == 300 and index["source"]["source"] == "local"
    again = cli("--path", str(corpus), "--out", str(out))
    assert again.returncode == 2 and again.stderr.strip().splitlines() == [
        f"error: --out: {str(out)!r} already holds prepared shards; pass --overwrite to replace them"
    ]


SLOW_PREPARE = """
import sys, time
import data.prepare as P
import data.prepare_output as O
P.CHUNK_DOCS = 1
O.JOURNAL_SECONDS = 0.0
if sys.argv[1] == "slow":  # a chunk takes long enough to signal the process in the middle of the run
    encode = P.encode_chunk
    P.encode_chunk = lambda tok, texts: (time.sleep(0.3), encode(tok, texts))[1]
sys.exit(P.main(sys.argv[2:]))
"""


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_cli_killed_mid_run_resumes_to_the_same_bytes(tmp_path, corpus, sp_path, sig):
    script = tmp_path / "prepare.py"
    script.write_text(SLOW_PREPARE)
    args = ["--path", str(corpus), "--tokenizer", str(sp_path), "--shard-tokens", "97"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}

    def run(mode: str, out: Path) -> subprocess.Popen:
        cmd = [sys.executable, str(script), mode, *args, "--out", str(out)]
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    reference = run("fast", tmp_path / "reference")
    assert reference.wait(timeout=120) == 0, reference.stderr.read()
    proc = run("slow", tmp_path / "out")
    progress = tmp_path / "out.partial" / "progress.json"
    deadline = time.monotonic() + 60
    while not progress.is_file() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    time.sleep(0.4)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    if sig == signal.SIGTERM:
        assert proc.returncode == 128 + sig, err
        lines = [line for line in err.splitlines() if line.startswith("error")]
        assert lines == [
            f"error: interrupted by SIGTERM; the shards written so far are kept in {tmp_path / 'out.partial'}: the "
            "same command resumes"
        ], err
        assert "Traceback" not in err and not (tmp_path / "out.partial" / "owner").exists()
    else:
        assert proc.returncode == -sig
    assert not (tmp_path / "out").exists()
    again = run("fast", tmp_path / "out")
    _, err = again.communicate(timeout=120)
    assert again.returncode == 0 and f"resuming {tmp_path / 'out.partial'}" in err, err
    assert folder_bytes(tmp_path / "out") == folder_bytes(tmp_path / "reference")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "prepare.py", "reference"]


@pytest.mark.parametrize(
    "args, option",
    [
        (["--workers", "0"], "--workers"),
        (["--val-fraction", "1.5"], "--val-fraction"),
        (["--shard-tokens", "many"], "--shard-tokens"),
        (["--source", "embedded"], "--path"),
    ],
)
def test_cli_bad_argument_is_one_line_exit_2(tmp_path, corpus, args, option):
    done = cli("--path", str(corpus), "--out", str(tmp_path / "out"), *args)
    assert done.returncode == 2 and done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and option in lines[0] and lines[0].startswith("error: ")
    assert not (tmp_path / "out").exists()
