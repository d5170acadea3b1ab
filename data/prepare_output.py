"""Where ``python -m data.prepare`` writes: checked before any work, resumable after a kill.

- ``check_writable``: ``--out`` can be created (its nearest existing ancestor is a folder this process
  can write in), tested before the corpus is read or a tokenizer trained.
- ``partial_output``: the shards are written under ``<out>.partial`` and renamed to ``<out>`` when
  complete. A ``progress.json`` journal there records, every few seconds and whenever a shard is
  complete, how many tokenisation chunks of each split are on disk (and fsynced) and the shard
  records they made. A rerun with the same inputs (documents, split, tokenizer, shard size: the
  journal's ``key``) resumes from there: bytes past the journal are cut off, the recorded chunks are
  skipped. A rerun with other inputs discards the folder (with a note). An interruption (SIGINT,
  SIGTERM through the CLI) keeps the folder for that resume; any other error deletes it.
- A ``owner`` file holds the writing process's pid: a second live ``data.prepare`` on the same
  ``--out`` is refused; one left by a dead process is taken over.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from core.errors import ConfigError
from core.files import fsync_dir
from data.shards import SPLITS, ShardRecord, SplitRecord, SplitWriter, check_output

PARTIAL_SUFFIX = ".partial"
PROGRESS_FILE = "progress.json"
OWNER_FILE = "owner"
PROGRESS_FORMAT = "focused-pretrain-shards-progress"
JOURNAL_SECONDS = 10.0  # at most this much tokenising is redone after a kill (plus the chunk in flight)


def partial_dir(out: Path) -> Path:
    return out.with_name(out.name + PARTIAL_SUFFIX)


def check_writable(out: Path) -> None:
    """``out`` can be created: its nearest existing ancestor is a folder this process can write in
    (tried, not guessed from permission bits: root ignores them, read-only mounts do not show in them)."""
    out = Path(out).expanduser().absolute()
    existing = out.parent
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"--out: {str(out)!r} would be inside {str(existing)!r}, which is a file")
    try:
        probe = tempfile.mkdtemp(prefix=f".{out.name}.probe-", dir=existing)
        os.rmdir(probe)
    except OSError as exc:
        raise ConfigError(
            f"--out: cannot write in {str(existing)!r} ({exc.strerror or exc}); choose a folder you can write to"
        ) from None


@dataclass
class Resume:
    """What an interrupted run left: per split, the chunks written and their shard records."""

    chunks: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SPLITS, 0))
    documents: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SPLITS, 0))
    records: dict[str, SplitRecord] = field(default_factory=dict)


class Journal:
    """``progress.json`` of a partial folder: written atomically after the data it names is on disk."""

    def __init__(self, directory: Path, key: str, resume: Resume | None):
        self.directory, self.key = directory, key
        self.state = resume or Resume()
        self._last = time.monotonic()
        self._shards = self._count()

    def _count(self) -> int:
        return sum(len(r.shards) for r in self.state.records.values())

    def chunk_done(self, split: str, documents: int, writers: dict[str, SplitWriter]) -> None:
        """One more chunk of ``split`` is written; journal it when a shard was completed or a while has passed."""
        self.state.chunks[split] += 1
        self.state.documents[split] += documents
        self.state.records = {name: w.record for name, w in writers.items()}
        shards = self._count()
        if shards > self._shards or time.monotonic() - self._last >= JOURNAL_SECONDS:
            self.save(writers)
            self._shards = shards

    def save(self, writers: dict[str, SplitWriter]) -> None:
        for writer in writers.values():
            writer.sync()
        doc = {
            "format": PROGRESS_FORMAT,
            "key": self.key,
            "itemsize": {name: w.dtype.itemsize for name, w in writers.items()},
            "chunks": self.state.chunks,
            "documents": self.state.documents,
            "records": {name: asdict(record) for name, record in self.state.records.items()},
        }
        tmp = self.directory / f"{PROGRESS_FILE}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(doc, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.directory / PROGRESS_FILE)
        self._last = time.monotonic()

    def writers(self, dtype: str, shard_tokens: int) -> dict[str, SplitWriter]:
        """A writer per split, reopened where the journal left it."""
        records = self.state.records
        return {
            name: SplitWriter(self.directory, name, dtype, shard_tokens, record=records.get(name) if records else None)
            for name in SPLITS
        }


def _read_resume(directory: Path, key: str) -> Resume | None:
    try:
        doc = json.loads((directory / PROGRESS_FILE).read_text(encoding="utf-8"))
        if doc.get("format") != PROGRESS_FORMAT or doc.get("key") != key:
            return None
        records = {
            name: SplitRecord(**{**rec, "shards": [ShardRecord(**s) for s in rec["shards"]]})
            for name, rec in doc["records"].items()
        }
        for name, record in records.items():  # every byte the journal names is there
            for shard in record.shards:
                if (directory / shard.file).stat().st_size < shard.tokens * int(doc["itemsize"][name]):
                    return None
        return Resume({**doc["chunks"]}, {**doc["documents"]}, records)
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None


def _owner_alive(directory: Path) -> int | None:
    """The pid of another live process writing ``directory``, if any."""
    try:
        pid = int((directory / OWNER_FILE).read_text().strip())
    except (OSError, ValueError):
        return None
    if pid == os.getpid():
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        return pid  # alive, another user's
    return pid


@contextlib.contextmanager
def partial_output(
    out: str | Path, *, key: str, overwrite: bool = False, log: Callable[[str], None] = print
) -> Iterator[Journal]:
    """A journal over ``<out>.partial`` (resumed when its key matches ``key``); the folder becomes
    ``out`` on success, is kept on an interruption (KeyboardInterrupt) and deleted on any other error."""
    out = Path(out).expanduser().absolute()
    check_output(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    directory = partial_dir(out)
    resume = None
    if directory.exists():
        other = _owner_alive(directory)
        if other is not None:
            raise ConfigError(f"--out: another data.prepare (pid {other}) is writing {str(directory)!r}; wait for it")
        resume = _read_resume(directory, key)
        if resume is None:
            log(f"note: discarding {directory} (left by a run with other inputs, or unreadable)")
            shutil.rmtree(directory)
        else:
            shards = sum(len(r.shards) for r in resume.records.values())
            docs = sum(resume.documents.values())
            log(f"resuming {directory}: {docs:,} documents already written ({shards} shard files)")
    directory.mkdir(exist_ok=True)
    (directory / OWNER_FILE).write_text(f"{os.getpid()}\n")
    try:
        yield Journal(directory, key, resume)
        for name in (PROGRESS_FILE, OWNER_FILE):
            (directory / name).unlink(missing_ok=True)
        _commit(directory, out, overwrite)
    except KeyboardInterrupt:
        (directory / OWNER_FILE).unlink(missing_ok=True)
        (directory / f"{PROGRESS_FILE}.tmp").unlink(missing_ok=True)
        raise
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise


def _commit(tmp: Path, out: Path, overwrite: bool) -> None:
    check_output(out, overwrite)  # again: another process may have written ``out`` meanwhile
    if out.is_dir() and any(out.iterdir()):
        # rename() cannot replace a non-empty directory: move the old one aside, then swap
        old = out.with_name(f"{out.name}.old-{os.getpid()}")
        os.rename(out, old)
        try:
            os.rename(tmp, out)
        except BaseException:
            os.rename(old, out)
            raise
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, out)  # atomic; also replaces an empty directory
    with contextlib.suppress(OSError):  # not every filesystem lets a directory be opened
        fsync_dir(out.parent)
