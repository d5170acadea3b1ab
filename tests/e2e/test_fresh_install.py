"""The README's two set-up commands, guarded as a newcomer runs them.

The demo command must work with exactly what ``pip install -e .`` installs. CI installs ``.[dev]``, so
it cannot notice a base-install code path that imports an optional extra; here the demo runs in a
subprocess where every package that only an extra brings (read off ``setup.cfg``) raises
``ModuleNotFoundError`` on import, with an empty HOME.
"""

from __future__ import annotations

import configparser
import importlib.metadata
import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from tests.conftest import REPO

README = REPO / "README.md"


def _fenced_command(after: str) -> str:
    """The one-line command in the first ```bash block following the paragraph starting with ``after``."""
    text = README.read_text()
    start = text.index(after)
    block = re.search(r"```bash\n(.*?)\n```", text[start:], re.S)
    assert block, f"README: no bash block after {after!r}"
    lines = [line for line in block.group(1).splitlines() if line.strip()]
    assert len(lines) == 1, f"README: the set-up command after {after!r} must be one line, got {lines}"
    return lines[0]


def readme_demo_command() -> str:
    return _fenced_command("Demo:")


def readme_test_command() -> str:
    return _fenced_command("Tests (what `.ci/run` runs)")


def readme_cpu_install_command() -> str:
    return _fenced_command("On a machine without a CUDA GPU")


def readme_smoke_command() -> str:
    return _fenced_command("A smoke run")


def _requirement_name(line: str) -> str:
    return re.split(r"[\s<>=!~\[;]", line.strip(), maxsplit=1)[0].lower().replace("_", "-")


def _requirements(value: str) -> set[str]:
    return {_requirement_name(x) for x in value.splitlines() if x.strip() and not x.strip().startswith("#")}


def optional_modules() -> set[str]:
    """Import names of the distributions that only an extra installs (not ``install_requires``)."""
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    base = _requirements(cfg["options"]["install_requires"])
    extras = set().union(*(_requirements(v) for v in cfg["options.extras_require"].values()))
    extras -= base | {"pytest", "pytest-timeout"}  # the test runner itself is not on the product path
    by_dist: dict[str, set[str]] = {}
    for module, dists in importlib.metadata.packages_distributions().items():
        for dist in dists:
            by_dist.setdefault(dist.lower().replace("_", "-"), set()).add(module)
    modules: set[str] = set()
    for dist in extras:
        # a distribution absent here still gets its conventional import name (flash-attn -> flash_attn)
        names = {m for m in by_dist.get(dist, set()) if m.isidentifier() and not m.startswith("_")}
        modules |= names or {dist.replace("-", "_")}
    # deps pulled in only by extras (lm-eval's, deepspeed's) are not blocked: the base path may not
    # import them either, but they are not named in setup.cfg. The named ones are what users opt into.
    return modules


# Every import finder answers "not found" for a blocked name, so the packages look exactly as absent as on
# a machine without the extra: `import x` raises ModuleNotFoundError and importlib.util.find_spec returns None.
BLOCKER = """
import sys

BLOCKED = {blocked!r}


class _Absent:
    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            return None
        return self.finder.find_spec(name, path, target)

    def __getattr__(self, attr):
        return getattr(self.finder, attr)


sys.meta_path[:] = [_Absent(f) if hasattr(f, "find_spec") else f for f in sys.meta_path]
"""


@pytest.fixture
def fresh_env(tmp_path) -> dict[str, str]:
    """A subprocess environment with the optional extras unimportable and an empty HOME."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCKER.format(blocked=sorted(optional_modules())))
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "HF_", "XDG_", "MPL"))}
    env.update(PYTHONPATH=f"{site}{os.pathsep}{REPO}", HOME=str(home), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    return env


def test_optional_modules_come_from_the_extras():
    mods = optional_modules()
    for name in ("lm_eval", "deepspeed", "transformers", "flash_attn"):
        assert name in mods, name
    assert not mods & {"torch", "numpy", "safetensors", "sentencepiece"}


def test_blocker_refuses_the_extras_and_only_them(fresh_env):
    """The guard itself: an extra cannot be imported under it, a base package can."""
    assert "lm_eval" in optional_modules()
    blocked = "lm_eval"
    bad = subprocess.run([sys.executable, "-c", f"import {blocked}"], env=fresh_env, capture_output=True, text=True)
    assert bad.returncode != 0 and f"No module named '{blocked}'" in bad.stderr
    spec = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({blocked!r}) is not None)"
    assert subprocess.run([sys.executable, "-c", spec], env=fresh_env).returncode == 0
    ok = subprocess.run([sys.executable, "-c", "import torch, numpy"], env=fresh_env, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr


def test_ci_runs_exactly_the_readme_test_command():
    command = readme_test_command()
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    assert command in [line.strip() for line in ci], f".ci/run does not run the README's test command {command!r}"


def _smoke_steps() -> list[list[str]]:
    """The README's smoke run, as written: the demo's own training and evaluation commands, shorter."""
    demo = [shlex.split(part) for part in readme_demo_command().split("&&")]
    assert demo[0][:2] == ["pip", "install"] and demo[0][-1] == ".", f"demo must install the base package: {demo[0]}"
    steps = [shlex.split(part) for part in readme_smoke_command().split("&&")]
    train, evaluate = steps
    assert train[: len(demo[1])] == demo[1] and evaluate[:3] == demo[2][:3] == ["python", "-m", "eval.run"], steps
    return [[sys.executable, *step[1:]] for step in steps]


def test_readme_cpu_install_line_pins_setup_cfgs_torch_from_the_cpu_index():
    argv = shlex.split(readme_cpu_install_command())
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    pin = next(x.strip() for x in cfg["options"]["install_requires"].splitlines() if x.strip().startswith("torch=="))
    assert argv[:3] == ["pip", "install", pin] and argv[3:] == ["--index-url", "https://download.pytorch.org/whl/cpu"]


@pytest.mark.slow
def test_readme_cpu_install_line_runs_as_written():
    """With the pinned torch installed (as the demo's machine has it after this line), the line is a no-op that
    asks no index: it runs as written, with this interpreter's pip."""
    argv = shlex.split(readme_cpu_install_command())
    proc = subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "Requirement already satisfied: torch==" in proc.stdout, proc.stderr[-2000:]


@pytest.mark.slow
def test_readme_smoke_run_runs_as_written_with_the_base_install_only(fresh_env, tmp_path):
    """The README's smoke run, as written (its relative paths in a folder with ``launch`` linked), on a base install:
    the demo's training shortened to 20 steps with a checkpoint, then its evaluation."""
    (tmp_path / "launch").symlink_to(REPO / "launch", target_is_directory=True)
    run_dir = tmp_path / "runs" / "smoke"
    outputs = []
    for argv in _smoke_steps():
        proc = subprocess.run(argv, cwd=tmp_path, env=fresh_env, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, f"{' '.join(argv[1:4])} exited {proc.returncode}:\n{proc.stderr[-3000:]}"
        outputs.append(proc.stdout)
    assert "sample:" in outputs[0] and (run_dir / "checkpoints" / "step_00000020").is_dir()
    # the two validation figures say what each scores (eval.batches of the split, then all of it)
    assert "(eval.batches = 8; eval.run --tasks ppl scores the whole validation split)" in outputs[0], outputs[0]
    assert re.search(r"perplexity \d.* \(the whole validation split\)", outputs[1]), outputs[1]
    results = json.loads(next((run_dir / "eval").glob("*.json")).read_text())
    assert results["ppl"]["perplexity"] > 1 and results["sample"]["text"]
    assert (run_dir / "eval").glob("*.png"), "the loss-curve plot is part of the demo path"


# What each journey's command says on a machine without its extra: (module, argv, the extra named). {tmp} is a
# scratch folder; the argv need no trained run (each CLI checks for its optional package before reading one).
TINY = str(REPO / "launch" / "configs" / "tiny.toml")
WITHOUT_EXTRA = [
    ("pretrain.export", ["--run", "{tmp}/run", "--format", "hf", "--out", "{tmp}/hf"], "hf"),
    ("data.tokenizer", ["encode", "--tokenizer", "{tmp}/slow_tokenizer", "--text", "hi"], "hf"),
    ("eval.run", ["--run", "{tmp}/run", "--tasks", "ppl,hellaswag"], "eval"),
    ("eval.lm_eval", ["--model", "focused", "--tasks", "hellaswag"], "eval"),
    ("pretrain.train", ["--config", TINY, "--set", "train.engine=deepspeed"], "deepspeed"),
    ("pretrain.train", ["--config", TINY, "--set", 'eval.tasks=["hellaswag"]'], "eval"),
    ("pretrain.train", ["--config", TINY, "--set", 'train.float8="rowwise"'], "float8"),
    (
        "pretrain.train",
        ["--config", TINY, "--set", "model.attention.full.backend=flash_attn"],
        "flash",
    ),
]

# Every command above in one interpreter (one start-up of torch, not seven), each through its module's main(argv): the
# `python -m` entry point of every CLI is `sys.exit(main())`, so exit code and stderr are what a user sees.
DRIVER = """
import contextlib, importlib, io, json, sys

out = []
for module, argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = importlib.import_module(module).main(argv)
        except SystemExit as exc:
            code = exc.code
        except BaseException as exc:
            code = f"{type(exc).__name__}: {exc}"
    out.append([code, err.getvalue()])
print(json.dumps(out))
"""


def test_each_journey_without_its_extra_is_one_line_naming_it(fresh_env, tmp_path):
    """Every optional package of setup.cfg's extras hidden (as on a base install): each journey's command exits 2
    with one line naming the extra that brings what it needs."""
    slow = tmp_path / "slow_tokenizer"  # a folder only transformers converts (GPT-2's vocab.json + merges.txt)
    slow.mkdir()
    (slow / "vocab.json").write_text('{"a": 0}')
    (slow / "merges.txt").write_text("#version: 0.2\n")
    (tmp_path / "home" / "eval_data").mkdir()
    fresh_env["FOCUSED_PRETRAIN_EVAL_DATA"] = str(tmp_path / "home" / "eval_data")
    fresh_env["WANDB_MODE"] = "disabled"
    calls = [[module, [a.format(tmp=tmp_path) for a in argv]] for module, argv, _ in WITHOUT_EXTRA]
    for call in calls:
        if call[0] == "pretrain.train":
            call[1] += ["--set", f"run.dir={tmp_path / 'runs' / 'x'}"]
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER, json.dumps(calls)], cwd=tmp_path, env=fresh_env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for (module, argv, extra), (code, err) in zip(WITHOUT_EXTRA, json.loads(proc.stdout.splitlines()[-1])):
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1, (module, argv, code, err[-2000:])
        assert lines[0].startswith("error: ") and f"pip install -e '.[{extra}]'" in lines[0], (module, lines)
    assert not (tmp_path / "runs").exists(), "no run directory is made before the extra is found missing"
