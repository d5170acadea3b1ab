"""Nothing read from a checkpoint directory runs code (issue 18).

Every pickle a checkpoint holds gets a planted object whose unpickling creates a marker file:
``trainer.pt`` / ``optimizer.pt`` (single), ``dcp/.metadata`` and ``.distcp`` entries (ddp / fsdp2),
DeepSpeed's ``ds/*model_states.pt`` / ``*optim_states.pt``. Each plant is shown to run under the
library's own reader (the control), and never under ours: resume, ``eval.run`` and ``pretrain.export``
leave no marker and stop with one ``error:`` line naming the file (exit code 2; torchrun reports a
failed worker as 1).

The fast tests build DCP checkpoints in process; the slow ones train one tiny checkpoint per engine
(single, ddp, DeepSpeed ZeRO-1 on 2 gloo processes; the DeepSpeed run is the one ``conftest.py`` shares with
the attack suite, test_attacks.py) and run the CLIs on planted copies.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from core.errors import ConfigError
from run import safe_load
from tests.conftest import REPO, reseal_checkpoint


class Payload:
    """Unpickled, it creates ``marker``: what a hostile checkpoint would do with a shell command."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').close()",))


# ---- planting ---------------------------------------------------------------------------------------


def plant_torch_file(path: Path, marker: Path, allow=()) -> None:
    """The file's own contents plus the payload under one more key."""
    state = safe_load.torch_load(path, allow=allow)
    state["planted"] = Payload(marker)
    torch.save(state, path)


def _write_metadata(dcp_dir: Path, metadata) -> None:
    with open(dcp_dir / safe_load.DCP_METADATA, "wb") as f:
        pickle.dump(metadata, f)


def plant_dcp_metadata(dcp_dir: Path, marker: Path) -> None:
    """The real metadata with the payload inside it (planner data is a plain dict)."""
    metadata = safe_load.read_dcp_metadata(dcp_dir)
    metadata.planner_data["planted"] = Payload(marker)
    _write_metadata(dcp_dir, metadata)


def plant_distcp_entry(dcp_dir: Path, marker: Path, *, tensor: bool) -> str:
    """Append a torch-saved payload to a ``.distcp`` file and point one entry at it (a model tensor,
    or a non-tensor optimizer value); the metadata itself stays legitimate. Returns the entry's name."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    metadata = safe_load.read_dcp_metadata(dcp_dir)
    kind = TensorStorageMetadata if tensor else BytesStorageMetadata
    index = next(
        i
        for i in sorted(metadata.storage_data, key=lambda i: i.fqn)
        if isinstance(metadata.state_dict_metadata[i.fqn], kind) and i.fqn.startswith("model." if tensor else "optim.")
    )
    info = metadata.storage_data[index]
    blob = io.BytesIO()
    torch.save(Payload(marker), blob)
    path = dcp_dir / info.relative_path
    offset = path.stat().st_size
    with open(path, "ab") as f:
        f.write(blob.getvalue())
    metadata.storage_data[index] = dataclasses.replace(info, offset=offset, length=len(blob.getvalue()))
    _write_metadata(dcp_dir, metadata)
    return index.fqn


def assert_refused(exc: ConfigError, path: object, marker: Path) -> None:
    assert not marker.exists(), "the planted code ran"
    text = str(exc)
    assert "\n" not in text and str(path) in text and "refused to unpickle" in text, text


# ---- in process: the readers themselves -----------------------------------------------------------


def test_torch_files_load_only_plain_values(tmp_path):
    marker = tmp_path / "ran"
    plain = {"step": 3, "rng": [torch.arange(4)], "config": "x = 1", "betas": (0.9, 0.95)}
    for name, kwargs in (("zip.pt", {}), ("legacy.pt", {"_use_new_zipfile_serialization": False})):
        path = tmp_path / name
        torch.save(plain, path, **kwargs)
        assert safe_load.torch_load(path)["betas"] == (0.9, 0.95)
        safe_load.check_torch_file(path)
        plant_torch_file(path, marker)
        for read in (safe_load.torch_load, safe_load.check_torch_file):
            with pytest.raises(ConfigError) as err:
                read(path)
            assert_refused(err.value, path, marker)
            assert "it would load builtins.exec" in str(err.value)
    raw = tmp_path / "raw.pt"  # a bare pickle, not torch.save's format
    raw.write_bytes(pickle.dumps({"planted": Payload(marker)}))
    with pytest.raises(ConfigError) as err:
        safe_load.torch_load(raw)
    assert_refused(err.value, raw, marker)
    torch.load(tmp_path / "zip.pt", weights_only=False)  # control: the plant is live
    assert marker.exists()


def test_forced_weights_only_covers_library_calls(tmp_path):
    marker = tmp_path / "ran"
    path = tmp_path / "f.pt"
    torch.save({"planted": Payload(marker)}, path)
    before = os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD")
    with safe_load.weights_only_loads(), pytest.raises(pickle.UnpicklingError):
        torch.load(path, weights_only=False)  # what zero_to_fp32 and DeepSpeed's checkpoint engine call
    assert not marker.exists() and os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD") == before


@pytest.fixture
def dcp_dir(tmp_path) -> Path:
    """A DCP checkpoint like the parallel engines' (model tensors, optimizer tensors and plain values)."""
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    state = {
        "model": model.state_dict(),
        "optim": {
            "state": {"weight": {"exp_avg": torch.randn(3, 4), "step": torch.tensor(2.0)}},
            "param_groups": [{"lr": 0.01, "betas": (0.9, 0.95), "name": "decay", "params": ["weight"]}],
        },
    }
    path = tmp_path / "dcp"
    with pytest.warns(UserWarning, match="torch.distributed is disabled"):
        dcp.save(state, checkpoint_id=str(path), no_dist=True)
    return path


def _fresh_state() -> dict:
    return {
        "model": {"weight": torch.zeros(3, 4), "bias": torch.zeros(3)},
        "optim": {
            "state": {"weight": {"exp_avg": torch.zeros(3, 4), "step": torch.tensor(0.0)}},
            "param_groups": [{"lr": 0.0, "betas": (0.0, 0.0), "name": "", "params": [""]}],
        },
    }


def test_dcp_reads_through_the_allow_list(dcp_dir):
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import Metadata

    ours, torchs = safe_load.read_dcp_metadata(dcp_dir), FileSystemReader(dcp_dir).read_metadata()
    assert isinstance(ours, Metadata) and ours.state_dict_metadata and ours.storage_data
    assert (ours.state_dict_metadata, ours.storage_data, ours.planner_data) == (
        torchs.state_dict_metadata,
        torchs.storage_data,
        torchs.planner_data,
    )
    state = _fresh_state()
    safe_load.dcp_load(state, dcp_dir, no_dist=True)
    torch.manual_seed(0)
    expected = torch.nn.Linear(4, 3).state_dict()
    assert all(torch.equal(state["model"][k], expected[k]) for k in expected)
    assert state["optim"]["param_groups"][0] == {
        "lr": 0.01,
        "betas": (0.9, 0.95),
        "name": "decay",
        "params": ["weight"],
    }
    assert state["optim"]["state"]["weight"]["step"].item() == 2.0
    assert set(safe_load.dcp_model_state(dcp_dir)) == {"weight", "bias"}


def test_planted_dcp_metadata_is_refused(dcp_dir, tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    marker = tmp_path / "ran"
    plant_dcp_metadata(dcp_dir, marker)
    for read in (
        lambda: safe_load.read_dcp_metadata(dcp_dir),
        lambda: safe_load.dcp_load(_fresh_state(), dcp_dir, no_dist=True),
        lambda: safe_load.dcp_model_state(dcp_dir),
    ):
        with pytest.raises(ConfigError) as err:
            read()
        assert_refused(err.value, dcp_dir / ".metadata", marker)
    FileSystemReader(dcp_dir).read_metadata()  # control: torch's own reader runs it
    assert marker.exists()


@pytest.mark.parametrize("tensor", [False, True], ids=["plain-value", "tensor"])
def test_planted_distcp_entry_is_refused(dcp_dir, tmp_path, tensor):
    import torch.distributed.checkpoint as dcp

    marker = tmp_path / "ran"
    fqn = plant_distcp_entry(dcp_dir, marker, tensor=tensor)
    with pytest.raises(ConfigError) as err:
        safe_load.dcp_load(_fresh_state(), dcp_dir, no_dist=True)
    assert_refused(err.value, dcp_dir, marker)
    assert (fqn in str(err.value)) != tensor  # plain values are named; tensors are read by torch's reader
    if tensor:  # torch reads tensor entries with weights_only=True: the plant is refused there too
        with pytest.raises(ConfigError):
            safe_load.dcp_model_state(dcp_dir)
        assert not marker.exists()
    else:  # control: torch's default planner runs a plain-value entry
        with pytest.warns(UserWarning):
            dcp.load(_fresh_state(), checkpoint_id=str(dcp_dir), no_dist=True)
        assert marker.exists()


def test_dcp_metadata_may_not_point_outside(dcp_dir):
    metadata = safe_load.read_dcp_metadata(dcp_dir)
    index = next(iter(metadata.storage_data))
    metadata.storage_data[index] = dataclasses.replace(metadata.storage_data[index], relative_path="../../x")
    _write_metadata(dcp_dir, metadata)
    with pytest.raises(ConfigError, match="points outside the checkpoint"):
        safe_load.read_dcp_metadata(dcp_dir)


# ---- end to end: resume, eval.run, export on planted copies of real checkpoints -------------------

STOP = 2
TRAIN = {
    "train.max_steps": 2 * STOP,
    "train.stop_at": STOP,
    "train.batch_size": 4,
    "train.micro_batch_size": 0,
    "train.warmup_steps": 1,
    "checkpoint.every": STOP,
    "eval.every": 2 * STOP,
    "eval.sample_tokens": 2,
}
RESUME = {"train.stop_at": 0}  # continue past the checkpoint, so the resume reads it
DEEPSPEED = {
    "train.engine": "deepspeed",
    "train.deepspeed.zero_stage": 1,
    "train.deepspeed.config": str(REPO / "launch" / "deepspeed" / "zero.json"),
}


def _args(run_dir: Path, cache_dir: Path, engine: dict, **extra) -> list[str]:
    from tests.e2e.test_train_cli import overrides

    return overrides(run_dir, cache_dir, **{**TRAIN, **engine, **extra})


def _launch(nproc: int, args: list[str]) -> subprocess.CompletedProcess:
    from tests.e2e.helpers import torchrun
    from tests.e2e.test_train_cli import train

    return train(args) if nproc == 1 else torchrun(nproc, args)


def _trained(tmp_path_factory, cache_dir, name: str, nproc: int, engine: dict) -> Path:
    """A run stopped at step STOP with its checkpoint (kept pristine: tests plant into copies)."""
    from tests.e2e.helpers import why

    run_dir = tmp_path_factory.mktemp(name) / "run"
    proc = _launch(nproc, _args(run_dir, cache_dir, engine))
    assert proc.returncode == 0, why(proc)
    return run_dir


@pytest.fixture(scope="module")
def single_run(tmp_path_factory, cache_dir) -> Path:
    return _trained(tmp_path_factory, cache_dir, "single", 1, {})


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory, cache_dir) -> Path:
    return _trained(tmp_path_factory, cache_dir, "ddp", 2, {"train.engine": "ddp"})


def _copy(run_dir: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the run and its checkpoint directory."""
    from run.checkpoint import complete_checkpoints

    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    for step, path in complete_checkpoints(copy):
        if step > STOP:  # the shared deepspeed run (conftest.py) goes on to step 4: step STOP is the newest here
            shutil.rmtree(path)
    return copy, copy / "checkpoints" / f"step_{STOP:08d}"


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True, timeout=300)


def _export(checkpoint: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    return _cli("pretrain.export", "--checkpoint", str(checkpoint), "--out", str(tmp_path / "out.safetensors"))


def assert_cli_refused(proc: subprocess.CompletedProcess, path: object, marker: Path, code: int = 2) -> None:
    """No marker, the exit code, and every ``error:`` line (one per rank) names ``path`` with no
    traceback of ours."""
    assert not marker.exists(), "the planted code ran"
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == code and errors, proc.stderr[-3000:]
    assert all(str(path) in line and "refused to unpickle" in line for line in errors), errors
    assert "UnpicklingError" not in proc.stderr, proc.stderr[-3000:]


def assert_resume_refused(proc: subprocess.CompletedProcess, path: object, marker: Path, code: int = 2) -> None:
    """A resume either stops at the refused file (one ``error:`` line per rank, ``code``) or, where the
    trainer falls back past a checkpoint it cannot read, skips it with one ``warning:`` line naming the
    refusal; either way nothing ran."""
    assert not marker.exists(), "the planted code ran"
    lines = (proc.stdout + proc.stderr).splitlines()
    if proc.returncode == 0:
        skipped = [line for line in lines if line.startswith("warning: skipping") and "refused to unpickle" in line]
        assert skipped and all(str(path) in line for line in skipped), proc.stdout[-3000:]
    else:
        assert_cli_refused(proc, path, marker, code)


def _shards_only(checkpoint: Path, tmp_path: Path) -> Path:
    """A copy of the planted checkpoint without model.safetensors: export then reads dcp/ or ds/."""
    copy = tmp_path / "shards_only"
    shutil.copytree(checkpoint, copy)
    (copy / "model.safetensors").unlink()
    return copy


@pytest.mark.slow
@pytest.mark.parametrize("name", ["trainer.pt", "optimizer.pt"])
def test_single_checkpoint_planted(single_run, cache_dir, tmp_path, name):
    marker = tmp_path / "ran"
    run_dir, checkpoint = _copy(single_run, tmp_path)
    plant_torch_file(checkpoint / name, marker)
    reseal_checkpoint(checkpoint)
    if name == "trainer.pt":  # evaluation and export read it too (before a resume may rewrite the run)
        evaluate = _cli(
            "eval.run", "--checkpoint", str(checkpoint), "--tasks", "ppl", "--out", str(tmp_path / "e.json")
        )
        assert_cli_refused(evaluate, checkpoint / name, marker)
        assert_cli_refused(_export(checkpoint, tmp_path), checkpoint / name, marker)
    resume = _launch(1, _args(run_dir, cache_dir, {}, **RESUME))
    if name == "trainer.pt":
        assert_resume_refused(resume, checkpoint / name, marker)
        return
    assert not marker.exists() and resume.returncode != 0, resume.stderr[-3000:]
    assert_cli_refused(resume, checkpoint / name, marker)


@pytest.mark.slow
def test_ddp_checkpoint_planted_metadata(ddp_run, cache_dir, tmp_path):
    marker = tmp_path / "ran"
    run_dir, checkpoint = _copy(ddp_run, tmp_path)
    plant_dcp_metadata(checkpoint / "dcp", marker)
    reseal_checkpoint(checkpoint)
    shards = _shards_only(checkpoint, tmp_path)
    assert_cli_refused(_export(shards, tmp_path), shards / "dcp" / ".metadata", marker)
    resume = _launch(2, _args(run_dir, cache_dir, {"train.engine": "ddp"}, **RESUME))
    assert_resume_refused(resume, checkpoint / "dcp" / ".metadata", marker, 1)


@pytest.mark.slow
def test_ddp_checkpoint_planted_distcp_entries(ddp_run, cache_dir, tmp_path):
    """An optimizer value (read on resume) and, in a second copy, a weight (read by export)."""
    marker = tmp_path / "ran"
    run_dir, checkpoint = _copy(ddp_run, tmp_path)
    shards = _shards_only(checkpoint, tmp_path)
    plant_distcp_entry(shards / "dcp", marker, tensor=True)
    reseal_checkpoint(shards)  # the subject is the reader, not the checksum that would stop it first
    assert_cli_refused(_export(shards, tmp_path), shards / "dcp", marker)
    fqn = plant_distcp_entry(checkpoint / "dcp", marker, tensor=False)
    reseal_checkpoint(checkpoint)
    resume = _launch(2, _args(run_dir, cache_dir, {"train.engine": "ddp"}, **RESUME))
    assert_resume_refused(resume, checkpoint / "dcp", marker, 1)
    assert fqn in resume.stdout + resume.stderr


@pytest.mark.slow
@pytest.mark.parametrize("pattern", ["*model_states.pt", "zero_pp_rank_1_*optim_states.pt"])
def test_deepspeed_checkpoint_planted(deepspeed_run, cache_dir, tmp_path, pattern):
    """Rank 1's optimizer file: rank 0 never loads it, yet both ranks refuse (every file is checked
    on every rank before DeepSpeed opens any). torchrun stops the other rank as soon as one exits, so under
    load the slower rank may be stopped before it prints: at least one refusal, each naming the file."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    marker = tmp_path / "ran"
    run_dir, checkpoint = _copy(deepspeed_run, tmp_path)
    (planted,) = sorted((checkpoint / "ds").glob(pattern))
    plant_torch_file(planted, marker, safe_load.deepspeed_globals())
    reseal_checkpoint(checkpoint)
    shards = _shards_only(checkpoint, tmp_path)
    assert_cli_refused(_export(shards, tmp_path), shards / "ds" / planted.name, marker)
    resume = _launch(2, _args(run_dir, cache_dir, DEEPSPEED, **RESUME))
    assert_resume_refused(resume, planted, marker, 1)
    if resume.returncode:
        errors = [line for line in resume.stderr.splitlines() if line.startswith("error:")]
        assert 1 <= len(errors) <= 2 and all(planted.name in line for line in errors), errors
    get_fp32_state_dict_from_zero_checkpoint(str(shards), tag="ds")  # control: DeepSpeed's own reader runs it
    assert marker.exists()


@pytest.mark.slow
def test_eval_reads_no_engine_pickle(deepspeed_run, tmp_path):
    """eval.run reads trainer.pt (refused above when planted) and model.safetensors, nothing else:
    with every other pickle planted it evaluates and runs none of them."""
    marker = tmp_path / "ran"
    run_dir, checkpoint = _copy(deepspeed_run, tmp_path)
    planted = [checkpoint / "scheduler.pt", *sorted((checkpoint / "ds").glob("*.pt"))]
    for path in planted:
        plant_torch_file(path, marker, safe_load.deepspeed_globals())
    proc = _cli("eval.run", "--run", str(run_dir), "--tasks", "ppl", "--out", str(tmp_path / "eval.json"))
    assert proc.returncode == 0 and not marker.exists(), proc.stderr[-3000:]
