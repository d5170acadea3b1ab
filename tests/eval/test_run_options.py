"""eval.run's option logic without a model: the longest input a command gives the model (what the
beyond-the-trained-context warning compares with data.seq_len)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from eval.run import _build_parser, longest_input


def _longest(argv: list[str], samples: dict | None = None, train_length: int = 256) -> int:
    args = _build_parser().parse_args(["--run", "runs/tiny", *argv])
    return longest_input(args.tasks.split(","), args, samples or {}, train_length)


def test_longest_input_is_what_the_requested_tasks_feed_the_model():
    assert _longest(["--tasks", "ppl,sample"]) == 0  # validation windows are data.seq_len long: no warning
    assert _longest(["--tasks", "ppl_length", "--lengths", "0.5,1,4"]) == 1024
    assert _longest(["--tasks", "ppl", "--ppl-data", "x.txt", "--ppl-length", "300"]) == 300
    grid = {"needle": [SimpleNamespace(length=512), SimpleNamespace(length=1024)]}
    assert _longest(["--tasks", "needle", "--max-context", "1024"], grid) == 1024
    # LongBench and lm-eval prompts fill the generation context only when it was raised on purpose
    assert _longest(["--tasks", "longbench:f.jsonl,hellaswag"]) == 0
    assert _longest(["--tasks", "longbench:f.jsonl", "--max-context", "2048"]) == 2048


def test_results_accumulate_per_task_with_time_and_command(tmp_path, capsys):
    """Two calls on one checkpoint keep both calls' tasks; a task run again replaces only its own entry; a file of
    another checkpoint, or not a results file, is replaced with one note."""
    import json

    from eval.run import write_results

    out, ckpt = tmp_path / "step_00000002.json", str(tmp_path / "checkpoints" / "step_00000002")
    write_results(out, {"checkpoint": ckpt, "step": 2, "ppl": {"loss": 3.0}}, command="python -m eval.run A")
    write_results(out, {"checkpoint": ckpt, "step": 2, "needle": {"average": 0.5}}, command="B")
    both = json.loads(out.read_text())
    assert both["ppl"] == {"loss": 3.0} and both["needle"] == {"average": 0.5}
    assert both["provenance"]["ppl"]["command"] == "python -m eval.run A" and both["provenance"]["needle"]["time"]
    write_results(
        out, {"checkpoint": ckpt, "step": 2, "ppl": {"loss": 2.0}, "plots": {"loss_curves": "x"}}, command="C"
    )
    again = json.loads(out.read_text())
    assert again["ppl"] == {"loss": 2.0} and again["needle"] == {"average": 0.5} and again["plots"]
    assert again["provenance"]["ppl"]["command"] == "C" and again["provenance"]["needle"]["command"] == "B"
    assert list(tmp_path.iterdir()) == [out], "no temporary file or lock file is left"
    assert capsys.readouterr().err == ""
    other = str(tmp_path / "checkpoints" / "step_00000004")
    write_results(out, {"checkpoint": other, "step": 4, "sample": {"text": "t"}}, command="D")
    assert set(json.loads(out.read_text())) == {"checkpoint", "step", "sample", "provenance"}
    assert capsys.readouterr().err.strip() == f"note: {out} held results of {ckpt}; replaced"
    out.write_text("{not json")
    write_results(out, {"checkpoint": other, "step": 4, "sample": {"text": "t"}}, command="E")
    assert "not a results file" in capsys.readouterr().err and json.loads(out.read_text())["sample"]


@pytest.mark.parametrize(
    "earlier",
    [b'{"checkpoint": "a\\u0000b", "step": 1}', b'{"checkpoint": "x", "n": ' + b"9" * 5000 + b"}"],
    ids=["nul-in-checkpoint", "5000-digits"],
)
def test_an_earlier_file_json_cannot_take_is_replaced_with_one_note(earlier, tmp_path, capsys):
    """A results file holding a NUL in its checkpoint path, or an integer past Python's 4,300-digit limit: the new
    results are written with one note, never a traceback after the task ran (issue 50)."""
    import json

    from eval.run import write_results

    out, ckpt = tmp_path / "r.json", str(tmp_path / "checkpoints" / "step_00000002")
    out.write_bytes(earlier)
    write_results(out, {"checkpoint": ckpt, "step": 2, "ppl": {"loss": 3.0}}, command="A")
    assert json.loads(out.read_text())["ppl"] == {"loss": 3.0}
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"note: {out}") and err.rstrip().endswith("replaced"), err


def test_grid_results_are_keyed_by_the_options_that_make_another_test():
    """The README's two needle lines (noise / single, then essay / multikey) keep their own entries (issue 50):
    the key names needle's kind and haystack, and kv_retrieval's file, when they are not the defaults."""
    from eval.run import result_key

    def key(task: str, *argv: str) -> str:
        return result_key(task, _build_parser().parse_args(["--run", "r", *argv]))

    assert key("needle") == "needle" and key("kv_retrieval") == "kv_retrieval" and key("rag") == "rag"
    essay = key("needle", "--haystack", "essay", "--needle-kind", "multikey")
    assert essay == "needle[kind=multikey,haystack=essay]"
    assert key("needle", "--needle-kind", "multivalue") == "needle[kind=multivalue]"
    assert key("kv_retrieval", "--kv-file", "/d/kv-retrieval-300_keys.jsonl.gz") == (
        "kv_retrieval[file=kv-retrieval-300_keys.jsonl.gz]"
    )
