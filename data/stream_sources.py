"""Sources of streamed documents: named Hugging Face Hub datasets and local files.

Both are read with ``datasets`` in streaming mode: a hub source is exactly
``load_dataset(path, name, split=split, streaming=True)``, where ``path`` is the hub repo
id or, for a local mirror of that repo (``data.path`` with a named source), the mirror's
folder: datasets reads its README configs, split folders, compression and schema as it
would on the hub; local ``.jsonl`` /
``.parquet`` / ``.txt`` files (a file, a folder or a glob, one file type per source)
go through datasets' ``json`` / ``parquet`` / ``text`` builders with ``data_files``,
the text builder with ``sample_by="document"`` so a ``.txt`` file is one document, as
in ``data.sources``. Either way a data file is one shard (``IterableDataset.shard``), and a
``ShardReader`` reads a list of shards from a ``Cursor`` that restores exactly through datasets'
own ``state_dict`` / ``load_state_dict``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from core.errors import ConfigError
from data.sources import _doc_name, _root, resolve_paths

if TYPE_CHECKING:
    import datasets

LOCAL = "local"
READ_BATCH = 256  # rows per datasets read; a restore re-reads at most one read batch
BUILDERS = {".jsonl": "json", ".parquet": "parquet", ".txt": "text"}


@dataclass(frozen=True)
class HubSource:
    """A named dataset on the Hugging Face Hub."""

    name: str
    path: str
    configs: tuple[str, ...] = ()  # () = the dataset has no named configs: load_dataset(path, None, ...)
    default_config: str | None = None
    splits: tuple[str, ...] = ("train",)
    text_field: str = "text"
    meta_field: str = ""  # dotted path of a per-document label worth logging ("" = none)
    mirror_layout: str = ""  # what a local mirror of the repo holds (errors and docs)


HUB_SOURCES: dict[str, HubSource] = {
    s.name: s
    for s in (
        HubSource(
            "slimpajama", "cerebras/SlimPajama-627B", splits=("train", "validation", "test"),
            meta_field="meta.redpajama_set_name",
            mirror_layout="<split>/chunk<k>/example_<train|holdout>_<i>.jsonl.zst",
        ),
        HubSource(
            "fineweb-edu", "HuggingFaceFW/fineweb-edu",
            configs=("sample-10BT", "sample-100BT", "sample-350BT", "default"), default_config="sample-10BT",
            meta_field="dump",
            mirror_layout="README.md (configs) + data/<dump>/*.parquet and sample/<10BT|100BT|350BT>/*.parquet",
        ),
        HubSource("openwebtext", "Skylion007/openwebtext", mirror_layout="plain_text/train-*.parquet"),
        HubSource(
            "pg19", "deepmind/pg19", splits=("train", "validation", "test"), meta_field="short_book_title",
            mirror_layout="data/<split>-*.parquet",
        ),
    )
}  # fmt: skip


@dataclass(frozen=True)
class SourceSpec:
    """One resolved source: a hub dataset (config, split) or local data files of one type."""

    name: str  # the key of token counts and mixture weights
    text_field: str
    meta_field: str = ""
    hub: HubSource | None = None
    config: str | None = None
    split: str = "train"
    files: tuple[str, ...] = ()  # local, sorted
    shard_names: tuple[str, ...] = ()  # local: file names relative to the folder / glob prefix the user named
    mirror: str = ""  # hub: a local folder holding a copy of the hub repo, read instead of the hub
    mirror_key: str = "data.path"  # the config key that named the mirror (errors)

    @property
    def kind(self) -> str:
        return "hub" if self.hub else LOCAL

    @property
    def builder(self) -> str:
        return BUILDERS[Path(self.files[0]).suffix]

    def open(self) -> datasets.IterableDataset:
        """The source as a streaming ``datasets.IterableDataset`` holding only the columns we read."""
        import datasets  # the module attribute is looked up at call time, so tests can monkeypatch load_dataset

        if self.hub:
            ds = self._load_hub(datasets)
        else:
            extra = {"sample_by": "document"} if self.builder == "text" else {}
            ds = datasets.load_dataset(
                self.builder, data_files=list(self.files), split="train", streaming=True, **extra
            )
        columns = [self.text_field.split(".")[0]] + ([self.meta_field.split(".")[0]] if self.meta_field else [])
        if ds.features is not None:
            if columns[0] not in ds.features:
                raise ConfigError(
                    f"data.text_field: source {self.name!r} has no field {self.text_field!r} (fields: "
                    f"{', '.join(ds.features)})"
                )
            columns = [c for c in dict.fromkeys(columns) if c in ds.features]  # a missing label column is no error
            ds = ds.select_columns(columns)
        return ds

    def _load_hub(self, datasets: ModuleType) -> datasets.IterableDataset:
        """``load_dataset(repo or mirror, config, split, streaming=True)``; its refusals as one-line errors."""
        assert self.hub is not None
        where = self.mirror or self.hub.path
        key = self.mirror_key if self.mirror else "data.source"
        try:
            return datasets.load_dataset(where, self.config, split=self.split, streaming=True)
        except RuntimeError as exc:
            if "scripts are no longer supported" not in str(exc):
                raise
            raise ConfigError(
                f"{key}: {where} is a loading-script dataset, which datasets>=4 no longer runs; point data.path at a "
                f"local mirror holding {self.hub.mirror_layout} (docs/data.md)"
            ) from None
        except ValueError as exc:  # datasets: "Bad split: ..." / "BuilderConfig 'x' not found. Available: ..."
            if not self.mirror:
                raise
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise ConfigError(f"{key}: the mirror {where} cannot give {self.name} ({first})") from None
        except FileNotFoundError as exc:
            if not self.mirror:
                raise
            raise ConfigError(
                f"{key}: the mirror {where} holds no data files of {self.name}; expected {self.hub.mirror_layout} "
                f"({str(exc).splitlines()[0] if str(exc) else 'no files'})"
            ) from None

    def shard_name(self, index: int) -> str:
        return self.shard_names[index] if self.shard_names else f"{self.split}/shard{index:05d}"


def _local_spec(name: str, path: str, text_field: str, key: str, files: list[Path] | None = None) -> SourceSpec:
    files = files or resolve_paths(path)
    kinds = sorted({f.suffix for f in files})
    if len(kinds) > 1:
        raise ConfigError(
            f"{key}: {path!r} mixes {' and '.join(kinds)} files; a streamed source holds one file type (use "
            "data.mixture for several)"
        )
    root = _root(path)
    return SourceSpec(
        name=name,
        text_field=text_field or "text",
        files=tuple(str(f) for f in files),
        shard_names=tuple(_doc_name(f, root) for f in files),
    )


def _check_mirror(mirror: str, source: HubSource, key: str) -> str:
    """A local mirror is a folder holding a copy of the hub repo's files."""
    if not mirror:
        return ""
    folder = Path(mirror).expanduser()
    if not folder.is_dir():
        raise ConfigError(
            f"{key}: {mirror!r} is not a folder; with a named source it is a local mirror of {source.path} "
            f"({source.mirror_layout})"
        )
    for script in dict.fromkeys((f"{folder.name}.py", f"{Path(source.path).name}.py")):
        if (folder / script).is_file():
            raise ConfigError(
                f"{key}: {mirror!r} holds the loading script {script}, which datasets>=4 no longer runs; mirror the "
                f"data files instead ({source.mirror_layout})"
            )
    return str(folder)


def _hub_spec(
    name: str, source: HubSource, config: str, split: str, key: str, mirror: str = "", mirror_key: str = "data.path"
) -> SourceSpec:
    if source.configs and config and config not in source.configs:
        raise ConfigError(f"{key}: {config!r} is not a config of {source.name}; one of {', '.join(source.configs)}")
    if config and not source.configs:
        raise ConfigError(f"{key}: {source.name} has no configs, got {config!r}")
    if split not in source.splits:
        raise ConfigError(f"data.split: {split!r} is not a split of {source.name}; one of {', '.join(source.splits)}")
    return SourceSpec(
        name=name,
        text_field=source.text_field,
        meta_field=source.meta_field,
        hub=source,
        config=(config or source.default_config) if source.configs else None,
        split=split,
        mirror=_check_mirror(mirror, source, mirror_key),
        mirror_key=mirror_key,
    )


def resolve_source(
    key: str,
    *,
    path: str = "",
    config: str = "",
    split: str = "train",
    text_field: str = "",
    field: str = "data.source",
    mirrors: dict[str, str] | None = None,
) -> SourceSpec:
    """``key``: a named source, ``local`` (then ``path``), or in a mixture ``name:config`` / a local path.

    ``mirrors``: {named source: local folder mirroring its hub repo}."""
    if key == LOCAL:
        if not path:
            raise ConfigError(
                f"data.path: required with {field} = 'local' (a file, folder or glob of .txt, .jsonl or .parquet)"
            )
        return _local_spec(path, path, text_field, "data.path")
    name, _, key_config = key.partition(":")
    if name in HUB_SOURCES:
        return _hub_spec(
            key,
            HUB_SOURCES[name],
            key_config or config,
            split,
            field if key_config else "data.config_name",
            (mirrors or {}).get(name, ""),
            "data.mixture" if field == "data.mixture" else "data.path",
        )
    if field == "data.source":
        raise ConfigError(f"data.source: {key!r} is not one of {', '.join([*HUB_SOURCES, LOCAL])}")
    try:
        files = resolve_paths(key)
    except ConfigError:
        raise ConfigError(
            f"{field}: {key!r} is neither a named source ({', '.join(HUB_SOURCES)}[:config]) nor an existing file, "
            "folder or glob of .txt, .jsonl or .parquet"
        ) from None
    return _local_spec(key, key, text_field, field, files)


# ---- reading -----------------------------------------------------------------------------------


@dataclass
class Cursor:
    """Where reading resumes: shard ``shard`` of the epoch's list, the datasets state ``hf`` taken at
    the start of a read batch (None = the shard's start), ``skip`` rows into that batch, ``row`` rows
    into the shard (for document ids)."""

    shard: int = 0
    hf: dict | None = None
    skip: int = 0
    row: int = 0


def _values(batch: dict, path: str, name: str) -> list:
    top, *rest = path.split(".")
    if top not in batch:
        raise ConfigError(f"data.text_field: source {name!r} has no field {path!r} (fields: {', '.join(batch)})")
    values = batch[top]
    for key in rest:
        values = [v.get(key) if isinstance(v, dict) else None for v in values]
    return values


class ShardReader:
    """Rows of one epoch's shard list read with datasets (``IterableDataset.shard`` + ``iter``), from a cursor."""

    def __init__(self, spec: SourceSpec, base: datasets.IterableDataset, shards: list[int], cursor: Cursor):
        self.spec, self.base, self.shards = spec, base, shards
        self.cursor = replace(cursor)
        self._it: Iterator[dict[str, Any]] | None = None
        self._batch: list[tuple[str | None, str | None]] = []

    def _open(self) -> None:
        c = self.cursor
        ds = self.base.shard(num_shards=self.base.num_shards, index=self.shards[c.shard], contiguous=True)
        if c.hf is not None:
            ds.load_state_dict(c.hf)
        # .iter() rather than iter(ds): inside a loader worker the latter splits shards across workers again
        self._ds, self._it, self._next_hf = ds, ds.iter(batch_size=READ_BATCH), c.hf
        pulled = self._pull()
        self._batch = pulled[1] if pulled else []

    def _pull(self) -> tuple[dict | None, list] | None:
        """The next read batch and the datasets state at its start."""
        start = self._next_hf
        assert self._it is not None  # _open sets it
        try:
            batch = next(self._it)
        except StopIteration:
            return None
        except UnicodeDecodeError:
            raise ConfigError(
                f"data.path: {self.spec.shard_name(self.shards[self.cursor.shard])} is not UTF-8 text"
            ) from None
        self._next_hf = self._ds.state_dict()
        texts = _values(batch, self.spec.text_field, self.spec.name)
        if any(t is not None and not isinstance(t, str) for t in texts):
            raise ConfigError(
                f"data.text_field: field {self.spec.text_field!r} of source {self.spec.name!r} does not hold strings"
            )
        meta = self.spec.meta_field
        metas = _values(batch, meta, self.spec.name) if meta and meta.split(".")[0] in batch else [None] * len(texts)
        return start, list(zip(texts, metas))

    def read(self, n: int) -> list[tuple[int, int, str | None, str | None]]:
        """Up to ``n`` rows (shard index, row, text, label); fewer only at the end of the list."""
        out: list[tuple[int, int, str | None, str | None]] = []
        while len(out) < n and self.cursor.shard < len(self.shards):
            if self._it is None:
                self._open()
            c = self.cursor
            if c.skip >= len(self._batch):
                pulled = self._pull()
                if pulled is None:
                    self.cursor, self._it = Cursor(shard=c.shard + 1), None
                    continue
                self.cursor = c = Cursor(c.shard, pulled[0], 0, c.row)
                self._batch = pulled[1]
            take = self._batch[c.skip : c.skip + n - len(out)]
            shard = self.shards[c.shard]
            out.extend((shard, c.row + i, text, meta) for i, (text, meta) in enumerate(take))
            c.skip += len(take)
            c.row += len(take)
        return out
