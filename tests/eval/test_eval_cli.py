"""The evaluation suite end to end: lm-eval tasks inside a training run (metrics.jsonl), then
``python -m eval.run`` on that run with lm-eval, wikitext, needle, kv retrieval and a LongBench
file, offline, producing JSON and PNGs. Reads the task data from ../shared/data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_cli
from tests.e2e.test_train_cli import overrides, train

pytestmark = pytest.mark.slow  # each test runs the CLIs on a trained checkpoint


def eval_run(run: Path, out: Path, *args, timeout: int = 300):
    """``python -m eval.run --run RUN --out OUT ARGS``."""
    return run_cli("eval.run", "--run", run, "--out", out, *args, timeout=timeout)


@pytest.fixture(scope="module")
def run_with_tasks(tmp_path_factory, cache_dir, shared_data) -> Path:
    run_dir = tmp_path_factory.mktemp("tasks") / "run"
    proc = train(
        overrides(
            run_dir,
            cache_dir,
            **{
                "model.max_seq_len": 1024,
                "data.seq_len": 128,
                "train.max_steps": 6,
                "checkpoint.every": 0,
                "eval.every": 3,
                "eval.sample_tokens": 0,
                "eval.tasks": ["lambada_openai", "hellaswag"],
                "eval.limit": 4,
                "eval.data_dir": str(shared_data),
            },
        ),
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


def test_in_loop_tasks_land_in_metrics_jsonl(run_with_tasks):
    rows = [json.loads(line) for line in (run_with_tasks / "metrics.jsonl").read_text().splitlines()]
    task_rows = [r for r in rows if any(k.startswith("eval/") for k in r)]
    assert [r["step"] for r in task_rows] == [3, 6]
    for row in task_rows:
        assert 0.0 <= row["eval/hellaswag/acc_norm"] <= 1.0 and 0.0 <= row["eval/lambada_openai/acc"] <= 1.0
        assert row["eval/lambada_openai/perplexity"] > 1.0


def test_eval_run_covers_the_suite_and_writes_json_and_plots(run_with_tasks, shared_data, tmp_path):
    bench = tmp_path / "hotpotqa_e.jsonl"
    rows = [
        {
            "input": "Who wrote it?",
            "context": "Passage 1: A play by William Shakespeare. " * n,
            "answers": ["William Shakespeare"],
            "length": length,
            "dataset": "hotpotqa",
            "all_classes": None,
            "_id": str(i),
        }
        for i, (n, length) in enumerate([(2, 300), (40, 5000), (3, 9000)])
    ]
    bench.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "results.json"
    tasks = f"hellaswag,lambada_openai,wikitext,needle,kv_retrieval,longbench:{bench}"
    grid = ["--context-lengths", "640,1024", "--depths", "0,0.5,1"]
    options = ["--no-progress", "--tasks", tasks, "--limit", "3", "--data-dir", shared_data, *grid]
    proc = eval_run(run_with_tasks, out, *options, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())
    assert 0.0 <= results["hellaswag"]["acc_norm"] <= 1.0 and results["wikitext"]["word_perplexity"] > 1.0
    needle = results["needle"]
    assert (
        needle["n"] == 6
        and sorted(needle["grid"]) == ["1024", "640"]
        and all(len(v) == 3 for v in needle["grid"].values())
    )
    assert set(results[f"longbench:{bench}"]["hotpotqa"]) >= {"score", "n", "0-4k", "4-8k", "8k+"}
    pngs = [Path(p) for p in (needle["plot"], results["kv_retrieval"]["plot"], results["plots"]["loss_curves"])]
    assert all(p.is_file() and p.stat().st_size > 1000 for p in pngs), pngs


def test_unknown_task_is_one_line(run_with_tasks):
    proc = run_cli("eval.run", "--run", run_with_tasks, "--tasks", "hellaswagg", timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "--tasks: hellaswagg" in proc.stderr


def test_eval_run_scores_a_text_file_with_strided_windows_and_measures_attention_on_it(
    run_with_tasks, shared_data, tmp_path
):
    text = tmp_path / "speech.txt"
    text.write_text((shared_data / "tinyshakespeare" / "input.txt").read_text()[:6000])
    results = {}
    for stride in (64, 32):
        out = tmp_path / f"ppl{stride}.json"
        ppl = ["--ppl-data", text, "--ppl-length", "64", "--ppl-stride", stride]
        proc = eval_run(run_with_tasks, out, "--tasks", "ppl,attention_stats", *ppl, "--stats-text", text)
        assert proc.returncode == 0, proc.stderr[-3000:]
        results[stride] = json.loads(out.read_text())
    a, b = results[64]["ppl"], results[32]["ppl"]
    assert a["tokens"] == b["tokens"] and a["bytes"] == 6000 and a["stride"] == 64 and b["stride"] == 32
    assert b["loss"] != a["loss"], "overlapping windows give the later tokens more context"
    assert results[64]["attention_stats"]["sequences"] >= 1 and len(results[64]["attention_stats"]["layers"]) == 2
