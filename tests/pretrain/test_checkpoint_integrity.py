"""Checkpoints that cannot be silently wrong (issue 30): every file carries a content checksum in
``meta.json``; bytes flipped anywhere in the newest checkpoint send the resume to the previous one with
a one-line warning naming the file, and the damaged one is moved aside, never pruned over the good one.
Issue 41: the manifest itself is verified (deleted, malformed or incomplete: not loadable, by any loader), and
a run directory whose step directories hold no verifiable checkpoint is never trained from step 0 silently."""

from __future__ import annotations

import json
import os
import random
import stat
import time

import pytest

from pretrain import checkpoint as ckpt
from pretrain.loop import Trainer
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
    # every file gets the process's usual mode (safetensors writes its own 0600 unless told otherwise)
    modes = {name: stat.S_IMODE((latest / name).stat().st_mode) for name in [*files, "meta.json"]}
    assert set(modes.values()) == {modes["meta.json"]} and modes["meta.json"] & 0o044, modes


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


# ---- issue 41: the manifest is part of what is verified; a run never starts over silently -----------------------

# a manifest that cannot vouch for the files beside it: (case, how to rewrite meta.json, the refusal's words)
MANIFESTS = {
    "deleted": (None, "meta.json is missing"),
    "no-checksums": (lambda meta: {k: v for k, v in meta.items() if k != "checksums"}, "records no checksums"),
    "a-list": (lambda meta: [], "is not a manifest (a JSON list"),
    "one-checksum-missing": (
        lambda meta: {**meta, "checksums": {k: v for k, v in meta["checksums"].items() if k != "model.safetensors"}},
        "model.safetensors has no checksum in meta.json",
    ),
    "unknown-format": (lambda meta: {**meta, "format": "one"}, "has format 'one', not a manifest format"),
}


def rewrite_manifest(checkpoint, case: str) -> str:
    """Rewrite (or delete) ``checkpoint``'s meta.json as ``case`` says; returns the words its refusal holds."""
    change, words = MANIFESTS[case]
    meta_file = checkpoint / "meta.json"
    if change is None:
        meta_file.unlink()
    else:
        meta_file.write_text(json.dumps(change(json.loads(meta_file.read_text()))))
    return words


@pytest.fixture
def small_checkpoint(tmp_path):
    """A checkpoint as the trainer writes it (manifest, trainer state, weights, tokenizer), no training: a run
    directory ``tmp_path / "run"`` holding step 1."""
    from safetensors.torch import save_model

    from model.transformer import build_model
    from tests.pretrain.test_robustness import CORPUS

    cfg = config(tmp_path / "run", tmp_path / "cache")
    model = build_model(cfg.model)
    state = {"step": 1, "tokens": 0, "config": cfg.to_toml()}
    assert CORPUS.is_file()
    return ckpt.save_checkpoint(
        cfg.run_dir,
        1,
        write_engine_state=lambda d: save_model(model, str(d / "model.safetensors")),
        trainer_state=state,
        keep=0,
    )


def _loaders():
    """Every reader of a checkpoint's weights, as ``name -> read(path)``: resume (the single engine's read_state
    loads through load_weights, after verify_checkpoint), train.init_from, eval (load_model), export."""
    from model.transformer import build_model
    from pretrain.export import consolidated_weights
    from run.checkpoint import load_model, load_weights, verify_checkpoint

    def weights(path):
        cfg = config(path.parent.parent, path.parent.parent / "cache")
        load_weights(build_model(cfg.model), path)

    return {
        "resume-verify": lambda path: verify_checkpoint(path, key="resume", all_files=True),
        "load_weights": weights,
        "eval-load_model": load_model,
        "export": consolidated_weights,
    }


@pytest.mark.parametrize("loader", ["resume-verify", "load_weights", "eval-load_model", "export"])
@pytest.mark.parametrize("case", [*MANIFESTS, "intact"])
def test_no_loader_reads_weights_a_manifest_does_not_vouch_for(small_checkpoint, case, loader):
    """Bits flipped in model.safetensors, and the manifest deleted, stripped of its checksums, replaced by ``[]``,
    missing the weights' checksum, of an unknown format, or intact: every loader refuses in one line."""
    from core.errors import ConfigError

    flip_bytes(small_checkpoint / "model.safetensors", 20, random.Random(SEED))
    words = "model.safetensors does not match the checksum" if case == "intact" else ""
    if case != "intact":
        words = rewrite_manifest(small_checkpoint, case)
    with pytest.raises(ConfigError) as info:
        _loaders()[loader](small_checkpoint)
    assert "\n" not in str(info.value) and words in str(info.value), str(info.value)


def test_a_file_added_after_the_save_has_no_checksum_and_is_refused(small_checkpoint):
    from core.errors import ConfigError

    ckpt.verify_checkpoint(small_checkpoint, all_files=True)
    (small_checkpoint / "extra.bin").write_bytes(b"x")
    with pytest.raises(ConfigError, match=r"extra.bin has no checksum in meta.json$"):
        ckpt.verify_checkpoint(small_checkpoint)


def test_a_newer_manifest_format_is_refused_not_taken_for_damage(small_checkpoint):
    from run.checkpoint import NewerFormat

    meta = json.loads((small_checkpoint / "meta.json").read_text())
    assert meta["format"] == ckpt.MANIFEST_FORMAT
    (small_checkpoint / "meta.json").write_text(json.dumps({**meta, "format": 99}))
    with pytest.raises(NewerFormat, match="meta.json has format 99, newer than this code reads"):
        ckpt.verify_checkpoint(small_checkpoint)


def _tree(root) -> dict[str, str]:
    """Every file under ``root`` (relative path -> content checksum): what must stay byte-identical."""
    return {p.relative_to(root).as_posix(): checksums.file_digest(p) for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.slow  # a few seconds of set-up (no training)
def test_every_manifest_deleted_the_relaunch_refuses_in_one_line_and_touches_nothing(
    stopped_at_4, tmp_path, cache, capsys
):
    """Every checkpoint's meta.json deleted (a partial restore, a cleanup of *.json), the same command again: exit
    2, one line naming what is missing and how to start over on purpose, every step directory byte-identical;
    with checkpoint.unverifiable=start_over the step directories move to checkpoints/damaged/ (still
    byte-identical), the run's metrics.jsonl and eval/ results with them (issue 50), and training starts from
    step 0."""
    import shutil

    from pretrain.train import main

    run_dir = tmp_path / "run"
    shutil.copytree(stopped_at_4, run_dir)
    (run_dir / ".lock").unlink(missing_ok=True)
    root = run_dir / "checkpoints"
    for _, path in ckpt.step_directories(run_dir):
        (path / "meta.json").unlink()
    before = _tree(root)
    config_file = tmp_path / "config.toml"
    config_file.write_text(config(run_dir, cache).to_toml())
    capsys.readouterr()
    assert main(["--config", str(config_file)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: resume: no checkpoint in {root} can be verified"), err
    assert "step_00000004/meta.json is missing" in err
    assert "use a new run.dir, or set checkpoint.unverifiable=start_over" in err
    assert _tree(root) == before

    # the old model's records: its training metrics and an evaluation of its step 4 (issue 50)
    (run_dir / "eval").mkdir()
    (run_dir / "eval" / "step_00000004.json").write_text('{"checkpoint": "old", "step": 4, "ppl": {"loss": 7.0}}\n')
    records = {name: _tree(run_dir / name) if name == "eval" else {name: checksums.file_digest(run_dir / name)}
               for name in ("metrics.jsonl", "eval")}  # fmt: skip
    assert (run_dir / "metrics.jsonl").stat().st_size > 0
    trainer = Trainer(config(run_dir, cache, **{"checkpoint.unverifiable": "start_over"}))
    trainer.setup()
    trainer.release_run_dir()
    assert trainer.step == 0 and ckpt.step_directories(run_dir) == []
    damaged = _tree(root / "damaged")
    assert {k: v for k, v in damaged.items() if k.startswith("step_")} == before
    # moved aside with the checkpoints, byte for byte: nothing of the old model beside the new one's, nothing deleted
    assert not (run_dir / "eval").exists() and not (run_dir / "metrics.jsonl").exists()
    assert {k.removeprefix("eval/"): v for k, v in damaged.items() if k.startswith("eval/")} == records["eval"]
    assert damaged["metrics.jsonl"] == records["metrics.jsonl"]["metrics.jsonl"]
    out = capsys.readouterr().out
    assert "checkpoint.unverifiable=start_over: moved 2 step directories that cannot be verified" in out, out
    assert "with the run's metrics.jsonl and eval to" in out, out


@pytest.mark.slow  # a few seconds of set-up (no training)
@pytest.mark.parametrize("case", ["deleted", "no-checksums", "a-list", "one-checksum-missing"])
def test_a_newest_checkpoint_without_a_good_manifest_is_skipped_with_one_line(
    stopped_at_4, tmp_path, cache, case, capsys
):
    """Only the newest checkpoint's manifest deleted, stripped of its checksums, replaced by ``[]`` or missing the
    weights' checksum, with bits flipped in its weights: no resume from it; the relaunch says so in one line with
    the reason and resumes from the previous one."""
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(stopped_at_4, run_dir)
    (run_dir / ".lock").unlink(missing_ok=True)
    newest = run_dir / "checkpoints" / "step_00000004"
    flip_bytes(newest / "model.safetensors", 20, random.Random(SEED))
    words = rewrite_manifest(newest, case)
    capsys.readouterr()
    trainer = Trainer(config(run_dir, cache))
    trainer.setup()
    trainer.release_run_dir()
    out = capsys.readouterr().out
    assert trainer.step == 2 and "resumed from" in out and "step_00000002 at step 2" in out, out
    skips = [line for line in out.splitlines() if line.startswith("warning: skipping a damaged checkpoint")]
    assert len(skips) == 1 and str(newest) in skips[0] and words in skips[0], out
    assert (run_dir / "checkpoints" / "damaged" / "step_00000004").is_dir()  # kept, out of the way


# ---- issue 50: a FIFO where a checkpoint file was (reading it would wait for a writer until killed) -------------


def _fifo_in_place_of(path) -> None:
    path.unlink()
    os.mkfifo(path)


@pytest.mark.slow  # a few seconds of set-up (no training)
@pytest.mark.timeout(120)  # the hang this stages fails the test rather than holding the suite
def test_a_fifo_as_the_newest_trainer_state_is_skipped_not_waited_on(stopped_at_4, tmp_path, cache, capsys):
    """``trainer.pt`` of the newest checkpoint replaced by a FIFO: the relaunch skips it with one line naming it
    and resumes from the previous checkpoint (it used to block in open until killed)."""
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(stopped_at_4, run_dir)
    (run_dir / ".lock").unlink(missing_ok=True)
    newest = run_dir / "checkpoints" / "step_00000004"
    _fifo_in_place_of(newest / "trainer.pt")
    capsys.readouterr()
    trainer = Trainer(config(run_dir, cache))
    trainer.setup()
    trainer.release_run_dir()
    out = capsys.readouterr().out
    assert trainer.step == 2 and "step_00000002 at step 2" in out, out
    skips = [line for line in out.splitlines() if line.startswith("warning: skipping a damaged checkpoint")]
    assert len(skips) == 1 and f"{newest / 'trainer.pt'} cannot be read (is a FIFO, not a regular file)" in skips[0]


@pytest.mark.slow  # a few seconds of set-up (no training)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("manifest", ["untouched", "resealed"])
def test_a_fifo_as_the_dcp_metadata_of_a_dcp_only_checkpoint_is_one_line_on_export(
    stopped_at_4, tmp_path, manifest, capsys
):
    """A checkpoint whose weights are only in ``dcp/`` (the parallel engines' shards, ``model.safetensors`` removed)
    with ``dcp/.metadata`` a FIFO: ``pretrain.export`` stops with one line naming it (it used to block). With the
    manifest untouched the verifier names it; resealed (as whoever swapped it could), the DCP reader refuses it."""
    import shutil

    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    from pretrain.export import main as export
    from tests.conftest import reseal_checkpoint

    checkpoint = tmp_path / "step_00000004"
    shutil.copytree(stopped_at_4 / "checkpoints" / checkpoint.name, checkpoint)
    weights = load_file(checkpoint / "model.safetensors")
    with pytest.warns(UserWarning, match="torch.distributed is disabled"):
        dcp.save({"model": weights}, checkpoint_id=str(checkpoint / "dcp"), no_dist=True)
    (checkpoint / "model.safetensors").unlink()
    reseal_checkpoint(checkpoint)
    metadata = checkpoint / "dcp" / ".metadata"
    _fifo_in_place_of(metadata)
    if manifest == "resealed":
        reseal_checkpoint(checkpoint)  # records only regular files: the FIFO is not among them
    capsys.readouterr()
    assert export(["--checkpoint", str(checkpoint), "--out", str(tmp_path / "out.safetensors")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and str(metadata) in err, err
    assert "is a FIFO, not" in err, err
    assert not (tmp_path / "out.safetensors").exists()
