"""Bad inputs and damaged files, one table: each row is a command line (with the damage prepared
before it runs), the exit code it must end with and a fragment of what it must say on stderr.

Every failing row must fail with exactly one stderr line, ``error: ...``, naming the option or
field, and never a traceback; a row with exit code 0 must print its fragment (a note) among
whatever else it says. Adding a case is adding a row. Commands run in this process (``main(argv)``
of the CLI module), so a row costs what the command costs: validation rows are instant, rows that
read a trained checkpoint share one tiny run made once per module and are marked slow.

Placeholders in argv: ``{tiny}`` launch/configs/tiny.toml, ``{tmp}`` the row's own temporary
folder, ``{run}`` a copy of the trained run (stopped at step 4 of 6), ``{ckpt}`` a copy of its latest
checkpoint; a row's ``setup`` damages those copies (or writes files) before the command runs.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, reseal_checkpoint

TINY = REPO / "launch" / "configs" / "tiny.toml"

# A shrunken tiny model on the embedded corpus: 256 tokens of context (room for a needle prompt),
# trained on 64-token windows to step 4 of 6 (checkpoints at 2 and 4), so a relaunch has work left.
RUN_SETS = (
    "model.d_model=64",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.d_ff=128",
    "model.vocab_size=512",
    "model.max_seq_len=256",
    "data.seq_len=64",
    "train.batch_size=4",
    "train.max_steps=6",
    "train.warmup_steps=2",
    "train.log_every=1",
    "train.device=cpu",
    "checkpoint.every=2",
    "checkpoint.keep=5",
    "eval.every=0",
    "eval.batches=1",
    "eval.sample_tokens=4",
    "log.tensorboard=true",
    'log.wandb="offline"',
)


def sets(*assignments: str) -> tuple[str, ...]:
    return tuple(arg for a in assignments for arg in ("--set", a))


def train(*assignments: str, dry_run: bool = True) -> tuple[str, ...]:
    """``python -m pretrain.train --config tiny.toml --set ...`` (validation only, unless ``dry_run=False``)."""
    return ("pretrain.train", "--config", "{tiny}", *sets(*assignments), *(("--dry-run",) if dry_run else ()))


def resume(*assignments: str) -> tuple[str, ...]:
    """The trained run's own command line again, in ``{run}``."""
    return train(*RUN_SETS, 'run.dir="{run}"', 'data.cache_dir="{cache}"', *assignments, dry_run=False)


# ---- damage ----------------------------------------------------------------------------------


def truncate(name: str, size: int) -> Callable[[Path], None]:
    """Cut checkpoint file ``name`` to ``size`` bytes (a negative size: that many bytes off its end)."""

    def damage(tmp: Path) -> None:
        path = tmp / "ckpt" / name
        os.truncate(path, size if size >= 0 else path.stat().st_size + size)

    return damage


def write(relative: str, data: bytes) -> Callable[[Path], None]:
    def setup(tmp: Path) -> None:
        path = tmp / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)

    return setup


def torn_metrics_line(tmp: Path) -> None:
    with open(tmp / "run" / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "loss": 4.2, "lr"')  # a kill in the middle of a write


@dataclass(frozen=True)
class Case:
    id: str
    argv: tuple[str, ...]  # the CLI module, then its arguments
    code: int
    message: str  # in the one error line (code != 0), or anywhere on stderr (code 0)
    setup: Callable[[Path], None] | None = None
    slow: bool = False  # reads the trained run
    no_cuda: bool = False  # runs as on a machine without CUDA (torch.cuda.is_available patched False), on any machine
    hangs: bool = False  # staged a hang (a FIFO read): the row fails after 120 s rather than holding the suite


CASES = [
    # -- config values (core/configlib.py, model/config.py): validation only
    Case("lr-nan", train("train.lr=nan"), 2, "train.lr: expected a finite number, got nan"),
    Case("lr-inf", train("train.lr=inf"), 2, "train.lr: expected a finite number, got inf"),
    Case("grad-clip-nan", train("train.grad_clip=nan"), 2, "train.grad_clip: expected a finite number"),
    Case("theta-minus-inf", train("model.rope.theta=-inf"), 2, "model.rope.theta: expected a finite number"),
    Case("init-std-negative", train("model.init_std=-1"), 2, "model.init_std: must be in (0.0, 1.0], got -1.0"),
    Case("init-std-absurd", train("model.init_std=1e30"), 2, "model.init_std: must be in (0.0, 1.0], got 1e+30"),
    Case("model-not-a-table", train("model=5"), 2, "model: expected a table, got 5"),
    Case("train-not-a-table", train("train=5"), 2, "train: expected a table, got 5"),
    Case("rope-not-a-table", train("model.rope=[1, 2]"), 2, "model.rope: expected a table, got [1, 2]"),
    Case("unknown-key", train("train.max_stepz=3"), 2, "train.max_stepz: unknown key; did you mean 'max_steps'?"),
    Case(
        "config-not-utf8",
        ("pretrain.train", "--config", "{tmp}/latin1.toml", "--dry-run"),
        2,
        "--config: {tmp}/latin1.toml is not UTF-8 text (byte 0xe9 at offset 17)",
        setup=write("latin1.toml", b'[run]\nname = "caf\xe9"\n'),
    ),
    # -- devices (core/device.py): resolved first when a run starts, before any data or run dir
    Case("device-tpu", train('run.dir="{tmp}/run"', "train.device=tpu", dry_run=False), 2, "train.device: 'tpu'"),
    Case(
        "device-cuda-absent",
        train('run.dir="{tmp}/run"', "train.device=cuda", dry_run=False),
        2,
        "train.device: 'cuda': CUDA is not available on this machine; available here: auto, cpu",
        no_cuda=True,
    ),
    # -- data.prepare: --out checked before the corpus is read or a tokenizer trained
    Case(
        "prepare-out-under-a-file",
        ("data.prepare", "--out", "{tmp}/file/shards"),
        2,
        "--out: '{tmp}/file/shards' would be inside '{tmp}/file', which is a file",
        setup=write("file", b"x"),
    ),
    Case("prepare-out-read-only", ("data.prepare", "--out", "/sys/shards"), 2, "--out: cannot write in '/sys'"),
    Case("prepare-path-missing", ("data.prepare", "--path", "{tmp}/none", "--out", "{tmp}/o"), 2, "--path: "),
    # -- bench.data_throughput
    Case("bench-data-missing", ("bench.data_throughput", "--data", "{tmp}/none"), 2, "--data: '{tmp}/none' does not"),
    # -- eval.run / pretrain.export on damaged checkpoints (run/checkpoint.py verify_checkpoint)
    Case("eval-no-run", ("eval.run", "--run", "{tmp}/none"), 2, "--run: no such directory"),
    *(
        Case(
            f"{cli}-{name}",
            (cli, "--checkpoint", "{ckpt}", "--out", "{tmp}/out.x", *extra),
            2,
            f"--checkpoint: {{ckpt}}/{message}",
            setup=damage,
            slow=True,
        )
        for cli, extra in (("eval.run", ("--tasks", "ppl")), ("pretrain.export", ()))
        for name, damage, message in (
            ("weights-truncated", truncate("model.safetensors", 1000), "model.safetensors is damaged (SafetensorError"),
            ("weights-empty", truncate("model.safetensors", 0), "model.safetensors is damaged (SafetensorError"),
            ("weights-tail-cut", truncate("model.safetensors", -100), "model.safetensors is damaged"),
            ("trainer-truncated", truncate("trainer.pt", 500), "trainer.pt is damaged (RuntimeError"),
            ("trainer-empty", truncate("trainer.pt", 0), "trainer.pt is damaged (EOFError)"),
        )
    ),
    Case("eval-device-tpu", ("eval.run", "--run", "{run}", "--device", "tpu"), 2, "--device: 'tpu'", slow=True),
    # -- new users: the demo's default context lengths, a torn metrics line on resume
    Case(
        "needle-default-lengths",
        (
            "eval.run",
            "--run",
            "{run}",
            "--tasks",
            "needle",
            "--depths",
            "0.5",
            "--no-progress",
            "--out",
            "{tmp}/n.json",
        ),
        0,
        "note: --context-lengths: skipping 64, too short for niah_single",
        slow=True,
    ),
    Case(
        "kv-no-length-fits",
        ("eval.run", "--run", "{run}", "--tasks", "kv_retrieval", "--no-progress", "--out", "{tmp}/kv.json"),
        2,
        "--context-lengths: 256 is too short for json_kv",
        slow=True,
    ),
    Case("torn-metrics-line", resume(), 0, "metrics.jsonl: dropped its last line", setup=torn_metrics_line, slow=True),
]


# ---- the trainer's own cases (pretrain/train.py, pretrain/loop.py): add rows here -------------
A_FILE = write("f", b"x")


def _start(*assignments: str) -> tuple[str, ...]:
    return train('data.cache_dir="{tmp}/cache"', "train.max_steps=2", *assignments, dry_run=False)


TRAINER_CASES: list[Case] = [
    Case("run-dir-empty", train('run.dir=""'), 2, "run.dir: must name a directory"),
    Case(
        "run-dir-is-a-file", _start('run.dir="{tmp}/f"'), 2, "run.dir: cannot write", setup=write("f", b"x"), slow=True
    ),
    Case(
        "run-dir-under-a-file", _start('run.dir="{tmp}/f/run"'), 2, "run.dir: cannot", setup=write("f", b"x"), slow=True
    ),
    Case("run-dir-read-only", _start('run.dir="/sys/run"'), 2, "run.dir: cannot write /sys/run", slow=True),
]


# ---- issue 50: results silently wrong, hangs, tracebacks after the work (tests/pretrain/test_attacks.py lists them)
# a valid SentencePiece model, not the trained run's
OTHER_TOKENIZER = (
    REPO / "tests" / "fixtures" / "resume_v1" / "run" / "checkpoints" / "step_00000003" / "tokenizer.model"
)


def copy_in(source: Path, relative: str) -> Callable[[Path], None]:
    def setup(tmp: Path) -> None:
        shutil.copyfile(source, tmp / relative)

    return setup


def tokenizer_folder_with_a_fifo(tmp: Path) -> None:
    """A tokenizer folder whose tokenizer_config.json is a FIFO (reading it would wait for a writer forever)."""
    (tmp / "tok").mkdir()
    (tmp / "tok" / "tokenizer.json").write_text("{}")
    os.mkfifo(tmp / "tok" / "tokenizer_config.json")


def _eval(*args: str) -> tuple[str, ...]:
    return ("eval.run", "--checkpoint", "{ckpt}", "--no-progress", *args)


ISSUE_50_CASES = [
    # a different valid tokenizer in a checkpoint (meta.json untouched): checked against the manifest like the weights
    *(
        Case(
            f"{name}-other-tokenizer",
            (cli, "--checkpoint", "{ckpt}", "--out", out, *extra),
            2,
            "--checkpoint: {ckpt}/tokenizer.model ",
            setup=copy_in(OTHER_TOKENIZER, "ckpt/tokenizer.model"),
            slow=True,
        )
        for name, cli, out, extra in (
            ("eval", "eval.run", "{tmp}/e.json", ("--tasks", "ppl")),
            ("export", "pretrain.export", "{tmp}/o.safetensors", ()),
            ("export-hf", "pretrain.export", "{tmp}/hf", ("--format", "hf")),
        )
    ),
    Case(
        "tokenizer-config-fifo",
        train('data.tokenizer="{tmp}/tok"'),
        2,
        "data.tokenizer: {tmp}/tok/tokenizer_config.json is a FIFO, not a regular file",
        setup=tokenizer_folder_with_a_fifo,
        hangs=True,
    ),
    # --out checked before any task runs
    Case(
        "eval-out-a-directory", _eval("--tasks", "ppl", "--out", "{tmp}"), 2, "--out: {tmp} is a directory", slow=True
    ),
    Case(
        "eval-out-read-only",
        _eval("--tasks", "ppl", "--out", "/sys/r.json"),
        2,
        "--out: cannot write in /sys",
        slow=True,
    ),
    Case(
        "eval-out-proc", _eval("--tasks", "ppl", "--out", "/proc/r.json"), 2, "--out: cannot write in /proc", slow=True
    ),
    # an earlier results file the JSON reader cannot take: replaced with one note after the task ran, no traceback
    Case(
        "results-file-nul",
        _eval("--tasks", "sample", "--max-new-tokens", "1", "--out", "{tmp}/r.json"),
        0,
        "note: {tmp}/r.json held results of a",
        setup=write("r.json", b'{"checkpoint": "a\\u0000b", "step": 1, "ppl": {"loss": 1.0}}'),
        slow=True,
    ),
    Case(
        "results-file-5000-digits",
        _eval("--tasks", "sample", "--max-new-tokens", "1", "--out", "{tmp}/r.json"),
        0,
        "note: {tmp}/r.json: not a results file (ValueError",
        setup=write("r.json", b'{"checkpoint": "x", "n": ' + b"9" * 5000 + b"}"),
        slow=True,
    ),
    Case(
        "ppl-data-no-two-tokens",
        _eval("--tasks", "ppl", "--ppl-data", "{tmp}/one.txt", "--out", "{tmp}/p.json"),
        2,
        "--ppl-data: {tmp}/one.txt holds no document of two or more tokens",
        setup=write("one.txt", b"a"),
        slow=True,
    ),
    # collective timeouts: a range, at validation
    Case(
        "collective-timeout-1e308",
        train("train.collective_timeout=1e308"),
        2,
        "train.collective_timeout: must be in [1.0, 86400.0], got 1e+308",
    ),
    Case(
        "checkpoint-collective-timeout-tiny",
        train("checkpoint.collective_timeout=0.001"),
        2,
        "checkpoint.collective_timeout: must be 0 (= train.collective_timeout) or in [10.0, 86400.0] seconds, got 0.0",
    ),
]


# ---- running a row ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict[str, Path]:
    """One tiny run, stopped at step 4 of 6 (checkpoints at steps 2 and 4)."""
    root = tmp_path_factory.mktemp("reliability")
    run, cache = root / "run", root / "cache"
    argv = [a.format(tiny=TINY, run=run, cache=cache) for a in resume("train.stop_at=4")]
    env = {**os.environ, "WANDB_MODE": "disabled"}
    proc = subprocess.run([sys.executable, "-m", *argv], cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"run": run, "cache": cache}


def run_cli(argv: list[str], capsys) -> tuple[int, str]:
    """``main(argv[1:])`` of module ``argv[0]``: (exit code, stderr). An exception is a failed row."""
    module = importlib.import_module(argv[0])
    try:
        code = module.main(argv[1:])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except Exception as exc:  # the point of the table: this must not happen
        pytest.fail(f"{' '.join(argv)} raised {type(exc).__name__}: {exc} (a traceback, not one line)")
    return code, capsys.readouterr().err


def _marks(case: Case) -> list:
    return [pytest.mark.slow] * case.slow + [pytest.mark.timeout(120)] * case.hangs


@pytest.mark.parametrize(
    "case", [pytest.param(c, id=c.id, marks=_marks(c)) for c in CASES + TRAINER_CASES + ISSUE_50_CASES]
)
def test_bad_input_is_one_line(case: Case, tmp_path, capsys, request, monkeypatch):
    places = {"tiny": str(TINY), "tmp": str(tmp_path)}
    if case.slow:
        trained = request.getfixturevalue("trained")
        shutil.copytree(trained["run"], tmp_path / "run")
        latest = sorted((tmp_path / "run" / "checkpoints").glob("step_*"))[-1]
        shutil.copytree(latest, tmp_path / "ckpt")
        places |= {"run": str(tmp_path / "run"), "ckpt": str(tmp_path / "ckpt"), "cache": str(trained["cache"])}
    if case.setup is not None:
        case.setup(tmp_path)
    monkeypatch.chdir(tmp_path)  # nothing a row writes by default lands in the checkout
    monkeypatch.setenv("WANDB_MODE", "disabled")
    if case.no_cuda:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, err = run_cli([a.format(**places) for a in case.argv], capsys)
    message = case.message.format(**places)
    assert "Traceback" not in err, err
    assert code == case.code, err
    if case.code == 0:
        assert message in err, err
        return
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"stderr is not one line:\n{err}"
    assert lines[0].startswith("error: ") and message in lines[0], lines[0]


# ---- outputs ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_eval_json_has_no_bare_nan(trained, tmp_path, capsys):
    """A diverged checkpoint's perplexity is NaN: the JSON says "nan" (a string), never a bare NaN."""
    from safetensors.torch import load_file, save_file

    ckpt = tmp_path / "ckpt"
    shutil.copytree(sorted((trained["run"] / "checkpoints").glob("step_*"))[-1], ckpt)
    weights = load_file(ckpt / "model.safetensors")
    save_file({k: torch.full_like(v, float("nan")) for k, v in weights.items()}, ckpt / "model.safetensors")
    reseal_checkpoint(ckpt)  # a NaN checkpoint as training would have written it
    code, err = run_cli(
        ["eval.run", "--checkpoint", str(ckpt), "--tasks", "ppl", "--out", str(tmp_path / "r.json")], capsys
    )
    assert code == 0, err

    def bare(constant: str):
        raise AssertionError(f"bare {constant} in the JSON")

    results = json.loads((tmp_path / "r.json").read_text(), parse_constant=bare)
    assert results["ppl"]["loss"] == "nan" and results["ppl"]["perplexity"] == "nan"


@pytest.mark.slow
def test_relaunching_a_finished_run_writes_nothing_new(trained, tmp_path):
    """TensorBoard and W&B start on the first record: a relaunch with nothing to do adds no event file
    and no W&B offline run, even with W&B on (WANDB_MODE unset, log.wandb = offline)."""
    run = tmp_path / "run"
    shutil.copytree(trained["run"], run)
    places = {"tiny": str(TINY), "run": str(run), "cache": str(trained["cache"])}
    argv = [a.format(**places) for a in resume()]
    env = {k: v for k, v in os.environ.items() if k != "WANDB_MODE"} | {"WANDB_SILENT": "true"}
    finish = subprocess.run([sys.executable, "-m", *argv], cwd=REPO, capture_output=True, text=True, env=env)
    assert finish.returncode == 0, finish.stderr[-3000:]
    before = sorted(str(p.relative_to(run)) for p in run.rglob("*") if "tb" in p.parts or "wandb" in p.parts)
    again = subprocess.run([sys.executable, "-m", *argv], cwd=REPO, capture_output=True, text=True, env=env)
    assert again.returncode == 0 and "nothing to do" in again.stdout, again.stderr[-3000:]
    after = sorted(str(p.relative_to(run)) for p in run.rglob("*") if "tb" in p.parts or "wandb" in p.parts)
    assert after == before
