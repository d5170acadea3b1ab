"""Atomic, keep-last-N checkpoint directories and exact-resume trainer state.

Layout: ``<run>/checkpoints/step_00000020/`` holding what the engine writes
(model and optimizer), ``trainer.pt`` (step, tokens, scheduler, RNG, loader,
fingerprints, resolved config) and ``meta.json``. A checkpoint is written
under ``.tmp-step_...`` and renamed when complete, so a crash mid-write leaves
only a temporary directory that ``latest_checkpoint`` never returns. Reading is ``run.checkpoint``'s.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch

from core.files import fsync_dir
from run import checksums

# the read side lives a layer down (evaluation uses it too); the trainer sees one checkpoint API
from run.checkpoint import (  # noqa: F401
    MANIFEST_FORMAT,
    META,
    MODEL_FILE,
    STEP_DIR,
    TMP_PREFIX,
    TRAINER_STATE,
    checkpoint_root,
    complete_checkpoints,
    latest_checkpoint,
    load_model,
    load_trainer_state,
    load_weights,
    read_manifest,
    resolve_checkpoint,
    step_dir_name,
    step_directories,
    verify_checkpoint,
    verify_weights,
)

DAMAGED_DIR = "damaged"
LOW_SPACE = 256 << 20  # a failed write with less free than this is taken for a full disk


def _fsync_tree(path: Path) -> None:
    for p in sorted(path.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    fsync_dir(path)


class Coordinator(Protocol):
    """What a checkpoint write needs from the process group (an engine provides it)."""

    @property
    def is_main(self) -> bool: ...

    rank: int
    world_size: int

    def broadcast_object(self, obj: Any) -> Any: ...

    def gather_object(self, obj: Any) -> list[Any]: ...

    def barrier(self) -> None: ...


class _Alone:
    is_main = True
    rank = 0
    world_size = 1

    def broadcast_object(self, obj: Any) -> Any:
        return obj

    def gather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def barrier(self) -> None:
        pass


def save_checkpoint(
    run_dir: Path,
    step: int,
    *,
    write_engine_state: Callable[[Path], None],
    trainer_state: dict[str, Any],
    keep: int,
    meta: dict[str, Any] | None = None,
    coord: Coordinator | None = None,
) -> Path:
    """Write a complete checkpoint for ``step`` atomically and prune to the newest ``keep``.

    ``write_engine_state(directory)`` writes the model/optimizer files (the engine
    decides the format: plain state dicts, DCP shards, DeepSpeed's layout). With several
    processes every rank calls this: rank 0 names the temporary directory, every rank writes
    its part, and rank 0 alone writes the trainer state and renames once all are done.
    """
    coord = coord or _Alone()
    root = checkpoint_root(run_dir)
    final = root / step_dir_name(step)
    tmp = None
    if coord.is_main:
        root.mkdir(parents=True, exist_ok=True)
        tmp = root / f"{TMP_PREFIX}{final.name}-{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    tmp = Path(coord.broadcast_object(str(tmp) if tmp else None))
    try:
        write_engine_state(tmp)
        if coord.is_main:
            torch.save(trainer_state, tmp / TRAINER_STATE)
    except Exception as exc:
        full = _disk_full(exc, tmp)
        if full is None:
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # nothing half-written stays behind
        raise full from None
    coord.barrier()  # every rank's files are in place
    # every file's size and content checksum, so a reader can tell a damaged checkpoint (truncated, emptied,
    # bits flipped on disk) from a good one; each rank hashes its share of the files
    names = [p.relative_to(tmp).as_posix() for p in sorted(tmp.rglob("*")) if p.is_file()]
    parts = coord.gather_object(checksums.digests(tmp, checksums.share(names, coord.rank, coord.world_size)))
    if not coord.is_main:
        coord.barrier()  # wait for the rename
        return final
    files = {name: (tmp / name).stat().st_size for name in names}
    digests = {name: digest for part in parts for name, digest in sorted(part.items())}
    info = {
        "step": step,
        "time": time.time(),
        **(meta or {}),
        "format": MANIFEST_FORMAT,
        "files": files,
        "checksums": dict(sorted(digests.items())),
    }
    (tmp / META).write_text(json.dumps(info, indent=2) + "\n")
    _fsync_tree(tmp)
    if final.exists():  # re-saving a step (e.g. stop_at after a periodic save): swap atomically enough
        old = root / f"{TMP_PREFIX}old-{final.name}-{os.getpid()}"
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(final)
    fsync_dir(root)
    prune(run_dir, keep)
    coord.barrier()
    return final


def write_manifest(directory: Path, info: dict[str, Any]) -> None:
    """``meta.json`` for a checkpoint directory written in one process (an import, an adapter applied): ``info``
    plus the manifest's format, every file's size and content checksum. Write it last: it seals the directory."""
    directory = Path(directory)
    names = [p.relative_to(directory).as_posix() for p in sorted(directory.rglob("*")) if p.is_file()]
    names = [name for name in names if name != META]
    manifest = {
        **info,
        "format": MANIFEST_FORMAT,
        "files": {name: (directory / name).stat().st_size for name in names},
        "checksums": checksums.digests(directory, names),
    }
    (directory / META).write_text(json.dumps(manifest, indent=2) + "\n")


def _disk_full(exc: BaseException, where: Path) -> OSError | None:
    """One OSError line naming the place and the free space when a write failed for want of space (torch.save
    says only "iostream error", safetensors "No space left on device" inside its own error type); None when
    the failure was something else."""
    try:
        free = shutil.disk_usage(where if where.exists() else where.parent).free
    except OSError:
        return None
    no_space = (isinstance(exc, OSError) and exc.errno == errno.ENOSPC) or "No space left" in str(exc)
    if not no_space and free >= LOW_SPACE:
        return None
    return OSError(
        errno.ENOSPC,
        f"no space left on the device while writing a checkpoint ({free / 2**20:.0f} MiB free)",
        str(where),
    )


def prune(run_dir: Path, keep: int) -> None:
    """Keep the newest ``keep`` complete checkpoints; drop leftovers of interrupted writes by dead processes.
    A checkpoint found damaged was moved to ``damaged/`` at resume, so it never counts here."""
    found = complete_checkpoints(run_dir)
    if keep > 0:
        for _, path in found[:-keep]:
            # renamed first: a kill mid-removal leaves a temporary directory (removed at the next start), never a
            # step directory without its manifest, which a relaunch would have to report as unverifiable
            gone = path.parent / f"{TMP_PREFIX}pruned-{path.name}-{os.getpid()}"
            try:
                path.rename(gone)
            except OSError:
                gone = path
            shutil.rmtree(gone, ignore_errors=True)
    for path in leftover_temporaries(run_dir):
        pid = path.name.rsplit("-", 1)[-1]
        if pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


def leftover_temporaries(run_dir: Path) -> list[Path]:
    """Temporary directories of saves (``.tmp-step_...-<pid>``) under the run's checkpoints."""
    root = checkpoint_root(run_dir)
    return sorted(root.glob(f"{TMP_PREFIX}*")) if root.is_dir() else []


def set_aside(path: Path, into: Path | None = None) -> Path:
    """Move a damaged checkpoint to ``checkpoints/damaged/`` (kept for inspection, never deleted, never
    resumed from or counted by pruning), or ``path`` into ``into``; returns where it went."""
    target_dir = path.parent / DAMAGED_DIR if into is None else into
    target_dir.mkdir(exist_ok=True)
    target = target_dir / path.name
    n = 1
    while target.exists():
        target = target_dir / f"{path.name}.{n}"
        n += 1
    path.rename(target)
    fsync_dir(path.parent)
    return target


# what a run wrote about the model its checkpoints hold: the training records and eval.run's results per step
RUN_RECORDS = ("metrics.jsonl", "eval")


def set_aside_records(run_dir: Path) -> list[Path]:
    """Move the run's records (``RUN_RECORDS``) to ``checkpoints/damaged/``, beside the checkpoints they describe,
    when a run starts over: the new model's records must not sit beside (or under the same step as) the old one's,
    and the old ones are kept, not deleted. Returns where they went."""
    into = checkpoint_root(run_dir) / DAMAGED_DIR
    return [set_aside(Path(run_dir) / name, into) for name in RUN_RECORDS if os.path.lexists(Path(run_dir) / name)]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def untie(state: dict[str, torch.Tensor], model: torch.nn.Module | None = None) -> dict[str, torch.Tensor]:
    """Keep one name per tied tensor, as safetensors' ``save_model`` does (``save_file`` refuses
    shared storage). Ties are found by storage and, given ``model``, by parameter identity, since
    a gathered full state dict holds separate copies of tied parameters."""
    params = dict(model.named_parameters(remove_duplicate=False)) if model is not None else {}
    seen, out = set(), {}
    for key, value in state.items():
        param = params.get(key)
        ident = (
            ("param", id(param))
            if param is not None
            else ("storage", value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape))
        )
        if ident in seen:
            continue
        seen.add(ident)
        out[key] = value.contiguous()
    return out
