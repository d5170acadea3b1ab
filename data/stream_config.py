"""``StreamConfig``: what a stream reads (one source or a weighted mixture) and how it is shuffled and mixed."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from core.errors import ConfigError, check_choice, check_min
from data.stream_sources import HUB_SOURCES, LOCAL, SourceSpec, resolve_source

WEIGHTINGS = ("tokens", "documents")  # what a mixture weight is a share of


@dataclass
class StreamConfig:
    source: str = LOCAL  # slimpajama | fineweb-edu | openwebtext | pg19 | local
    # local: a file, folder or glob of one file type (.txt documents, .jsonl, .parquet);
    # a named source: "" (the hub) or a local folder mirroring its hub repo
    path: str = ""
    config_name: str = ""  # hub config ("" = the source's default)
    split: str = "train"  # hub split
    text_field: str = ""  # local jsonl / parquet field; "" = "text" (hub sources use their registry field)
    shuffle_window: int = 1024  # documents shuffled together; 0 = the source's order
    # {named source[:config] or local path: weight}; replaces source
    mixture: dict[str, float] = field(default_factory=dict)
    mirrors: dict[str, str] = field(default_factory=dict)  # mixtures: {named source: local mirror of its hub repo}
    # tokens: a weight is the source's share of the packed tokens (each sequence comes from one source);
    # documents: its share of the documents drawn (sources share sequences). One source: no difference.
    mixture_weighting: str = "tokens"
    num_workers: int = 2  # loader worker processes per rank
    seed: int = 0
    document_masking: bool = False  # also yield per-token document indices

    def validate(self) -> None:
        self.sources()

    @property
    def weighting(self) -> str:
        """The weighting in force: a single source streams as it always has ("documents")."""
        return self.mixture_weighting if len(self.mixture) > 1 else "documents"

    def sources(self) -> list[tuple[SourceSpec, float]]:
        """The resolved sources with weights summing to 1."""
        check_min("data.shuffle_window", self.shuffle_window, 0, note=" (0 = no shuffling)")
        check_min("data.num_workers", self.num_workers, 0)
        check_min("data.seed", self.seed, 0)  # numpy seed sequences take non-negative integers
        check_choice("data.mixture_weighting", self.mixture_weighting, WEIGHTINGS)
        for name in self.mirrors:
            if name not in HUB_SOURCES:
                raise ConfigError(
                    f"data.mixture: a mirror is for a named source ({', '.join(HUB_SOURCES)}), got {name!r}"
                )
        if not self.mixture:
            mirrors = {self.source: self.path} if self.source in HUB_SOURCES and self.path else {}
            spec = resolve_source(
                self.source,
                path=self.path,
                config=self.config_name,
                split=self.split,
                text_field=self.text_field,
                mirrors=mirrors,
            )
            return [(spec, 1.0)]
        if self.path or self.config_name:
            key = "data.path" if self.path else "data.config_name"
            raise ConfigError(
                f"{key}: must be empty with data.mixture; name local paths and 'source:config' in the mixture's keys"
            )
        specs = []
        for key, weight in self.mixture.items():
            if (
                isinstance(weight, bool)
                or not isinstance(weight, (int, float))
                or not math.isfinite(weight)
                or weight <= 0
            ):
                raise ConfigError(f"data.mixture: the weight of {key!r} must be a finite number > 0, got {weight!r}")
            spec = resolve_source(
                key, split=self.split, text_field=self.text_field, field="data.mixture", mirrors=self.mirrors
            )
            specs.append((spec, float(weight)))
        total = sum(w for _, w in specs)
        return [(s, w / total) for s, w in specs]
