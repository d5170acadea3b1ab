"""Shared fixtures and the skip policy. Tests run offline and on CPU.

Locally a test skips when a ``[dev]`` dependency or the ``../shared`` data folder is absent. Under CI (the ``CI``
environment variable set, as ``.ci/run`` does) every such skip fails instead, with one line naming what is missing:
a broken install or a moved data folder must not pass as a row of skips. The only skip CI allows is a test marked
``@pytest.mark.cuda`` (it needs a CUDA device) on a machine without one.
"""

from __future__ import annotations

import os
from collections.abc import Generator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
ATTENTION_TESTS = REPO / "tests" / "attention"

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")


def under_ci() -> bool:
    """``CI`` is set to anything but empty, 0 or false (CI services set ``CI=true``; so does ``.ci/run``)."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--long-context", action="store_true", help="also run tests marked long_context (minutes each on 2 cores)"
    )
    parser.addoption(
        "--triton-targets",
        action="store_true",
        help="also run tests marked triton_targets (every kernel configuration compiled for sm_80 / sm_86 / sm_90)",
    )


def pytest_configure(config: pytest.Config) -> None:
    # registered here too, so --strict-markers accepts it where pytest-xdist is absent
    config.addinivalue_line("markers", "xdist_group(name): tests of one group run in one pytest-xdist worker")
    config.addinivalue_line("markers", "cuda: needs a CUDA device; skipped without one (the only skip CI allows)")
    config.addinivalue_line(
        "markers", "long_context: trains at T = 8192 for minutes; deselected (not skipped) unless --long-context"
    )
    config.addinivalue_line(
        "markers",
        "triton_targets: Triton kernels compiled for GPU targets past the CI tier; deselected unless --triton-targets",
    )
    # the test processes collect garbage as the programs they run do (0.5 s of full collections per process
    # otherwise, and 48 CPU-s in the two xdist workers together over the suite: issue 39)
    from core import collector

    collector.for_programs()
    _share_cores_between_workers(config)
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist: groups start in the order collected (below)
        config.option.loadscopereorder = False


def _share_cores_between_workers(config: pytest.Config) -> None:
    """A pytest-xdist worker (and every process it launches) gets its share of the cores as torch threads. With
    torch's default (every core per process) two workers on two cores run four busy threads, and each of an
    attention path's hundreds of small ops waits at its parallel region's barrier for a descheduled thread: the
    blockwise training paths ran 3-5x slower beside another worker than alone. An explicit OMP_NUM_THREADS wins."""
    workers = getattr(config, "workerinput", {}).get("workercount", 1)
    if workers < 2 or "OMP_NUM_THREADS" in os.environ:
        return
    threads = max(1, (os.cpu_count() or 1) // workers)
    os.environ["OMP_NUM_THREADS"] = str(threads)  # subprocesses: torchrun keeps a value it is given
    import torch

    torch.set_num_threads(threads)


def _deselect_long_context(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``long_context`` are deselected unless ``--long-context`` is given: they outlast the suite's
    time budget, and a deselection is not a skip (which CI would fail). ``triton_targets`` likewise, unless
    ``--triton-targets`` (tests/attention/test_triton_targets.py's compilations beyond the CI tier)."""
    for marker, option in (("long_context", "--long-context"), ("triton_targets", "--triton-targets")):
        if config.getoption(option):
            continue
        dropped = [item for item in items if item.get_closest_marker(marker) is not None]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = [item for item in items if item.get_closest_marker(marker) is None]


# Modules that share a session-scoped run (tests/pretrain/conftest.py's engine runs) go to one pytest-xdist worker.
SHARED_RUNS = {"test_safe_loading.py": "engine-runs", "test_attacks.py": "engine-runs"}
# Seconds of test time per xdist group, rounded from the CI-command run of 2026-11-27 (third session, docs/testing.md;
# tensor parallelism and launch configs lowered for the changes after it): the groups start longest first, so the
# last ones to start are short and the two workers finish together (pytest-xdist orders groups by their number of
# tests, which put a few long launch modules last: about 80 s of one idle worker). A group not listed starts after
# these, in collection order; the figures need only be roughly right.
MEASURED_SECONDS = {
    "tests/e2e/test_distributed.py": 215,
    "tests/e2e/test_matrix.py": 210,
    "tests/e2e/test_tensor_parallel.py": 200,
    "engine-runs": 170,
    "tests/e2e/test_train_cli.py": 140,
    "tests/e2e/test_launch_configs.py": 120,
    "tests/e2e/test_recipes.py": 100,
    "tests/mutations/test_mutations.py": 80,
    "tests/attention/test_compile_clean.py": 70,
    "tests/e2e/test_stalled_rank.py": 57,
    "tests/e2e/test_slurm.py": 57,
    "tests/interop/test_lm_eval.py": 55,
    "tests/attention/test_compiled_block.py": 53,
    "tests/e2e/test_retrofit.py": 52,
    "tests/attention/focus/test_hard.py": 50,
    "tests/e2e/test_data_cli.py": 49,
    "tests/interop/test_hf.py": 44,
    "tests/e2e/test_cp_memory.py": 43,
    "tests/e2e/test_fresh_install.py": 36,
    "tests/attention/test_triton_targets.py": 64,  # 72 compilations: 64 s alone (2026-11-28), not a CI-command run
}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (the README's test command: ``-n 2 --dist loadgroup``) a module's tests go to one worker
    together, so a launch that a module-scoped fixture shares runs once: each test gets its module as its
    ``xdist_group`` (tryfirst: before xdist reads the marks), and the groups start longest first
    (``MEASURED_SECONDS``). Without ``-n`` the marks do nothing."""
    _deselect_long_context(config, items)
    groups = {}
    for item in items:
        group = SHARED_RUNS.get(item.path.name) or (
            str(item.path.relative_to(REPO)) if item.path.is_relative_to(REPO) else str(item.path)
        )
        item.add_marker(pytest.mark.xdist_group(group))
        groups[item] = group
    items.sort(key=lambda item: -MEASURED_SECONDS.get(groups[item], 0))  # stable: a module's tests stay in order


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("cuda") is not None:
        import torch

        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA device")


def _skip_reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return str(reason).removeprefix("Skipped: ")


def _fail_skip_under_ci(report: pytest.TestReport | pytest.CollectReport, allowed: bool) -> None:
    """Turn a skip into a failure whose whole report is one line (``xfail`` outcomes are left alone)."""
    if not report.skipped or hasattr(report, "wasxfail") or allowed or not under_ci():
        return
    report.outcome = "failed"
    report.longrepr = f"CI: a skip fails here (only @pytest.mark.cuda tests may skip): {_skip_reason(report)}"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report: pytest.TestReport = yield
    _fail_skip_under_ci(report, allowed=item.get_closest_marker("cuda") is not None)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(
    collector: pytest.Collector,
) -> Generator[None, pytest.CollectReport, pytest.CollectReport]:
    """A module-level ``importorskip`` skips the whole file at collection: under CI that is an error."""
    report: pytest.CollectReport = yield
    _fail_skip_under_ci(report, allowed=False)
    return report


@pytest.fixture(autouse=True)
def _attention_tests_start_from_one_seed(request: pytest.FixtureRequest) -> None:
    """Every attention test starts from ``torch.manual_seed(0)``: what a test draws without a generator of its own
    (module initialisation, a bare ``torch.randn``) is then the same on every run, whatever ran before it or was
    deselected, so a failure reproduces."""
    if ATTENTION_TESTS in request.path.parents:
        import torch

        torch.manual_seed(0)


@pytest.fixture(scope="session")
def shared_data() -> Path:
    path = SHARED / "data"
    if not path.is_dir():
        pytest.skip(f"the shared data folder {path} is absent (it sits beside the checkout: ../shared/data)")
    return path


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """One tokenizer/token cache for the whole session, so a tokenizer is trained once."""
    return tmp_path_factory.mktemp("cache")


def small_model_config(family: str = "llama", **overrides):
    """A small model shape for unit tests (GPT-2: biases and a tied head, as the family has)."""
    from model.config import ModelConfig

    shape = dict(family=family, vocab_size=50, max_seq_len=16, d_model=32, n_layers=1, n_heads=4)
    if family == "gpt2":
        shape.update(bias=True, tie_embeddings=True)
    return ModelConfig(**{**shape, **overrides})


def run_cli(module: str, *args, timeout: int = 300, **kwargs):
    """``python -m <module> args`` from the repository root, output captured as text."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", module, *map(str, args)]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, **kwargs)


def reseal_checkpoint(checkpoint: Path) -> None:
    """Record the files of ``checkpoint`` as they now are in its ``meta.json`` (sizes and content checksums),
    as whoever rewrote them could: for tests whose subject is what a reader does with such files, not the
    integrity check that would otherwise stop them first."""
    import json

    from run import checksums

    meta_file = checkpoint / "meta.json"
    meta = json.loads(meta_file.read_text())
    names = sorted(p.relative_to(checkpoint).as_posix() for p in checkpoint.rglob("*") if p.is_file())
    names = [name for name in names if name != "meta.json"]
    meta["format"] = meta.get("format", 1)
    meta["files"] = {name: (checkpoint / name).stat().st_size for name in names}
    meta["checksums"] = checksums.digests(checkpoint, names)
    meta_file.write_text(json.dumps(meta))
