"""``data.*``: where text comes from, how it is tokenised, and how it is cut into sequences."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from core.cache import cache_root
from core.errors import ConfigError, check_choice, check_min, check_range
from core.files import NotRegularFile, file_kind, read_regular_text
from data.stream_config import WEIGHTINGS, StreamConfig

HUB = ("slimpajama", "fineweb-edu", "openwebtext", "pg19")  # streamed with `datasets` (data/stream_sources.py)
SOURCES = ("embedded", "local", "prepared", *HUB, "mixture")
MIN_TRAINED_VOCAB = 3 + 256 + 1  # <unk> <s> </s> + byte-fallback pieces + "\n"; real corpora need ~100 more


@dataclass
class MixtureEntry:
    """One ``[[data.mixture]]`` table: a named hub source (with ``name`` = its config) or local files."""

    source: str = "local"  # slimpajama | fineweb-edu | openwebtext | pg19 | local
    path: str = ""  # local: a file, folder or glob of one file type; a named source: a local mirror of its hub repo
    name: str = ""  # hub config, e.g. sample-10BT ("" = the source's default)
    weight: float = 1.0  # relative share of tokens (data.mixture_weighting = tokens) or of documents drawn

    def key(self) -> str:
        """The source key data.streaming understands: a local path, or name[:config]."""
        if self.source == "local":
            if not self.path:
                raise ConfigError("data.mixture: a local entry needs path (a file, folder or glob)")
            return self.path
        check_choice("data.mixture.source", self.source, (*HUB, "local"))
        return f"{self.source}:{self.name}" if self.name else self.source


def custom_code(folder: Path) -> str:
    """Where a tokenizer folder names custom code, else '': an ``auto_map`` in tokenizer_config.json (the tokenizer's
    own), or an ``AutoTokenizer`` entry in config.json's (a model's auto_map for its model classes is not the
    tokenizer's: a focused export's folder keeps it)."""
    for name, key in (("tokenizer_config.json", None), ("config.json", "AutoTokenizer")):
        try:
            # utf-8-sig: a byte-order mark must not hide an auto_map (json.loads refuses one, and was skipped)
            config = json.loads(read_regular_text(folder / name, encoding="utf-8-sig"))
        except NotRegularFile as exc:  # a FIFO would block the read (and the training) until killed
            raise ConfigError(f"data.tokenizer: {folder / name} {exc.strerror}") from None
        except (OSError, ValueError):
            continue
        auto_map = config.get("auto_map") if isinstance(config, dict) else None
        if auto_map and (key is None or not isinstance(auto_map, dict) or key in auto_map):
            return f"auto_map in {name}"
    return ""


# a Hugging Face tokenizer folder's settings, copied along with its tokenizer file (config.json is read, not copied)
HF_COMPANIONS = ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "chat_template.jinja")
COMPANIONS = (*HF_COMPANIONS, "config.json")


def check_companions(folder: Path, names: tuple[str, ...]) -> None:
    """Each of ``names`` in ``folder`` is absent, or a regular file inside ``folder`` (a link is followed only within
    it: one out of it would copy outside content into every checkpoint and export), and a ``.json`` one parses (a
    byte-order mark allowed). Checked by ``lstat`` / ``stat`` alone: nothing is opened that is not a regular file."""
    for name in names:
        file = folder / name
        if not os.path.lexists(file):
            continue
        target = file.resolve()
        if not target.is_relative_to(folder.resolve()):
            raise ConfigError(
                f"data.tokenizer: {file} is a link to {target}, outside the folder; copy the file into {folder}"
            )
        kind = file_kind(target)
        if kind is not None:  # never opened: a FIFO would block the read until killed
            raise ConfigError(f"data.tokenizer: {file} is {kind}, not a regular file")
        if file.suffix == ".json":
            try:
                json.loads(read_regular_text(target, encoding="utf-8-sig"))
            except (ValueError, OSError) as exc:
                raise ConfigError(f"data.tokenizer: {file} is not valid JSON ({exc})") from None


def custom_code_line(folder: Path, where: str) -> str:
    return (
        f"data.tokenizer: {folder} names custom code ({where}), which this project never runs nor copies; give a "
        "folder without it (tokenizer.json, tokenizer.model or a .tiktoken file alone)"
    )


@dataclass
class DataConfig:
    # embedded | local (read whole, indexable) | prepared (data.prepare shards in data.path) |
    # slimpajama | fineweb-edu | openwebtext | pg19 (streamed from the hub) | mixture (data.mixture)
    source: str = "embedded"
    # local: a file, a folder (recursive) or a glob of .txt / .jsonl / .parquet; prepared: the shard directory;
    # a named hub source: "" (stream from the hub) or a local folder mirroring the hub repo (docs/data.md)
    path: str = ""
    seq_len: int = 256  # training sequence length (tokens per row)
    tokenizer: str = (
        "train"  # train (SentencePiece BPE on the training split, cached) | path to .model | tokenizer.json | HF folder
    )
    vocab_size: int = 0  # vocabulary of a trained tokenizer; 0 = model.vocab_size
    text_field: str = "text"  # jsonl / parquet column
    val_fraction: float = 0.05  # share of documents held out, chosen by a stable hash of the document id
    cache_dir: str = ""  # "" = $FOCUSED_PRETRAIN_CACHE or ~/.cache/focused-pretrain
    # ---- streaming (hub sources, mixtures, and local files with streaming = true) ----
    streaming: bool = False  # local: stream the files instead of reading them whole
    name: str = ""  # hub config, e.g. sample-10BT for fineweb-edu ("" = the source's default)
    split: str = "train"  # hub split to stream
    shuffle_window: int = 1024  # documents shuffled together (restorable exactly); 0 = source order
    num_workers: int = 2  # loader worker processes per rank (tokenisation happens there)
    mixture: list[MixtureEntry] = field(default_factory=list)  # [[data.mixture]] tables, with data.source = "mixture"
    mixture_weighting: str = "tokens"  # a mixture weight is a share of tokens | documents (data/mixture.py)
    val_path: str = ""  # streamed runs: local held-out files for validation ("" = no validation loss)
    tokenizer_sample_docs: int = 2000  # streamed runs with tokenizer = "train": documents it is trained on
    # attention stays within each packed document (EOS ends one) and positions restart per document
    document_masking: bool = False

    @property
    def is_streaming(self) -> bool:
        return self.source in HUB or self.source == "mixture" or (self.source == "local" and self.streaming)

    def stream_config(self, seed: int) -> StreamConfig:
        """The data.streaming view of these settings."""
        names = ("mixture_weighting", "split", "text_field", "shuffle_window", "num_workers")
        shared = {name: getattr(self, name) for name in names}
        if self.source == "mixture":
            if not self.mixture:
                raise ConfigError(
                    "data.mixture: data.source = 'mixture' needs [[data.mixture]] tables (source, path or name, weight)"
                )
            return StreamConfig(
                mixture={m.key(): m.weight for m in self.mixture}, mirrors=self._mirrors(), seed=seed, **shared
            )
        # path: local, the files; a named source, its mirror ("" = the hub)
        return StreamConfig(source=self.source, path=self.path, config_name=self.name, seed=seed, **shared)

    def _mirrors(self) -> dict[str, str]:
        """{named source: local mirror} from the mixture entries that name one."""
        mirrors: dict[str, str] = {}
        for m in self.mixture:
            if m.source == "local" or not m.path:
                continue
            if mirrors.setdefault(m.source, m.path) != m.path:
                raise ConfigError(
                    f"data.mixture: {m.source} has two mirrors, {mirrors[m.source]!r} and {m.path!r}; a mirror is "
                    "the whole hub repo, one per source"
                )
        return mirrors

    def validate(self) -> None:
        check_choice("data.source", self.source, SOURCES)
        check_choice("data.mixture_weighting", self.mixture_weighting, WEIGHTINGS)
        if self.mixture and self.source != "mixture":
            raise ConfigError(f"data.mixture: set data.source = 'mixture' to use it (data.source is {self.source!r})")
        if self.is_streaming:
            self.stream_config(seed=0).validate()
            check_min("data.tokenizer_sample_docs", self.tokenizer_sample_docs, 1)
            if self.val_path:
                from data.sources import resolve_paths

                try:
                    resolve_paths(self.val_path)
                except ConfigError as exc:
                    raise ConfigError(str(exc).replace("data.path", "data.val_path", 1)) from None
        if self.source == "prepared":
            if not self.path or not (Path(self.path).expanduser() / "index.json").is_file():
                raise ConfigError(
                    f"data.path: {self.path!r} is not a prepared shard directory (no index.json); write one with "
                    "python -m data.prepare"
                )
        check_min("data.seq_len", self.seq_len, 1)
        check_range("data.val_fraction", self.val_fraction, 0.0, 1.0, open_low=True, open_high=True)
        check_min("data.vocab_size", self.vocab_size, 0, note=" (0 = model.vocab_size)")
        if self.tokenizer == "train" and 0 < self.vocab_size < MIN_TRAINED_VOCAB:
            raise ConfigError(
                f"data.vocab_size: {self.vocab_size} is too small for a trained tokenizer; must be 0 (= "
                f"model.vocab_size) or >= {MIN_TRAINED_VOCAB}"
            )
        if not self.text_field:
            raise ConfigError("data.text_field: must name the jsonl field / parquet column holding the text, got ''")
        if self.source == "local" and not self.streaming:
            from data.sources import resolve_paths

            if not self.path:
                raise ConfigError(
                    "data.path: required with data.source = 'local' (a file, folder or glob of .txt, .jsonl or "
                    ".parquet)"
                )
            resolve_paths(self.path)
        if self.tokenizer != "train":
            path = Path(self.tokenizer).expanduser()
            if not path.exists():
                raise ConfigError(
                    f"data.tokenizer: no such file {self.tokenizer!r} (expected 'train', a SentencePiece .model, a "
                    "tokenizer.json, a .tiktoken file or a Hugging Face tokenizer folder)"
                )
            if path.is_file() and path.suffix not in (".model", ".json", ".tiktoken"):
                raise ConfigError(
                    f"data.tokenizer: {self.tokenizer!r} is not a SentencePiece .model, a tokenizer.json or a "
                    ".tiktoken file"
                )
            folder = path if path.is_dir() else path.parent
            in_folder = path.is_dir() or path.name in ("tokenizer.json", "tokenizer.model")
            if in_folder:  # its companions travel with it: checked before any is opened
                check_companions(folder, COMPANIONS)
            where = custom_code(folder) if in_folder else ""
            if where:  # checked here too, so that --dry-run says it (data/tokenizer.py refuses it when loading)
                raise ConfigError(custom_code_line(folder, where))

    @property
    def cache_path(self) -> Path:
        if self.cache_dir:
            return Path(self.cache_dir).expanduser()
        return cache_root()
