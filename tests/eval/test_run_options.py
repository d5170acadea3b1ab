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
