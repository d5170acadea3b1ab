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

from eval.harness import TASK_DIR, FocusedLM, evaluate
from run.config import resolve_data_dir


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


def test_data_dir_from_metadata_env_or_default(tmp_path, monkeypatch, capsys):
    """The default is eval_data in the one cache root (the data cache's); the old underscore folder is read with
    a note; $FOCUSED_PRETRAIN_CACHE moves the root."""
    monkeypatch.delenv("FOCUSED_PRETRAIN_EVAL_DATA", raising=False)
    monkeypatch.delenv("FOCUSED_PRETRAIN_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.cache/focused-pretrain/eval_data
    with pytest.raises(ConfigError, match=r"^data_dir: not given and \$FOCUSED_PRETRAIN_EVAL_DATA is unset"):
        resolve_data_dir(None)
    legacy = tmp_path / ".cache" / "focused_pretrain" / "eval_data"
    legacy.mkdir(parents=True)
    assert resolve_data_dir(None) == legacy and "deprecated" in capsys.readouterr().err
    default = tmp_path / ".cache" / "focused-pretrain" / "eval_data"
    default.mkdir(parents=True)
    assert resolve_data_dir(None) == default and capsys.readouterr().err == ""
    from data.config import DataConfig

    assert DataConfig().cache_path == default.parent
    monkeypatch.setenv("FOCUSED_PRETRAIN_CACHE", str(tmp_path / "elsewhere"))
    (tmp_path / "elsewhere" / "eval_data").mkdir(parents=True)
    assert resolve_data_dir(None) == tmp_path / "elsewhere" / "eval_data"
    assert DataConfig().cache_path == tmp_path / "elsewhere"
    monkeypatch.setenv("FOCUSED_PRETRAIN_EVAL_DATA", str(tmp_path))
    assert resolve_data_dir(None) == tmp_path and resolve_data_dir(str(default)) == default


def test_shipped_yamls_load_directly_under_their_own_names(shared_data):
    """eval/tasks as it is (no rendering); the CLI test below runs it beside lm_eval's built-ins. No task, tag or
    group takes a built-in's name (lm-eval would warn on every run that it overrides it)."""
    from lm_eval.tasks import TaskManager

    from eval.lm_tasks import LM_EVAL_PREFIX, TASKS

    text = (TASK_DIR / "hellaswag.yaml").read_text()
    assert "@" not in text.replace("# ", "")  # no placeholders left to fill
    manager = TaskManager(include_path=str(TASK_DIR), include_defaults=False, metadata={"data_dir": str(shared_data)})
    assert set(manager.all_tasks) == {LM_EVAL_PREFIX + t for t in TASKS}
    hella = manager.load(["focused_hellaswag"])["tasks"]["focused_hellaswag"]
    assert len(hella.eval_docs) == 10042 and hella.doc_to_target(hella.eval_docs[1]) == 3


def test_wrapper_names_our_tasks_and_reports_the_batch_size_used():
    from eval.lm_eval import _with_task_dir

    argv = ["--model", "focused", "--model_args", "run=r,batch_size=8", "--tasks", "hellaswag,wikitext,mmlu"]
    assert _with_task_dir(argv) == [
        *argv[:5],
        "focused_hellaswag,focused_wikitext,mmlu",
        "--include_path",
        str(TASK_DIR),
        "--batch_size",
        "8",
    ]
    given = ["--model", "hf", "--tasks=piqa", "--batch_size", "2", "--include_path", "elsewhere"]
    assert _with_task_dir(given) == given  # another task folder: names left alone; the CLI's batch size kept
    json_args = ["--model", "focused", "--model_args", '{"run": "r", "batch_size": 4}', "-t", "piqa"]
    assert _with_task_dir(json_args)[5] == "focused_piqa" and _with_task_dir(json_args)[-2:] == ["--batch_size", "4"]
    assert _with_task_dir(["ls", "tasks"]) == ["ls", "tasks"]


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
def test_wrapper_cli_prints_a_hellaswag_table_on_10_local_examples(run_dir, shared_data):
    """Quiet: no task-override warning (nothing shadows a built-in), and the summary's batch size is the one used."""
    out = _run(
        "eval.lm_eval",
        "--model",
        "focused",
        "--model_args",
        f"run={run_dir},device=cpu,batch_size=8",
        "--tasks",
        "hellaswag",
        "--metadata",
        json.dumps({"data_dir": str(shared_data)}),
        "--limit",
        "10",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "overrides" not in out.stdout + out.stderr, out.stderr
    assert "limit: 10.0, num_fewshot: None, batch_size: 8" in out.stdout, out.stdout
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


@pytest.mark.slow
def test_lm_eval_hf_model_on_an_export_gives_our_wikitext_perplexity(run_dir, shared_data, tmp_path):
    """lm-eval's own ``--model hf`` on ``pretrain.export --format hf`` scores WikiText pages as the project does:
    the export names EOS (what the project starts a text from) as its BOS, lm-eval's prefix token. The
    SentencePiece tokenizer here has BOS != EOS, the case that differed by nats per page."""
    from data.tokenizer import load_tokenizer
    from pretrain.export import export_hf
    from run.checkpoint import latest_checkpoint, load_model

    checkpoint = latest_checkpoint(run_dir)
    export = export_hf(checkpoint, tmp_path / "export", log=lambda line: None)
    out = subprocess.run(
        [sys.executable, "-m", "eval.lm_eval", "--model", "hf", "--model_args", f"pretrained={export},dtype=float32"]
        + ["--device", "cpu", "--tasks", "wikitext", "--limit", "5", "--output_path", str(tmp_path / "results")],
        cwd=REPO,
        env=dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", FOCUSED_PRETRAIN_EVAL_DATA=str(shared_data)),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    saved = json.loads(next((tmp_path / "results").rglob("results_*.json")).read_text())
    theirs = saved["results"]["focused_wikitext"]["word_perplexity,none"]
    model, _ = load_model(checkpoint)
    lm = FocusedLM(model, load_tokenizer(checkpoint / "tokenizer.model"), batch_size=8)
    ours = evaluate(lm, ["wikitext"], limit=5, data_dir=shared_data)["wikitext"]["word_perplexity"]
    assert abs(theirs - ours) <= 1e-4 * ours, (theirs, ours)
