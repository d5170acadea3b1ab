"""One source's documents for one loader worker: sharded by rank x worker, window-shuffled, restorable exactly.

Order. G = world_size x num_workers global loader workers; worker g = rank * num_workers + worker id.
Per source and epoch e the shard (data file) order is a permutation seeded by (seed, source, e), then
  * "shards" mode: worker g reads shards perm[g::G]: hub sources whose n_shards % G == 0 (the rule of
    datasets' split_dataset_by_node);
  * "examples" mode: every worker reads every shard and keeps the documents at positions p of the
    shuffled epoch stream with p % G == g: hub sources otherwise, local sources always (so their order
    does not depend on G, and a run can resume on another world size; each worker parses all files).
Either way each document goes to exactly one worker per epoch; workers run their epochs on their own.
Shuffle. The stream is cut into windows of W documents; window k is permuted by a seed from
(seed, source, e, k[, g in shards mode]), so a position is (window start, next position) and restores
exactly with no buffer saved. shuffle_window = 0 keeps the source's order (shards and documents).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from core.errors import ConfigError
from data.sources import normalise_text
from data.stream_sources import LOCAL, Cursor, ShardReader, SourceSpec

if TYPE_CHECKING:
    import datasets

    from data.tokenizer import Tokenizer

UNSHUFFLED_WINDOW = 256  # window length when shuffling is off (windows then only batch the tokeniser)
_SHARDS, _WINDOW, MIX = 1, 2, 3  # RNG stream tags (MIX: the mixture's document draws)


def rng(*key: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(list(key)))


def name_key(name: str) -> int:
    return zlib.crc32(name.encode())  # stable across processes, unlike hash()


@dataclass(frozen=True)
class StreamDoc:
    source: str
    id: str  # "<file or shard>:<row>" (a .txt document: its file name)
    text: str
    epoch: int  # the epoch of this loader worker's stream of its source
    meta: str | None = None  # the source's label field (e.g. SlimPajama's redpajama_set_name)


class SourceStream:
    """One source's documents for loader worker g of G, epoch after epoch, from a restorable position.

    Position (``state()``): epoch, the cursor at the current window's start, window index k, ``next``
    (every kept document before this stream position has been taken), ``rho`` (see ``_keeps``) and
    ``rule``: after a world-size change, which positions of early epochs the previous run consumed.
    """

    def __init__(
        self,
        spec: SourceSpec,
        base: datasets.IterableDataset,
        *,
        seed: int,
        window: int,
        worker: int,
        workers: int,
        tokenizer: Tokenizer | None,
        state: dict,
    ):
        self.spec, self.base, self.seed, self.tokenizer = spec, base, seed, tokenizer
        self.shuffle = window > 0
        self.W = window or UNSHUFFLED_WINDOW
        self.g, self.G = worker, workers
        self.key = name_key(spec.name)
        self.by_shards = spec.kind == "hub" and base.num_shards % workers == 0
        self.epoch, self.k, self.next, self.rho, self.rule = (
            state["epoch"],
            state["window"],
            state["next"],
            state["rho"],
            state["rule"],
        )
        self.cursor = Cursor(*state["cursor"])
        clean = state["cursor"] == [0, None, 0, 0] and self.k == 0 and self.next == 0 and self.rule is None
        self._kept_in_epoch: int | None = 0 if clean else None  # unknown when restored mid-epoch
        self._reader: ShardReader | None = None
        self._kept: list[tuple[int, StreamDoc]] | None = None
        self._tokens: list[np.ndarray] | None = None

    @staticmethod
    def fresh_state() -> dict:
        return {"epoch": 0, "cursor": [0, None, 0, 0], "window": 0, "next": 0, "rho": 0, "rule": None}

    def state(self) -> dict:
        c = self.cursor
        return {
            "epoch": self.epoch,
            "cursor": [c.shard, c.hf, c.skip, c.row],
            "window": self.k,
            "next": self.next,
            "rho": self.rho,
            "rule": self.rule,
        }

    def _shards(self, epoch: int) -> list[int]:
        n = self.base.num_shards
        order = rng(self.seed, _SHARDS, self.key, epoch).permutation(n).tolist() if self.shuffle else list(range(n))
        return order[self.g :: self.G] if self.by_shards else order

    def _rule_limits(self) -> list | None:
        if self.rule is None:
            return None
        i = self.epoch - self.rule["first"]
        return self.rule["limits"][i] if 0 <= i < len(self.rule["limits"]) else None

    def _keeps(self, pos: int, rho: int, limits: list | None) -> tuple[bool, int]:
        """Whether this worker takes stream position ``pos``. In an epoch the previous run (on another
        world size) had begun, the positions it had not consumed are counted (rho) and dealt round-robin."""
        if limits is not None:
            limit = limits[pos % self.rule["workers"]]
            if limit is None or pos < limit:
                return False, rho
            return rho % self.G == self.g, rho + 1
        return self.by_shards or pos % self.G == self.g, rho

    def _end_epoch(self) -> None:
        if self._kept_in_epoch == 0 and self._rule_limits() is None:
            raise ConfigError(
                f"data: source {self.spec.name!r} gives loader worker {self.g} of {self.G} no documents; "
                "it holds fewer documents (or shards) than ranks x loader workers"
            )
        self.epoch, self.cursor, self.k, self.next, self.rho = self.epoch + 1, Cursor(), 0, 0, 0
        self._reader, self._kept_in_epoch = None, 0
        if self.rule and self.epoch >= self.rule["first"] + len(self.rule["limits"]):
            self.rule = None

    def _load_window(self) -> None:
        while True:
            if self._reader is None:
                self._reader = ShardReader(self.spec, self.base, self._shards(self.epoch), self.cursor)
            rows = self._reader.read(self.W)
            if rows:
                break
            self._end_epoch()
        self._end_cursor = replace(self._reader.cursor)
        gtag = self.g + 1 if self.by_shards else 0  # examples mode: one order for every worker and world size
        order = (
            rng(self.seed, _WINDOW, self.key, self.epoch, self.k, gtag).permutation(len(rows))
            if self.shuffle
            else range(len(rows))
        )
        limits, rho, kept = self._rule_limits(), self.rho, []
        for j, r in enumerate(order):
            pos = self.k * self.W + j
            keep, rho = self._keeps(pos, rho, limits)
            shard, row, text, meta = rows[r]
            if keep and text is not None:  # a null text is no document; its position still counts
                name = self.spec.shard_name(shard)
                doc_id = name if self.spec.kind == LOCAL and self.spec.builder == "text" else f"{name}:{row}"
                kept.append(
                    (
                        pos,
                        StreamDoc(
                            self.spec.name,
                            doc_id,
                            normalise_text(text),
                            self.epoch,
                            None if meta is None else str(meta),
                        ),
                    )
                )
        self._rho_end, self._kept, self._tokens = rho, kept, None
        self._i = next((i for i, (pos, _) in enumerate(kept) if pos >= self.next), len(kept))

    def _window_tokens(self) -> list[np.ndarray]:
        if self._tokens is None:  # the whole window in one encode_batch call
            assert self._kept is not None and self.tokenizer is not None
            eos = self.tokenizer.eos_id
            self._tokens = [
                np.asarray([*ids, eos], dtype=np.int64)
                for ids in self.tokenizer.encode_batch([d.text for _, d in self._kept])
            ]
        return self._tokens

    def take(self) -> tuple[int, StreamDoc, np.ndarray | None]:
        """The next document: (stream position, document, its tokens + EOS when there is a tokenizer)."""
        while True:
            if self._kept is None:
                self._load_window()
            assert self._kept is not None  # _load_window sets it
            if self._i < len(self._kept):
                pos, doc = self._kept[self._i]
                tokens = self._window_tokens()[self._i] if self.tokenizer is not None else None
                self._i += 1
                self.next = pos + 1
                if self._kept_in_epoch is not None:
                    self._kept_in_epoch += 1
                return pos, doc, tokens
            # this window is used up; the next one starts where reading it ended
            self.cursor, self.k, self.rho, self._kept = self._end_cursor, self.k + 1, self._rho_end, None
            self.next = self.k * self.W
