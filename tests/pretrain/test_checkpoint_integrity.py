"""Checkpoints that cannot be silently wrong (issue 30): every file carries a content checksum in
``meta.json``; bytes flipped anywhere in the newest checkpoint send the resume to the previous one with
a one-line warning naming the file, and the damaged one is moved aside, never pruned over the good one."""

from __future__ import annotations

import json
import os
import random
import time

import pytest

from pretrain import checkpoint as ckpt
from run import checksums
from tests.pretrain.test_robustness import config, losses, train

SEED = 1234


def flip_bytes(path, n: int, rng: random.Random) -> None:
    """Invert ``n`` bytes at random positions, size unchanged (what a bad disk or a cosmic ray does)."""
    data = bytearray(path.read_bytes())
    for pos in rng.sample(range(len(data)), min(n, len(data))):
        data[pos] ^= 0xFF
    path.write_bytes(bytes(data))


def test_file_digest_is_xxh3_128_of_the_bytes(tmp_path):
    import xxhash

    data = bytes(range(256)) * 40_000  # several 8 MiB reads would be needed for a larger file; one partial here
    (tmp_path / "f").write_bytes(data)
    assert checksums.file_digest(tmp_path / "f") == "xxh3_128:" + xxhash.xxh3_128(data).hexdigest()
    assert checksums.share(["c", "a", "b", "d"], 1, 2) == ["b", "d"]


@pytest.fixture(scope="module")
def stopped_at_4(tmp_path_factory, cache):
    run_dir = tmp_path_factory.mktemp("stopped") / "run"
    train(config(run_dir, cache, **{"train.stop_at": 4}))  # checkpoints at steps 2 and 4
    return run_dir


@pytest.mark.slow  # a few seconds of training each
def test_every_file_has_its_checksum_in_the_manifest(stopped_at_4):
    latest = stopped_at_4 / "checkpoints" / "step_00000004"
    meta = json.loads((latest / "meta.json").read_text())
    files = sorted(p.relative_to(latest).as_posix() for p in latest.rglob("*") if p.is_file() and p.name != "meta.json")
    assert sorted(meta["checksums"]) == files == sorted(meta["files"])
    for name in files:
        assert meta["checksums"][name] == checksums.file_digest(latest / name)


def _files(run_dir):
    latest = run_dir / "checkpoints" / "step_00000004"
    return sorted(p.relative_to(latest).as_posix() for p in latest.rglob("*") if p.is_file() and p.name != "meta.json")


@pytest.mark.slow  # a few seconds of training each
@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.pt", "trainer.pt", "tokenizer.model"])
def test_flipped_bytes_in_any_file_resume_from_the_previous_checkpoint(
    tmp_path,
    cache,
    reference,
    stopped_at_4,
    name,
    capsys,
):
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(stopped_at_4, run_dir)
    (run_dir / ".lock").unlink(missing_ok=True)
    assert name in _files(run_dir)
    flip_bytes(run_dir / "checkpoints" / "step_00000004" / name, 20, random.Random(SEED))
    _, result = train(config(run_dir, cache))
    assert result.exit_code == 0 and losses(run_dir) == reference
    out = capsys.readouterr().out
    warnings = [line for line in out.splitlines() if line.startswith("warning: skipping a damaged checkpoint")]
    assert len(warnings) == 1 and f"step_00000004/{name}" in warnings[0], out
    assert "step_00000002 at step 2" in out
    assert (run_dir / "checkpoints" / "damaged" / "step_00000004" / name).is_file()  # kept, out of the way


@pytest.mark.slow  # a few seconds of training each
def test_keep_1_with_a_damaged_newest_checkpoint_resumes_twice_in_a_row(tmp_path, cache, reference, stopped_at_4):
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(stopped_at_4, run_dir)
    (run_dir / ".lock").unlink(missing_ok=True)
    newest, rng = run_dir / "checkpoints" / "step_00000004", random.Random(SEED)
    for name in [*_files(run_dir), "meta.json"]:  # 20 bytes in every file (tests/pretrain/test_attacks.py)
        flip_bytes(newest / name, 20, rng)
    _, first = train(config(run_dir, cache, **{"checkpoint.keep": 1, "train.stop_at": 5}))
    assert first.exit_code == 0
    assert [p.name for _, p in ckpt.complete_checkpoints(run_dir)] == ["step_00000005"]  # the good one it wrote
    _, second = train(config(run_dir, cache, **{"checkpoint.keep": 1}))
    assert second.exit_code == 0 and losses(run_dir) == reference
    assert (run_dir / "checkpoints" / "damaged" / "step_00000004").is_dir()


@pytest.mark.slow  # a few seconds of training each
def test_leftover_temporaries_of_dead_saves_are_removed_at_start_up(tmp_path, cache, stopped_at_4):
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(stopped_at_4, run_dir)
    (run_dir / ".lock").unlink(missing_ok=True)
    dead = [  # three launches killed in their first save (the pid of this process looks alive: removed anyway)
        run_dir / "checkpoints" / f"{ckpt.TMP_PREFIX}step_0000000{step}-{pid}"
        for step, pid in ((6, os.getpid()), (6, 999_999_999), (5, 999_999_998))
    ]
    for path in dead:
        path.mkdir()
        (path / "model.safetensors").write_bytes(b"x" * 1000)
    _, result = train(config(run_dir, cache, **{"train.stop_at": 5}))
    assert result.exit_code == 0 and not any(path.exists() for path in dead)


@pytest.mark.slow  # a few seconds of training each
def test_export_and_eval_verification_refuse_a_flipped_weight_file(stopped_at_4, tmp_path):
    import shutil

    from core.errors import ConfigError

    latest = tmp_path / "step"
    shutil.copytree(stopped_at_4 / "checkpoints" / "step_00000004", latest)
    ckpt.verify_checkpoint(latest)
    flip_bytes(latest / "model.safetensors", 20, random.Random(SEED))
    with pytest.raises(ConfigError, match=r"^--checkpoint: .*model.safetensors does not match the checksum"):
        ckpt.verify_checkpoint(latest)


@pytest.mark.slow
def test_verifying_one_gib_in_the_page_cache_takes_under_1_5_s(tmp_path):
    path = tmp_path / "weights.bin"
    block = os.urandom(16 << 20)
    with open(path, "wb") as f:
        for _ in range(64):
            f.write(block)
    checksums.file_digest(path)  # into the page cache
    start = time.perf_counter()
    checksums.file_digest(path)
    assert time.perf_counter() - start < 1.5


@pytest.mark.parametrize(
    "failure",
    [RuntimeError("basic_ios::clear: iostream error"), OSError(28, "No space left on device")],
    ids=["torch-save", "oserror"],
)
def test_a_full_disk_during_a_save_is_one_line_with_the_place_and_free_space(tmp_path, monkeypatch, failure):
    """torch.save on a full disk raises a bare RuntimeError; the save names the place and the free space and
    leaves no temporary directory."""
    import collections

    def full(_directory):
        raise failure

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda _p: usage(10 << 30, (10 << 30) - (3 << 20), 3 << 20))
    with pytest.raises(OSError) as info:
        ckpt.save_checkpoint(tmp_path, 1, write_engine_state=full, trainer_state={"step": 1}, keep=1)
    assert info.value.errno == 28 and info.value.strerror.endswith("(3 MiB free)")
    assert info.value.filename.startswith(str(tmp_path / "checkpoints"))
    assert ckpt.leftover_temporaries(tmp_path) == []


def test_a_write_failure_with_space_left_is_not_called_a_full_disk(tmp_path):
    def broken(_directory):
        raise RuntimeError("something else")

    with pytest.raises(RuntimeError, match="something else"):
        ckpt.save_checkpoint(tmp_path, 1, write_engine_state=broken, trainer_state={"step": 1}, keep=1)


def test_a_newer_trainer_state_format_is_refused_not_taken_for_damage(tmp_path):
    """Resume, export and eval refuse a checkpoint written by newer code with one line (resume does not fall
    back to an older checkpoint: that would throw the newer training away)."""
    import torch

    from run.checkpoint import NewerFormat, verify_checkpoint

    path = ckpt.save_checkpoint(
        tmp_path,
        1,
        write_engine_state=lambda d: (d / "model.safetensors").write_bytes(b"x"),
        trainer_state={"format": 99, "step": 1, "config": ""},
        keep=1,
    )
    (path / "model.safetensors").unlink()  # no weights check in the way: a dcp/ directory stands in
    (path / "dcp").mkdir()
    with pytest.raises(NewerFormat, match=r"^--checkpoint: .*trainer.pt has format 99, newer than this code reads"):
        verify_checkpoint(path)
    assert torch.load(path / "trainer.pt", weights_only=True)["format"] == 99
