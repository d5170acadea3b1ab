"""eval.run's option logic without a model: the longest input a command gives the model (what the
beyond-the-trained-context warning compares with data.seq_len)."""

from __future__ import annotations

from types import SimpleNamespace

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
