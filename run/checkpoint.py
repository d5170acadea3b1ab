"""The read side of checkpoints: find the latest complete one, resolve a run or checkpoint directory,
load trainer state and consolidated weights. Writing (atomic directories, pruning) is
``pretrain.checkpoint``'s; evaluation, export and training all read through here.

Layout: ``<run>/checkpoints/step_00000020/`` with what the engine wrote, ``trainer.pt`` and
``meta.json``; a directory still being written is named ``.tmp-step_...`` and is never returned.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from core import configlib
from core.configlib import tomllib  # tomli on Python 3.10
from core.errors import ConfigError
from core.files import file_kind, read_regular_text
from data.tokenizer import HF_COMPANIONS
from run import checksums
from run.safe_load import torch_load

if TYPE_CHECKING:
    from torch import nn

    from model.transformer import Transformer
    from run.config import RunConfig

STEP_DIR = re.compile(r"^step_(\d{8,})$")
TMP_PREFIX = ".tmp-"
META = "meta.json"
TRAINER_STATE = "trainer.pt"
MODEL_FILE = "model.safetensors"  # consolidated weights (single engine; other engines export to it)
# trainer.pt's layout: 1, the plain dict written before pretrain.state.TrainState (no "format" key); 2, TrainState
TRAINER_STATE_FORMAT = 2
# meta.json's layout: 1, an object with "files" (sizes) and "checksums" (one per file); written before the "format"
# key existed too, so a manifest without it is format 1 (it must still hold a checksum for every file)
MANIFEST_FORMAT = 1


class NewerFormat(ConfigError):
    """A checkpoint written by newer code: refused everywhere, never taken for a damaged one (falling back to an
    older checkpoint would throw the newer training away)."""


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


def step_directories(run_dir: Path) -> list[tuple[int, Path]]:
    """(step, path) of every ``step_*`` directory under the run's checkpoints, complete or not, oldest first:
    what a relaunch must account for before it may train from step 0."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), path) for path in root.iterdir() if (m := STEP_DIR.match(path.name)) and path.is_dir()]
    return sorted(found)


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = complete_checkpoints(run_dir)
    return found[-1][1] if found else None


def resolve_checkpoint(path: str | Path, *, key: str = "--run") -> Path:
    """A checkpoint directory, or a run directory -> its latest complete checkpoint.

    ``key`` names the option in the one-line error (``--run``, ``train.init_from`` ...).
    """
    path = Path(path)
    if (path / TRAINER_STATE).is_file():
        return path
    if (path / "checkpoints").is_dir():
        latest = latest_checkpoint(path)
        if latest is not None:
            return latest
        raise ConfigError(f"{key}: no complete checkpoint under {path}/checkpoints")
    if not path.is_dir():
        raise ConfigError(f"{key}: no such directory {str(path)!r}")
    if (path / "config.json").is_file():  # a Hugging Face model folder: read through the HF mapping
        how = f"set it to 'hf:{path}'" if key == "train.init_from" else f"python -m pretrain.hf_import --hf {path}"
        raise ConfigError(f"{key}: {path} is a Hugging Face model directory, not a checkpoint; {how}")
    raise ConfigError(f"{key}: {path} is neither a complete checkpoint nor a run directory with one")


def tokenizer_file(directory: Path) -> Path:
    """The tokenizer a checkpoint directory carries (SentencePiece, HF tokenizer.json or tiktoken ranks)."""
    for path in [directory / "tokenizer.model", directory / "tokenizer.json", *sorted(directory.glob("*.tiktoken"))]:
        if path.is_file():
            return path
    raise ConfigError(f"--checkpoint: {directory} holds no tokenizer.model, tokenizer.json or .tiktoken file")


# the files a checkpoint's tokenizer is read from (data/tokenizer.py: the tokenizer file, and the Hugging Face
# settings beside a tokenizer.json / tokenizer.model that load_tokenizer reads and save copies along)
TOKENIZER_NAMES = ("tokenizer.model", "tokenizer.json", *HF_COMPANIONS)


def tokenizer_files(directory: Path) -> list[str]:
    """The tokenizer files checkpoint ``directory`` holds (``TOKENIZER_NAMES`` and ``*.tiktoken``), relative: what
    evaluation and export read besides the weights and trainer state, so checked against the manifest like them."""
    directory = Path(directory)
    names = [name for name in TOKENIZER_NAMES if os.path.lexists(directory / name)]
    return names + sorted(p.name for p in directory.glob("*.tiktoken"))


def load_trainer_state(path: Path) -> dict[str, Any]:
    """``trainer.pt`` of checkpoint ``path``: tensors and plain values only (one-line ``ConfigError`` otherwise)."""
    return torch_load(Path(path) / TRAINER_STATE, map_location="cpu")


def files_of(path: Path) -> list[str]:
    """Every file under checkpoint ``path`` but the manifest itself, relative, sorted."""
    return sorted(p.relative_to(path).as_posix() for p in Path(path).rglob("*") if p.is_file() and p.name != META)


def read_manifest(path: Path, *, key: str = "--checkpoint") -> dict[str, Any]:
    """``meta.json`` of checkpoint ``path``, once it is well formed: a JSON object of a known format whose
    ``checksums`` name a digest for every file the directory holds. Without that nothing in the directory can be
    checked, so nothing in it is loaded: one ``ConfigError`` line naming what is missing."""
    meta_file = Path(path) / META
    if not meta_file.is_file():
        raise ConfigError(f"{key}: {meta_file} is missing (the manifest of checksums every file is checked against)")
    try:
        meta = json.loads(read_regular_text(meta_file))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{key}: {meta_file} is damaged ({_why(exc)})") from None
    if not isinstance(meta, dict):
        raise ConfigError(f"{key}: {meta_file} is not a manifest (a JSON {type(meta).__name__}, not an object)")
    version = meta.get("format", 1)
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise ConfigError(f"{key}: {meta_file} has format {version!r}, not a manifest format this code knows")
    if version > MANIFEST_FORMAT:
        raise NewerFormat(
            f"{key}: {meta_file} has format {version}, newer than this code reads ({MANIFEST_FORMAT}); "
            "update focused-pretrain to read it"
        )
    sums = meta.get("checksums")
    if not isinstance(sums, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in sums.items()):
        raise ConfigError(f"{key}: {meta_file} records no checksums (written before them, or damaged)")
    unrecorded = [name for name in files_of(path) if name not in sums]
    if unrecorded:
        raise ConfigError(f"{key}: {Path(path) / unrecorded[0]} has no checksum in {META}")
    return meta


# files whose content matched their recorded checksum in this process: (path, size, mtime, inode, digest); a file
# checked once (a resume verifies everything, then the engine loads it) is not read twice while it is unchanged
_matched: set[tuple[str, int, int, int, str]] = set()


def _signature(file: Path, digest: str) -> tuple[str, int, int, int, str]:
    st = file.stat()
    return (str(file.resolve()), st.st_size, st.st_mtime_ns, st.st_ino, digest)


def _check_sums(path: Path, sums: dict[str, str], names: Sequence[str]) -> str | None:
    """``checksums.first_mismatch`` over ``names``, skipping files already matched unchanged in this process."""
    todo = []
    for name in names:
        file = path / name
        if not (file.is_file() and _signature(file, sums[name]) in _matched):
            todo.append(name)
    problem = checksums.first_mismatch(path, sums, todo)
    if problem is None:
        _matched.update(_signature(path / name, sums[name]) for name in todo)
    return problem


def verify_weights(path: Path, *, key: str = "--checkpoint") -> None:
    """``model.safetensors`` of checkpoint ``path`` matches its checksum in a well-formed manifest (one
    ``ConfigError`` line if not): what every loader of those weights runs first."""
    path = Path(path)
    sums = read_manifest(path, key=key)["checksums"]
    if MODEL_FILE not in sums:
        raise ConfigError(f"{key}: {path / MODEL_FILE} has no checksum in {META}")
    problem = _check_sums(path, sums, [MODEL_FILE])
    if problem:
        raise ConfigError(f"{key}: {problem}")


def verify_checkpoint(
    path: Path, *, key: str = "--checkpoint", all_files: bool = False, share: tuple[int, int] = (0, 1)
) -> dict[str, Any]:
    """Checks checkpoint ``path`` without loading its weights, and returns its trainer state: ``meta.json`` is a
    well-formed manifest (``read_manifest``: a checksum for every file present), ``trainer.pt`` loads (weights
    only), ``model.safetensors`` (when present) has a header whose tensors the file covers, some weights are
    there (``model.safetensors``, ``dcp/`` or ``ds/``), and the files a reader reads have the sizes and the
    content checksums the manifest recorded when they were written: ``trainer.pt`` and ``model.safetensors``,
    every file when the weights are only in ``dcp/`` or ``ds/``, and with ``all_files`` (a resume reads them
    all) every file recorded or present. ``share = (rank, world_size)``: hash only this rank's part of those
    files (the ranks of a resume split the work). A damaged file is one ``ConfigError`` line naming it."""
    path = Path(path)
    meta = read_manifest(path, key=key)
    state_file = path / TRAINER_STATE
    try:
        state = load_trainer_state(path)
    except ConfigError:
        raise
    except OSError as exc:  # missing, unreadable, a FIFO (refused unopened: it would block)
        raise ConfigError(f"{key}: {state_file} cannot be read ({exc.strerror or _why(exc)})") from None
    except Exception as exc:  # truncated zip, empty file, not a torch file ...
        raise ConfigError(f"{key}: {state_file} is damaged ({_why(exc)})") from None
    if not isinstance(state, dict) or "step" not in state or not isinstance(state.get("config"), str):
        raise ConfigError(f"{key}: {state_file} is not a trainer state (no step / config)")
    version = state.get("format", 1)
    if not isinstance(version, int) or version > TRAINER_STATE_FORMAT:
        raise NewerFormat(
            f"{key}: {state_file} has format {version!r}, newer than this code reads ({TRAINER_STATE_FORMAT}); "
            "update focused-pretrain to read it"
        )
    weights = path / MODEL_FILE
    if weights.is_file():
        from safetensors import safe_open

        try:
            with safe_open(str(weights), framework="pt") as f:
                f.keys()
        except Exception as exc:  # SafetensorError: empty, truncated, a bad header
            raise ConfigError(f"{key}: {weights} is damaged ({_why(exc)})") from None
    elif not ((path / "dcp").is_dir() or (path / "ds").is_dir()):
        raise ConfigError(f"{key}: {path} holds no weights ({MODEL_FILE}, dcp/ or ds/)")
    sums: dict[str, str] = meta["checksums"]
    if all_files:  # a resume: every file recorded must be there, and match
        names = sorted(set(sums) | set(files_of(path)))
    elif weights.is_file():  # evaluation and export read no optimizer or engine state, but the tokenizer
        names = [TRAINER_STATE, MODEL_FILE, *tokenizer_files(path)]
    else:  # the weights come from dcp/ or ds/ (model.safetensors removed on purpose): every file there is read,
        # the recorded ones too (a recorded file replaced by a FIFO is not among those files_of finds)
        names = sorted((set(sums) - {MODEL_FILE}) | set(files_of(path)))
    for name in names:
        if name not in sums:
            raise ConfigError(f"{key}: {path / name} has no checksum in {META}")
    recorded = meta.get("files")  # sizes at write time: a clearer line than a checksum for a truncated file
    for name in names:
        size = recorded.get(name) if isinstance(recorded, dict) else None
        file = path / name
        kind = file_kind(file)
        if kind is not None:  # a FIFO in a file's place would block its reader
            raise ConfigError(f"{key}: {file} is {kind}, not the regular file {META} recorded")
        actual = file.stat().st_size if file.is_file() else None
        if size is not None and actual != size:
            found = "missing" if actual is None else f"{actual} bytes"
            raise ConfigError(f"{key}: {file} is {found}, but {META} recorded {size} bytes when it was written")
    problem = _check_sums(path, sums, checksums.share(names, *share))
    if problem:
        raise ConfigError(f"{key}: {problem}")
    return state


def _why(exc: BaseException) -> str:
    """``Type: the message's first sentence``, on one short line."""
    text = " ".join(str(exc).split(". ")[0].split())
    return f"{type(exc).__name__}: {text}"[:160] if text else type(exc).__name__


def load_weights(
    model: nn.Module,
    path: Path,
    *,
    device: torch.device | str = "cpu",
    new_attention_ok: bool = False,
    key: str = "--checkpoint",
) -> None:
    """Consolidated weights of checkpoint ``path`` into ``model`` (shapes must match: a clear error if not), once
    they match their checksum in the checkpoint's manifest (``verify_weights``; ``key`` names the option in its
    one-line error).

    ``new_attention_ok``: a retrofit (full-attention weights into a Focus model, say) may lack the
    attention variant's own parameters (``*.core.*``); they keep their initialisation. Anything
    else missing or unexpected is still an error.
    """
    from safetensors import safe_open
    from safetensors.torch import load_model as load_safetensors

    from run.hf_init import fit_line, shape_mismatches

    verify_weights(path, key=key)
    file = str(Path(path) / MODEL_FILE)
    with safe_open(file, framework="pt") as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    problems = shape_mismatches(shapes, model)
    if problems:
        raise ConfigError(fit_line(str(path), problems, "model", _differing_fields(path, model)))
    try:
        missing, unexpected = load_safetensors(model, file, strict=False, device=str(device))
    except RuntimeError as exc:
        raise ConfigError(
            f"model: the weights in {path} do not fit this model config ({str(exc).splitlines()[0]})"
        ) from None
    missing = [name for name in missing if not (new_attention_ok and ".core." in name)]
    if missing or unexpected:
        detail = f"missing {', '.join(missing[:3])}" if missing else f"unexpected {', '.join(unexpected[:3])}"
        raise ConfigError(f"model: the weights in {path} do not fit this model config ({detail})")


SHAPE_FIELDS = ("family", "vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "max_seq_len")


def _differing_fields(path: Path, model: nn.Module) -> str:
    """Which shape fields of the checkpoint's saved model config differ from ``model``'s: the keys to set."""
    from run.config import run_config_from_dict

    ours = getattr(model, "cfg", None)
    try:
        theirs = run_config_from_dict(tomllib.loads(load_trainer_state(path)["config"])).model
    except Exception:  # only a better message is lost: the tensor shapes already say it
        return ""
    if ours is None:
        return ""
    fields = [
        f"model.{f} = {getattr(theirs, f)!r} there, {getattr(ours, f)!r} here"
        for f in SHAPE_FIELDS
        if getattr(theirs, f) != getattr(ours, f)
    ]
    return ", ".join(fields)


def load_model(
    path: Path, *, device: torch.device | str = "cpu", overrides: Sequence[str] = (), key: str = "--checkpoint"
) -> tuple[Transformer, RunConfig]:
    """A checkpoint directory -> (model in eval mode, its RunConfig), from the consolidated weights.

    ``overrides`` are ``--set`` assignments applied to the saved config before the model is built,
    e.g. ``model.attention.focus.mode=hard`` to evaluate a soft-trained Focus model sparsely.
    """
    from model.transformer import build_model
    from run.config import run_config_from_dict

    path = Path(path)
    if not (path / MODEL_FILE).is_file():
        raise FileNotFoundError(f"{path}: no {MODEL_FILE} (not a complete checkpoint directory)")
    data = tomllib.loads(verify_checkpoint(path, key=key)["config"])
    for assignment in overrides:
        configlib.apply_override(data, assignment)
    cfg = run_config_from_dict(data)
    model = build_model(cfg.model, device=device)
    load_weights(model, path, device=device, key=key)
    return model.eval(), cfg
