"""lm-eval's own command line and Python entry points on our checkpoints: ``create_from_arg_obj`` /
``create_from_arg_string``, the shipped task YAMLs used directly (``--include_path eval/tasks``), the
``python -m eval.lm_eval`` wrapper, and lm-eval's standard errors in ``eval.run``'s JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from core.errors import ConfigError
from tests.conftest import REPO
from tests.interop.conftest import SMALL, our_checkpoint

pytest.importorskip("lm_eval")

from eval.harness import TASK_DIR, FocusedLM, evaluate  # noqa: E402
from run.config import resolve_data_dir  # noqa: E402


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, sp_model) -> Path:
    root = tmp_path_factory.mktemp("run")
    our_checkpoint(root, SMALL | dict(family="llama", max_seq_len=512), sp_model)  # hellaswag endings fit
    return root


def test_create_from_arg_obj_and_string(run_dir):
    lm_eval_cli = {"batch_size": 1, "max_batch_size": None, "device": "cuda:0"}  # lm_eval's CLI defaults
    lm = FocusedLM.create_from_arg_obj({"run": str(run_dir), "device": "cpu", "batch_size": 4}, lm_eval_cli)
    assert (lm.batch_size, lm.device.type) == (4, "cpu")  # model_args win over the CLI's values
    lm = FocusedLM.create_from_arg_obj({"run": str(run_dir)}, {"batch_size": "3", "device": "cpu"})
    assert lm.batch_size == 3  # the CLI fills in what model_args leave out
    if not torch.cuda.is_available():
        lm = FocusedLM.create_from_arg_obj({"run": str(run_dir)}, lm_eval_cli)
        assert lm.device.type == "cpu"  # lm_eval's default cuda:0 without CUDA: auto
    by_string = FocusedLM.create_from_arg_string(f"run={run_dir},batch_size=2,max_length=32", lm_eval_cli)
    assert by_string.max_length == 32 and lm.model.cfg.max_seq_len == 512
    assert (by_string.batch_size, by_string.max_length) == (2, 32)
    with pytest.raises(ConfigError, match=r"^model_args: colour not accepted"):
        FocusedLM.create_from_arg_obj({"run": str(run_dir), "colour": "red"})


def test_data_dir_from_metadata_env_or_default(tmp_path, monkeypatch):
    monkeypatch.delenv("FOCUSED_PRETRAIN_EVAL_DATA", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.cache/focused_pretrain/eval_data
    with pytest.raises(ConfigError, match=r"^data_dir: not given and \$FOCUSED_PRETRAIN_EVAL_DATA is unset"):
        resolve_data_dir(None)
    default = tmp_path / ".cache" / "focused_pretrain" / "eval_data"
    default.mkdir(parents=True)
    assert resolve_data_dir(None) == default
    monkeypatch.setenv("FOCUSED_PRETRAIN_EVAL_DATA", str(tmp_path))
    assert resolve_data_dir(None) == tmp_path and resolve_data_dir(str(default)) == default


def test_shipped_yamls_load_directly_and_answer_to_the_plain_names(shared_data):
    """eval/tasks as it is (no rendering); the CLI test below runs it beside lm_eval's built-ins."""
    from lm_eval.tasks import TaskManager

    text = (TASK_DIR / "hellaswag.yaml").read_text()
    assert "@" not in text.replace("# ", "")  # no placeholders left to fill
    manager = TaskManager(include_path=str(TASK_DIR), include_defaults=False, metadata={"data_dir": str(shared_data)})
    tasks = manager.load(["hellaswag"])["tasks"]  # the plain name: our folder's tag
    hella = tasks["focused_hellaswag"]
    assert len(hella.eval_docs) == 10042 and hella.doc_to_target(hella.eval_docs[1]) == 3


def test_evaluate_reports_stderr_beside_each_metric(shared_data):
    from data.tokenizer import load_tokenizer
    from model.config import ModelConfig
    from model.transformer import build_model

    tok = load_tokenizer(shared_data / "gpt2_bpe" / "gpt2_tokenizer.json")
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=tok.vocab_size, d_model=32, n_layers=1, n_heads=2, d_ff=64, max_seq_len=64)
    lm = FocusedLM(build_model(cfg), tok, batch_size=8)
    with_err = evaluate(lm, ["hellaswag", "lambada_openai"], limit=4, data_dir=shared_data, stderr=True)
    assert set(with_err["hellaswag"]) == {"acc", "acc_stderr", "acc_norm", "acc_norm_stderr"}
    assert with_err["hellaswag"]["acc_stderr"] > 0 and with_err["lambada_openai"]["perplexity_stderr"] > 0
    plain = evaluate(lm, ["hellaswag"], limit=4, data_dir=shared_data)
    assert set(plain["hellaswag"]) == {"acc", "acc_norm"} and plain["hellaswag"]["acc"] == with_err["hellaswag"]["acc"]


def _run(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", PYTHONPATH=str(REPO))
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.slow
def test_wrapper_cli_prints_a_hellaswag_table_on_20_local_examples(run_dir, shared_data):
    out = _run(
        "eval.lm_eval",
        "--model",
        "focused",
        "--model_args",
        f"run={run_dir},device=cpu,batch_size=8",
        "--tasks",
        "hellaswag",
        "--include_path",
        str(TASK_DIR),
        "--metadata",
        json.dumps({"data_dir": str(shared_data)}),
        "--limit",
        "20",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("|")]
    assert rows and "Stderr" in rows[0], out.stdout
    acc = next(line for line in rows if "focused_hellaswag" in line and "|acc " in line)
    assert 0.0 <= float(acc.split("|")[7]) <= 1.0, acc
    bad = _run("eval.lm_eval", "--model", "focused", "--model_args", "device=cpu", "--tasks", "hellaswag")
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].startswith("error: model_args:"), bad.stderr


@pytest.mark.slow
def test_eval_run_json_carries_stderr(run_dir, shared_data, tmp_path):
    out = _run(
        "eval.run",
        "--run",
        str(run_dir),
        "--tasks",
        "hellaswag",
        "--limit",
        "8",
        "--data-dir",
        str(shared_data),
        "--out",
        str(tmp_path / "r.json"),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    metrics = json.loads((tmp_path / "r.json").read_text())["hellaswag"]
    assert set(metrics) == {"acc", "acc_stderr", "acc_norm", "acc_norm_stderr"} and "±" in out.stdout
