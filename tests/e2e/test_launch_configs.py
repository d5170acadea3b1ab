"""Every launch config starts: each distinct (variant, engine, precision, activation checkpointing, compile, data
source) combination that ``launch/configs/`` holds (the files, ``tiny*.toml`` among them, and every derived
``<preset>_<variant>.toml``: ``launch.presets.derived_names``; a derived config's full recomputation counts as its
selective sibling's, ``DERIVED_RECOMPUTE``, and an eval-only variant's derived configs, which train as full
attention, count as one), with only the shape shrunk (layers, width, vocabulary, sequence, batch, steps, a streamed
source's tokenizer sample) and the data made local, runs two optimizer steps under its own engine: 2 gloo processes
for the data-parallel engines, one for ``single``. Precision and compile stay as configured (bf16 is CPU autocast
here). A config that cannot start fails its combination's test.

Local data: a named hub source reads a local mirror of its hub repo in the repo's own layout
(``tests/data/mirrors.py``, from ``../shared/data``; without it, local text files under ``data.source = local``);
``local`` with no path gets local text files; ``train.init_from`` gets a base run of the same shrunk shape.

The combinations and their results are printed and written to ``launch_configs.md`` under pytest's base
temporary directory (or ``$MATRIX_SUMMARY_DIR``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from core import configlib
from launch.presets import CONFIG_DIR, derived_names
from model.attention import registry
from run.config import derived_config, run_config_from_dict
from run.engines import ENGINE_SPECS
from run.parallel import ParallelLayout
from tests.conftest import SHARED
from tests.e2e.helpers import HAVE_DEEPSPEED, run_sequence, train_rows, write_summary
from tests.e2e.test_train_cli import overrides

STEPS = 2
DERIVED = frozenset(derived_names())
HUB_SOURCES = ("slimpajama", "fineweb-edu", "openwebtext", "pg19")


def _config_data(name: str) -> dict:
    path = CONFIG_DIR / name
    return derived_config(path) or configlib.load_toml(path)


# A derived config (a preset with another variant swapped in) under full recomputation is covered by its sibling
# under selective recomputation: both run the variant's ops inside the checkpoint wrapper and the compiled block;
# which activations the wrapper keeps is a policy, checked per variant by test_matrix.py's fsdp2+ac legs. The preset
# itself (full attention) keeps its own combination. (Issue 39: five compiled 2-process runs of about 12 s each.)
DERIVED_RECOMPUTE = {"full": "selective"}


def combination(name: str) -> tuple[str, ...]:
    cfg = run_config_from_dict(_config_data(name))
    t = cfg.train
    recompute = t.activation_checkpointing
    if name in DERIVED:
        recompute = DERIVED_RECOMPUTE.get(recompute, recompute)
        if not registry[cfg.model.attention.kind].cls.trainable:  # trains as full attention: one start is enough
            recompute = "any"
    engine = t.engine
    options = t.engine_options.get(t.engine)
    if options is not None:
        changed = {k: v for k, v in vars(options).items() if v != getattr(type(options)(), k)}
        engine += "".join(f" {k}={v}" for k, v in changed.items() if k != "config")
    compiled = "compile" if t.compile else "eager"
    return (cfg.model.attention.kind, engine, t.precision, recompute, compiled, cfg.data.source)


def combinations() -> dict[str, str]:
    """combination label -> the first config holding it (files in name order, then the derived configs)."""
    out: dict[str, str] = {}
    for name in [*sorted(p.name for p in CONFIG_DIR.glob("*.toml")), *derived_names()]:
        out.setdefault(" / ".join(combination(name)), name)
    return out


COMBINATIONS = combinations()
_launches: dict[int, dict[str, str]] = {}
RESULTS: dict[str, str] = {}


def _text_folder(root: Path) -> Path:
    """A few local .txt documents (the embedded plays)."""
    folder = root / "texts"
    if not folder.is_dir():
        from itertools import islice

        from data.embedded import iter_embedded

        folder.mkdir(parents=True)
        for doc in islice(iter_embedded(), 6):
            (folder / f"{doc.id}.txt").write_text(doc.text)
    return folder


def _local_data(source: str, root: Path) -> dict:
    """Overrides that make ``source`` local (the same keys a mixture entry has)."""
    if source in HUB_SOURCES:
        if not (SHARED / "data").is_dir():
            return {"source": "local", "path": str(_text_folder(root)), "name": ""}
        from tests.data.mirrors import BUILDERS

        mirror = root / "mirrors" / source
        if not mirror.is_dir():
            BUILDERS[source](mirror, SHARED / "data")
        return {"path": str(mirror)}
    if source == "local":
        return {"path": str(_text_folder(root))}
    if source == "embedded":
        return {}
    raise AssertionError(f"data.source = {source!r}: this test has no local stand-in for it yet")


def shrunk(name: str, root: Path, cache_dir: Path) -> list[str]:
    data = _config_data(name)
    cfg = run_config_from_dict(data)
    model, train = cfg.model, cfg.train
    extra: dict = {
        "model.n_layers": 2,
        "model.d_model": 64,
        "model.n_heads": 4,
        "model.n_kv_heads": 2 if model.kv_heads < model.n_heads else 0,
        "model.d_ff": 128,
        "model.vocab_size": 512,
        "model.max_seq_len": 64,
        "data.seq_len": 64,
        "train.max_steps": STEPS,
        "train.batch_size": 4,
        "train.micro_batch_size": 1 if train.micro_batch_size else 0,  # accumulation stays when configured
        "train.warmup_steps": min(train.warmup_steps, 1),
        "train.stop_at": 0,
        "train.log_every": 1,
        "checkpoint.every": 0,
        "eval.every": 0,
        "eval.batches": 1,
        # a streamed config trains its tokenizer on this many documents (gpt2-1.5b: 100,000, 40 s on the mirror)
        "data.tokenizer_sample_docs": min(cfg.data.tokenizer_sample_docs, 500),
    }
    if (
        ParallelLayout.replica(train.parallel).model_parallel > 1
    ):  # 2 processes: context parallelism kept (cp=2) where set, else tp=2
        extra |= {"train.parallel.cp": min(train.parallel.cp, 2)}
        extra |= {"train.parallel.tp": 1 if train.parallel.cp > 1 else min(train.parallel.tp, 2)}
    if cfg.data.source == "mixture":
        raise AssertionError(f"{name}: data.source = mixture: give this test local stand-ins for its entries")
    extra |= {f"data.{k}": v for k, v in _local_data(cfg.data.source, root).items()}
    if cfg.data.tokenizer != "train" and not Path(cfg.data.tokenizer).exists():
        extra["data.tokenizer"] = "train"  # a tokenizer of a run that does not exist here (see init_from)
    if train.init_from:
        base = _base_run(root, cache_dir)
        extra |= {"train.init_from": str(base), "data.tokenizer": str(base / "tokenizer.model")}
    return [
        "--config",
        str(CONFIG_DIR / name),
        *overrides(root / "runs" / name.removesuffix(".toml"), cache_dir, **extra),
    ]


def _base_run(root: Path, cache_dir: Path) -> Path:
    """A checkpoint of the shrunk tiny model for configs that continue another run."""
    run_dir = root / "runs" / "base"
    checkpoint = run_dir / "checkpoints" / f"step_{STEPS:08d}"
    if not checkpoint.is_dir():
        args = overrides(run_dir, cache_dir, **{"model.d_model": 64, "model.n_layers": 2, "train.max_steps": STEPS})
        status = run_sequence(0, {"base": args}, root / "base.status.json")
        assert status["base"] == "ok", status
    return checkpoint


def _nproc(name: str) -> int:
    engine = run_config_from_dict(_config_data(name)).train.engine
    return 2 if ENGINE_SPECS[engine].distributed else 0


def _launch(nproc: int, root: Path, cache_dir: Path) -> dict[str, str]:
    """Every combination of one process count in one launch (run one after another)."""
    if nproc not in _launches:
        runs = {label: shrunk(name, root, cache_dir) for label, name in COMBINATIONS.items() if _nproc(name) == nproc}
        _launches[nproc] = run_sequence(nproc, runs, root / f"nproc{nproc}.status.json", timeout=3600)
    return _launches[nproc]


@pytest.fixture(scope="module", autouse=True)
def report(tmp_path_factory):
    yield
    if not RESULTS:
        return
    lines = ["| combination (variant / engine / precision / recompute / compile / data) | config | result |"]
    lines += ["|---|---|---|"] + [f"| {label} | {COMBINATIONS[label]} | {r} |" for label, r in RESULTS.items()]
    table = "\n".join(lines)
    write_summary(tmp_path_factory, "launch_configs.md", table + "\n")
    print(f"\n{len(COMBINATIONS)} distinct combinations\n{table}")


def test_the_combinations_cover_every_launch_config():
    names = {p.name for p in CONFIG_DIR.glob("*.toml")} | set(derived_names())
    assert {combination(n) for n in names} == {tuple(label.split(" / ")) for label in COMBINATIONS}
    assert any(n.startswith("tiny") for n in COMBINATIONS.values())
    assert {label.split(" / ")[0] for label in COMBINATIONS} >= {"full", "focus", "dga"}


@pytest.mark.parametrize("label", list(COMBINATIONS))
def test_launch_config_starts(label, root, cache_dir):
    name = COMBINATIONS[label]
    if "deepspeed" in label and not HAVE_DEEPSPEED:
        pytest.skip("deepspeed is not installed (pip install -e '.[deepspeed]')")
    RESULTS[label] = "failed"
    status = _launch(_nproc(name), root, cache_dir)[label]
    assert status == "ok", f"{name}: {status}"
    rows = train_rows(root / "runs" / name.removesuffix(".toml"))
    assert sorted(rows) == list(range(1, STEPS + 1)), f"{name}: {sorted(rows)}"
    RESULTS[label] = f"ok, loss {rows[STEPS]['loss']:.4f} after {STEPS} steps"
