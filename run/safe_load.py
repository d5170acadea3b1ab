"""Reading checkpoint files without running code from them.

A checkpoint directory is data that may come from someone else, and unpickling runs whatever a
pickle names. Every pickle a checkpoint holds is therefore read through an allow-list, and
anything outside it is refused with one line (``ConfigError``) naming the file:

- torch files (``trainer.pt``, ``optimizer.pt``, ``scheduler.pt``, DeepSpeed's ``ds/*_states.pt``):
  ``torch.load(weights_only=True)`` (tensors, containers, plain values), plus for DeepSpeed's files
  the few classes they hold (``deepspeed_globals``); ``torch_load``.
- DCP metadata (``dcp/.metadata``, a plain pickle that torch's ``FileSystemReader`` loads with
  ``pickle.load``): an unpickler that resolves only the classes DCP metadata is made of
  (``DCP_METADATA_GLOBALS``, torch dtypes); ``read_dcp_metadata`` and ``SafeFileSystemReader``.
- DCP non-tensor entries (``.distcp`` items written with ``torch.save``, which torch's
  ``DefaultLoadPlanner.load_bytes`` reads with ``weights_only=False``): read with
  ``weights_only=True`` first (``SafeLoadPlanner``). Tensor entries torch already reads with
  ``weights_only=True``.
- Library code that calls ``torch.load(weights_only=False)`` itself (DeepSpeed's ``zero_to_fp32`` and
  its checkpoint engine) runs inside ``weights_only_loads``, which forces every ``torch.load`` to
  ``weights_only`` (torch's ``TORCH_FORCE_WEIGHTS_ONLY_LOAD``) with the given classes allowed.
  The files are checked first (``check_torch_file``, no tensor data read) so a refusal names the file.

Allow-lists are process-global in torch while a load runs (``torch.serialization.safe_globals``);
checkpoint reads happen on the main thread.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import re
import warnings
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from core.errors import ConfigError, require
from core.files import open_regular

if TYPE_CHECKING:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import Metadata
    from torch.distributed.checkpoint.planner import ReadItem

DCP_METADATA = ".metadata"  # torch.distributed.checkpoint's metadata file name

# module -> names: what DCP metadata is made of (torch 2.13: Metadata and its parts, the storage
# index of FileSystemWriter, torch.Size, dtypes (any torch.dtype, checked by type), layouts (looked up
# by name) and the checkpoint id, a path)
DCP_METADATA_GLOBALS: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset(
        {
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "_MEM_FORMAT_ENCODING",
        }
    ),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch": frozenset({"Size"}),
    "torch.serialization": frozenset({"_get_layout"}),
    "pathlib": frozenset({"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"}),
}


def deepspeed_globals() -> list[Any]:
    """The classes DeepSpeed's checkpoint files hold besides tensors and plain values (0.19, ZeRO 0-3):
    the stage enum and loss scaler in ``*optim_states.pt``, ZeRO 1/2's parameter fragment addresses."""
    require("deepspeed", "a DeepSpeed checkpoint (ds/)")
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [ZeroStageEnum, LossScaler, fragment_address]


def _refusal(path: object, exc: BaseException) -> ConfigError:
    """One line for an unpickling refusal: the file, and the global it asked for when there is one."""
    text = str(exc)
    named = re.search(r"GLOBAL ([\w.]+)", text)
    if named:
        name = named.group(1) if "." in named.group(1) else f"builtins.{named.group(1)}"
        why = f"it would load {name}, which is not on the allow-list of what a checkpoint may contain"
    else:
        detail = re.search(r"WeightsUnpickler error:(.*?)(?:Check the documentation|$)", text, re.S)
        why = " ".join((detail.group(1) if detail else text).split()) or type(exc).__name__
        why = f"not tensors and plain values ({why})"
    return ConfigError(f"{path}: refused to unpickle: {why}")


def torch_load(
    path: str | os.PathLike, *, map_location: Any = "cpu", allow: Iterable[Any] = (), mmap: bool | None = None
) -> Any:
    """``torch.load(weights_only=True)`` of one checkpoint file, with ``allow`` added to the safe
    globals; anything else in the file is a one-line ``ConfigError`` naming it."""
    try:
        with torch.serialization.safe_globals(list(allow)):
            if mmap:  # torch maps the file by its name: checked to be a regular file first
                open_regular(path).close()
                return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
            with open_regular(path) as f:  # a FIFO in its place is an OSError, not a read that never returns
                return torch.load(f, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise _refusal(path, exc) from None


def check_torch_file(path: str | os.PathLike, *, allow: Iterable[Any] = ()) -> None:
    """Refuse ``path`` (``ConfigError``) unless it loads with ``weights_only`` and ``allow``; reads the
    pickle but no tensor data, so it is cheap for large files."""
    with torch.serialization.skip_data():
        torch_load(path, allow=allow)


@contextlib.contextmanager
def weights_only_loads(allow: Iterable[Any] = ()) -> Iterator[None]:
    """Every ``torch.load`` inside, including a library's explicit ``weights_only=False``, loads with
    ``weights_only=True`` and ``allow`` added to the safe globals."""
    key = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"
    before = os.environ.get(key)
    os.environ[key] = "1"
    try:
        with torch.serialization.safe_globals(list(allow)):
            yield
    finally:
        if before is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = before


# ---- torch.distributed.checkpoint (DCP) ---------------------------------------------------------


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in DCP_METADATA_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"GLOBAL {module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("a persistent id (DCP metadata has none)")


def read_dcp_metadata(directory: str | os.PathLike, name: str = DCP_METADATA) -> Metadata:
    """The ``Metadata`` of the DCP checkpoint in ``directory``, unpickled through the allow-list;
    refused with one line if the file holds anything else or points outside the directory."""
    from torch.distributed.checkpoint.metadata import Metadata

    path = Path(directory) / name
    try:
        with open_regular(path) as f:  # a FIFO is refused, not waited on
            metadata = _MetadataUnpickler(f).load()
    except pickle.UnpicklingError as exc:
        raise _refusal(path, exc) from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    except Exception as exc:  # a damaged file: EOF, wrong arguments to an allowed class ...
        raise ConfigError(f"{path}: not DCP metadata ({type(exc).__name__}: {exc})") from None
    if not isinstance(metadata, Metadata):
        raise ConfigError(f"{path}: not DCP metadata (it holds a {type(metadata).__name__})")
    for info in (metadata.storage_data or {}).values():
        relative = getattr(info, "relative_path", None)
        if not isinstance(relative, str) or os.path.isabs(relative) or ".." in Path(relative).parts:
            raise ConfigError(f"{path}: a storage entry points outside the checkpoint ({relative!r})")
    return metadata


def _dcp_classes() -> tuple[type[FileSystemReader], Callable[..., DefaultLoadPlanner]]:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeFileSystemReader(FileSystemReader):
        """``FileSystemReader`` whose metadata is read through ``read_dcp_metadata``."""

        def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
            rank = kwargs.get("rank")
            name = DCP_METADATA if rank is None else f"__{rank}{DCP_METADATA}"
            metadata = read_dcp_metadata(Path(self.path), name)
            storage_meta = getattr(metadata, "storage_meta", None)
            if storage_meta is None:
                storage_meta = metadata.storage_meta = StorageMeta()
            storage_meta.load_id = self.load_id
            return metadata

    class SafeLoadPlanner(DefaultLoadPlanner):
        """``DefaultLoadPlanner`` whose non-tensor entries are read with ``weights_only=True``."""

        def __init__(self, *args: Any, where: str = "dcp", **kwargs: Any):
            super().__init__(*args, **kwargs)
            self.where = where

        def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
            try:
                obj = torch.load(value, map_location="cpu", weights_only=True)
            except pickle.UnpicklingError as exc:
                raise _refusal(f"{self.where} entry {read_item.dest_index.fqn!r}", exc) from None
            # what weights_only gave back holds only plain values and tensors: written again, the
            # parent's own (weights_only=False) read of it can call nothing else
            clean = io.BytesIO()
            torch.save(obj, clean)
            clean.seek(0)
            super().load_bytes(read_item, clean)

    return SafeFileSystemReader, SafeLoadPlanner


def _dcp_failure(directory: Path, exc: BaseException) -> ConfigError | None:
    """The refusal inside a failed ``dcp.load`` (raised as is, or gathered from every rank into a
    ``CheckpointException``), as one line; None if the failure is something else."""
    from torch.distributed.checkpoint.api import CheckpointException

    todo, seen = [exc], set()
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, ConfigError):
            return ConfigError(str(e))
        if isinstance(e, pickle.UnpicklingError):
            return _refusal(f"{directory} (a .distcp tensor entry)", e)
        if isinstance(e, CheckpointException):
            todo += [failure[0] for failure in e.failures.values()]
        todo += [c for c in (e.__cause__, e.__context__) if c is not None]
    return None


def dcp_load(state: dict[str, Any], directory: str | os.PathLike, *, no_dist: bool = False) -> None:
    """``dcp.load(state)`` from ``directory`` through the safe reader and planner (in place, like
    ``dcp.load``); the metadata is checked first on every rank, so a refusal is one line everywhere."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    directory = Path(directory)
    read_dcp_metadata(directory)
    reader_cls, planner_cls = _dcp_classes()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(
                state, storage_reader=reader_cls(directory), planner=planner_cls(where=str(directory)), no_dist=no_dist
            )
    except (Exception, CheckpointException) as exc:
        refusal = _dcp_failure(directory, exc)
        if refusal is None:
            raise
        raise refusal from None


def dcp_model_state(directory: str | os.PathLike, prefix: str = "model.") -> dict[str, torch.Tensor]:
    """The tensors under ``prefix`` of the DCP checkpoint in ``directory``, whole, on the CPU, read in
    this process alone (no process group): what ``dcp_to_torch_save`` gives, through the safe paths."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = read_dcp_metadata(directory)
    wanted = {
        fqn[len(prefix) :]: torch.empty(tuple(item.size), dtype=item.properties.dtype)
        for fqn, item in metadata.state_dict_metadata.items()
        if fqn.startswith(prefix) and isinstance(item, TensorStorageMetadata)
    }
    state: dict[str, Any] = {prefix.rstrip("."): wanted}
    dcp_load(state, directory, no_dist=True)
    return state[prefix.rstrip(".")]


# ---- DeepSpeed ------------------------------------------------------------------------------------


def check_deepspeed_files(directory: str | os.PathLike) -> None:
    """Refuse (one line naming the file) a DeepSpeed checkpoint tag directory holding a ``.pt`` file
    that does not load with ``weights_only`` and ``deepspeed_globals``."""
    allow = deepspeed_globals()
    for path in sorted(Path(directory).glob("*.pt")):
        check_torch_file(path, allow=allow)


def zero_state_dict(checkpoint_dir: str | os.PathLike, tag: str) -> dict[str, torch.Tensor]:
    """DeepSpeed's ``zero_to_fp32`` consolidation of ``checkpoint_dir/tag``, with every file it opens
    checked first and loaded with ``weights_only`` (it asks for ``weights_only=False`` itself)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    check_deepspeed_files(Path(checkpoint_dir) / tag)
    with weights_only_loads(deepspeed_globals()):
        try:
            return get_fp32_state_dict_from_zero_checkpoint(str(checkpoint_dir), tag=tag)
        except pickle.UnpicklingError as exc:  # a file changed after the check
            raise _refusal(Path(checkpoint_dir) / tag, exc) from None
