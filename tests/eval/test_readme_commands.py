"""Every command of the README's "Evaluate" section, as written, exits 0 on a demo-shaped run (issue 28).

The commands are read from README.md's code blocks, so editing them there changes what runs here. Two
substitutions only: the offline bundle (../shared/data) for the README's ``/path/to/eval-data``, and the
run's last step for the demo's ``step_00000200``. The runs are ``launch/configs/tiny.toml`` and
``tiny_focus.toml`` as the demo trains them (the tiny preset's 256-token context, ``data.seq_len`` 256), shrunk
to seconds: 64 wide, 2 layers, 2 steps on a small local corpus. Commands run in a folder holding ``runs/`` and
``eval`` (a link to the package, for the README's ``eval/...`` paths), in this process (``main(argv)`` of the
module the command names): a new interpreter per command would cost more than the commands.
"""

from __future__ import annotations

import importlib
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.slow  # trains two runs, then evaluates them ~13 times

STEPS = 2
SHRINK = {
    "model.d_model": "64",
    "model.n_layers": "2",
    "model.n_heads": "4",
    "model.d_ff": "128",
    "model.vocab_size": "512",
    "data.source": '"local"',
    "data.val_fraction": "0.1",  # one or two 6,000-character documents: ppl_length's 8 x 256 tokens fit
    "train.max_steps": str(STEPS),
    "train.batch_size": "4",
    "checkpoint.every": "0",
    "eval.every": "0",
    "eval.batches": "1",
    "eval.sample_tokens": "0",
    "log.wandb": '"disabled"',
    "log.tensorboard": "false",
}


def readme_eval_commands() -> list[str]:
    """The ``python -m ...`` commands of the README's "### Evaluate" section (up to the next heading of that
    level), continuation lines joined, comments dropped."""
    text = (REPO / "README.md").read_text()
    section = text.split("\n### Evaluate\n", 1)[1].split("\n### ", 1)[0]
    commands = []
    for block in re.findall(r"```(?:bash)?\n(.*?)```", section, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                commands.append(line.split("   #", 1)[0].strip())
    return commands


COMMANDS = readme_eval_commands()


def test_the_section_has_its_commands():
    assert len(COMMANDS) >= 12 and all(c.startswith("python -m eval.") for c in COMMANDS), COMMANDS
    assert any("longbench:" in c for c in COMMANDS) and any("eval.lm_eval" in c for c in COMMANDS)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> Path:
    """A folder with runs/tiny and runs/tiny_focus (trained side by side) and ``eval`` linking to the package."""
    from data.embedded import iter_embedded

    root = tmp_path_factory.mktemp("readme")
    docs = root / "docs.jsonl"
    texts = [d.text for _, d in zip(range(2), iter_embedded())]
    chunks = [t[i : i + 6000] for t in texts for i in range(0, 48_000, 6000)]
    docs.write_text("".join(json.dumps({"text": c}) + "\n" for c in chunks))
    procs = {}
    for name in ("tiny", "tiny_focus"):
        values = {**SHRINK, "run.dir": f'"{root / "runs" / name}"', "data.path": f'"{docs}"'}
        values["data.cache_dir"] = f'"{cache_dir}"'
        args = [a for key, value in values.items() for a in ("--set", f"{key}={value}")]
        config = REPO / "launch" / "configs" / f"{name}.toml"
        cmd = [sys.executable, "-m", "pretrain.train", "--config", str(config), *args]
        procs[name] = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for proc in procs.values():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        # tiny.toml warms up for 20 steps: a 2-step run says that train.lr is never reached
        assert "warning: train.warmup_steps=20 exceeds train.max_steps=2" in out, out[-2000:]
    (root / "eval").symlink_to(REPO / "eval", target_is_directory=True)
    return root


def run_readme_command(command: str, root: Path, shared_data: Path, monkeypatch: pytest.MonkeyPatch) -> int:
    command = command.replace("/path/to/eval-data", str(shared_data)).replace("step_00000200", f"step_{STEPS:08d}")
    python, flag, module, *argv = shlex.split(command)
    assert (python, flag) == ("python", "-m") and module in ("eval.run", "eval.lm_eval"), command
    monkeypatch.chdir(root)
    return importlib.import_module(module).main(argv)


@pytest.mark.parametrize("index", range(len(COMMANDS)), ids=lambda i: COMMANDS[i].split(" --", 2)[1][:40])
def test_readme_eval_command_exits_0(index, root, shared_data, monkeypatch, capfd):
    command = COMMANDS[index]
    code = run_readme_command(command, root, shared_data, monkeypatch)
    out, err = capfd.readouterr()
    assert code == 0, f"{command}\n{err[-3000:]}"
    beyond = "warning: evaluating at up to"
    # the demo trained at 256 tokens: a longer prompt says so, once; a length within it says nothing
    long_context = "--max-context" in command or "ppl_length" in command
    assert err.count(beyond) == (1 if long_context else 0), err[-3000:]


def test_the_two_needle_lines_keep_both_grids_and_plots(root, shared_data, monkeypatch, capfd):
    """The README's two needle lines (noise haystack, then essay / multikey) keep their own results (issue 50):
    the second does not replace the first's grid and plot in the step's results file. They ran in order above;
    run alone, this test runs whichever of them has no entry yet."""
    lines = [c for c in COMMANDS if re.search(r"--tasks [\w,]*needle", c)]
    keys = ["needle", "needle[kind=multikey,haystack=essay]"]
    assert len(lines) == 2 and "--needle-kind multikey" in lines[1], lines
    results_file = root / "runs" / "tiny" / "eval" / f"step_{STEPS:08d}.json"
    for line, key in zip(lines, keys):
        if key not in (json.loads(results_file.read_text()) if results_file.is_file() else {}):
            assert run_readme_command(line, root, shared_data, monkeypatch) == 0, capfd.readouterr().err[-3000:]
    results = json.loads(results_file.read_text())
    plots = {results[key]["plot"] for key in keys}
    assert len(plots) == 2 and all((root / plot).is_file() for plot in plots), plots
    assert results[keys[0]]["grid"] != results[keys[1]]["grid"]  # 512 and 1024 tokens, then 1024 alone
    assert "--needle-kind" in results["provenance"][keys[1]]["command"]
    assert "--needle-kind" not in results["provenance"][keys[0]]["command"]


def test_a_bad_length_fails_before_any_task_runs(root, monkeypatch, capfd):
    from eval import run

    monkeypatch.chdir(root)
    argv = ["--run", "runs/tiny", "--tasks", "ppl,needle,kv_retrieval", "--context-lengths", "512", "--out", "bad.json"]
    assert run.main(argv) == 2
    out, err = capfd.readouterr()
    assert "ppl:" not in out and not (root / "bad.json").exists()
    assert err.strip().splitlines()[-1].startswith("error: --context-lengths: 512 exceeds the generation context")
    assert "--max-context 512" in err


def test_results_of_the_tasks_that_ran_are_written_when_a_later_one_fails(root, monkeypatch, capfd):
    from core.errors import ConfigError
    from eval import run

    def fail(*args: object, **kwargs: object) -> dict:
        raise ConfigError("--prompt: broken on purpose")

    monkeypatch.setattr(run, "task_sample", fail)
    monkeypatch.chdir(root)
    assert run.main(["--run", "runs/tiny", "--tasks", "ppl,sample", "--out", "partial.json", "--no-progress"]) == 2
    err = capfd.readouterr().err
    assert "error: --prompt: broken on purpose" in err and "results of the tasks that ran written" in err
    results = json.loads((root / "partial.json").read_text())
    assert results["ppl"]["loss"] > 0 and "sample" not in results


def test_two_calls_with_different_tasks_on_one_checkpoint_keep_both(root, monkeypatch, capfd):
    """The README's evaluation lines run in order keep every line's results (issue 40): the step's file gains each
    call's tasks, and a task run again replaces only its own entry, with the command it ran under."""
    from eval import run

    monkeypatch.chdir(root)
    out = root / "accumulate.json"
    first = ["--run", "runs/tiny", "--tasks", "ppl", "--out", str(out), "--limit", "2"]
    second = ["--run", "runs/tiny", "--tasks", "sample", "--out", str(out), "--max-new-tokens", "2"]
    assert run.main(first) == 0 and run.main(second) == 0
    results = json.loads(out.read_text())
    assert results["ppl"]["loss"] > 0 and 0 < results["sample"]["tokens"] <= 2, results
    assert results["provenance"]["ppl"]["command"] == shlex.join(["python", "-m", "eval.run", *first])
    assert run.main([*second[:-1], "3"]) == 0
    again = json.loads(out.read_text())
    assert again["ppl"] == results["ppl"] and 0 < again["sample"]["tokens"] <= 3
    assert again["provenance"]["ppl"] == results["provenance"]["ppl"]
    assert again["provenance"]["sample"]["command"].endswith("--max-new-tokens 3")
