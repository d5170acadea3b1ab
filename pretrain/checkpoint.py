"""Atomic, keep-last-N checkpoint directories and exact-resume trainer state.

Layout: ``<run>/checkpoints/step_00000020/`` holding what the engine writes
(model and optimizer), ``trainer.pt`` (step, tokens, scheduler, RNG, loader,
fingerprints, resolved config) and ``meta.json``. A checkpoint is written
under ``.tmp-step_...`` and renamed when complete, so a crash mid-write leaves
only a temporary directory that ``latest_checkpoint`` never returns.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import time
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from data.files import fsync_dir

STEP_DIR = re.compile(r"^step_(\d{8,})$")
TMP_PREFIX = ".tmp-"
META = "meta.json"
TRAINER_STATE = "trainer.pt"
MODEL_FILE = "model.safetensors"  # consolidated weights (single engine; other engines export to it)


def checkpoint_root(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def complete_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint, oldest first."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        m = STEP_DIR.match(path.name)
        if m and (path / META).is_file() and (path / TRAINER_STATE).is_file():
            found.append((int(m.group(1)), path))
    return sorted(found)


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = complete_checkpoints(run_dir)
    return found[-1][1] if found else None


def _fsync_tree(path: Path) -> None:
    for p in sorted(path.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    fsync_dir(path)


class Coordinator(Protocol):
    """What a checkpoint write needs from the process group (an engine provides it)."""

    is_main: bool

    def broadcast_object(self, obj: Any) -> Any: ...

    def barrier(self) -> None: ...


class _Alone:
    is_main = True

    def broadcast_object(self, obj: Any) -> Any:
        return obj

    def barrier(self) -> None:
        pass


def save_checkpoint(
    run_dir: Path,
    step: int,
    *,
    write_engine_state,
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
    write_engine_state(tmp)
    coord.barrier()  # every rank's files are in place
    if not coord.is_main:
        coord.barrier()  # wait for the rename
        return final
    torch.save(trainer_state, tmp / TRAINER_STATE)
    info = {"step": step, "time": time.time(), **(meta or {})}
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


def prune(run_dir: Path, keep: int) -> None:
    """Keep the newest ``keep`` complete checkpoints; drop leftovers of interrupted writes by dead processes."""
    found = complete_checkpoints(run_dir)
    if keep > 0:
        for _, path in found[:-keep]:
            shutil.rmtree(path, ignore_errors=True)
    for path in checkpoint_root(run_dir).glob(f"{TMP_PREFIX}*"):
        pid = path.name.rsplit("-", 1)[-1]
        if pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def load_trainer_state(path: Path) -> dict[str, Any]:
    return torch.load(Path(path) / TRAINER_STATE, map_location="cpu", weights_only=True)


# ---- RNG ----------------------------------------------------------------------------
# Stored as plain lists and tensors so ``torch.load(weights_only=True)`` accepts them.


def rng_state() -> dict[str, Any]:
    np_state = np.random.get_state()
    state = {
        "python": list(random.getstate()[1]),
        "python_version": random.getstate()[0],
        "python_gauss": random.getstate()[2],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate((state["python_version"], tuple(state["python"]), state["python_gauss"]))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def load_weights(model, path: Path, *, device: torch.device | str = "cpu", new_attention_ok: bool = False) -> None:
    """Consolidated weights of checkpoint ``path`` into ``model`` (shapes must match: a clear error if not).

    ``new_attention_ok``: a retrofit (full-attention weights into a Focus model, say) may lack the
    attention variant's own parameters (``*.core.*``); they keep their initialisation. Anything
    else missing or unexpected is still an error.
    """
    from safetensors.torch import load_model as load_safetensors

    from model.errors import ConfigError

    try:
        missing, unexpected = load_safetensors(model, str(Path(path) / MODEL_FILE), strict=False, device=str(device))
    except RuntimeError as exc:
        raise ConfigError(
            f"model: the weights in {path} do not fit this model config ({str(exc).splitlines()[0]})"
        ) from None
    missing = [name for name in missing if not (new_attention_ok and ".core." in name)]
    if missing or unexpected:
        detail = f"missing {', '.join(missing[:3])}" if missing else f"unexpected {', '.join(unexpected[:3])}"
        raise ConfigError(f"model: the weights in {path} do not fit this model config ({detail})")


def load_model(path: Path, *, device: torch.device | str = "cpu", overrides: list[str] = ()):
    """A checkpoint directory -> (model in eval mode, its RunConfig), from the consolidated weights.

    ``overrides`` are ``--set`` assignments applied to the saved config before the model is built,
    e.g. ``model.attention.focus.mode=hard`` to evaluate a soft-trained Focus model sparsely.
    """
    import tomllib

    from model.transformer import build_model
    from pretrain import configlib
    from pretrain.config import run_config_from_dict

    path = Path(path)
    if not (path / MODEL_FILE).is_file():
        raise FileNotFoundError(f"{path}: no {MODEL_FILE} (not a complete checkpoint directory)")
    data = tomllib.loads(load_trainer_state(path)["config"])
    for assignment in overrides:
        configlib.apply_override(data, assignment)
    cfg = run_config_from_dict(data)
    model = build_model(cfg.model, device=device)
    load_weights(model, path, device=device)
    return model.eval(), cfg


def untie(state: dict[str, torch.Tensor], model=None) -> dict[str, torch.Tensor]:
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
