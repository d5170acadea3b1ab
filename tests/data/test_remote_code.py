"""No repository code runs on a keypress (issue 30 item 5): a tokenizer folder whose tokenizer_config.json
names custom code is refused with one line even at a terminal where someone answers "y" to transformers'
"Do you wish to run the custom code?" prompt, because every call passes ``trust_remote_code=False``."""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO

CUSTOM = """
import pathlib
pathlib.Path({marker!r}).write_text("ran")  # what hostile repository code would do on import
from transformers import PreTrainedTokenizerFast
class CustomTokenizer(PreTrainedTokenizerFast):
    pass
"""


@pytest.mark.slow  # a transformers import in a child process
@pytest.mark.parametrize("named_in", ["tokenizer_config.json", "config.json"])
def test_a_custom_code_tokenizer_folder_never_runs_its_code_even_when_y_is_typed(tmp_path, named_in):
    """Named in tokenizer_config.json, the project refuses it itself; named only in config.json (where
    AutoTokenizer also looks), transformers refuses it because trust_remote_code=False is passed."""
    folder = tmp_path / "tok"
    folder.mkdir()
    marker = tmp_path / "code-ran"
    (folder / "custom_tokenizer.py").write_text(CUSTOM.format(marker=str(marker)))
    auto_map = {"auto_map": {"AutoTokenizer": [None, "custom_tokenizer.CustomTokenizer"]}}
    tokenizer_config = {
        "tokenizer_class": "CustomTokenizer",
        **(auto_map if named_in == "tokenizer_config.json" else {}),
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", **auto_map}))
    code = f"from data.tokenizer import load_tokenizer; load_tokenizer({str(folder)!r})"
    master, slave = pty.openpty()
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=slave, stdout=slave, stderr=slave, env=env, cwd=REPO)
    os.close(slave)
    out = b""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 0.5)
        if ready:
            try:
                chunk = os.read(master, 4096)
            except OSError:  # the child closed the terminal
                break
            out += chunk
            if b"[y/N]" in chunk:
                os.write(master, b"y\n")  # the keypress that used to run the code
        elif proc.poll() is not None:
            break
    proc.wait(timeout=30)
    os.close(master)
    text = out.decode(errors="replace")
    assert not marker.exists(), text
    assert proc.returncode != 0 and "[y/N]" not in text, text
    assert "data.tokenizer:" in text, text
    if named_in == "tokenizer_config.json":
        assert "names custom code" in text, text
