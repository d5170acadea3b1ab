"""Streaming training data: hub or local documents -> split by rank and loader worker -> seeded window
shuffle -> weighted mixture -> tokenised and packed inside the loader workers, restorable exactly.

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
Mixture. Draw d picks a source by an RNG seeded from (seed, generation, g, d // 1024): its state is d.
Packing. EOS ends every document; a sequence holds T + 1 tokens and shares its first token with the last
one of the sequence before (as data.packing), so every token is a target exactly once.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import numpy as np
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from core.errors import ConfigError, check_min
from data.sources import normalise_text
from data.stream_sources import (
    HUB_SOURCES,
    LOCAL,
    Cursor,
    HubSource,
    ShardReader,
    SourceSpec,
    resolve_source,
)
from model.documents import document_mask, document_positions  # noqa: F401  (re-exported: the streams' doc ids feed them)

__all__ = [
    "HUB_SOURCES",
    "DocumentBatch",
    "HubSource",
    "SourceSpec",
    "StreamConfig",
    "StreamDataset",
    "StreamDoc",
    "StreamLoader",
    "build_stream_loader",
    "document_mask",
    "document_positions",
    "token_counts",
]

STATE_FORMAT = "stream-v1"
UNSHUFFLED_WINDOW = 256  # window length when shuffling is off (windows then only batch the tokeniser)
MIX_BLOCK = 1024  # mixture draws generated per RNG
_SHARDS, _WINDOW, _MIX = 1, 2, 3  # RNG stream tags


def _rng(*key: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(list(key)))


def _name_key(name: str) -> int:
    return zlib.crc32(name.encode())  # stable across processes, unlike hash()


# ---- config ---------------------------------------------------------------------------------


@dataclass
class StreamConfig:
    source: str = LOCAL  # slimpajama | fineweb-edu | openwebtext | pg19 | local
    path: str = ""  # local: a file, folder or glob of one file type (.txt documents, .jsonl, .parquet)
    config_name: str = ""  # hub config ("" = the source's default)
    split: str = "train"  # hub split
    text_field: str = ""  # local jsonl / parquet field; "" = "text" (hub sources use their registry field)
    shuffle_window: int = 1024  # documents shuffled together; 0 = the source's order
    mixture: dict[str, float] = field(
        default_factory=dict
    )  # {named source[:config] or local path: weight}; replaces source
    num_workers: int = 2  # loader worker processes per rank
    seed: int = 0
    document_masking: bool = False  # also yield per-token document indices

    def validate(self) -> None:
        self.sources()

    def sources(self) -> list[tuple[SourceSpec, float]]:
        """The resolved sources with weights summing to 1."""
        check_min("data.shuffle_window", self.shuffle_window, 0, note=" (0 = no shuffling)")
        check_min("data.num_workers", self.num_workers, 0)
        check_min("data.seed", self.seed, 0)  # numpy seed sequences take non-negative integers
        if not self.mixture:
            if self.source != LOCAL and self.path:
                raise ConfigError(
                    f"data.path: must be empty with data.source = {self.source!r} (a named hub source), got "
                    f"{self.path!r}"
                )
            spec = resolve_source(
                self.source, path=self.path, config=self.config_name, split=self.split, text_field=self.text_field
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
            specs.append(
                (resolve_source(key, split=self.split, text_field=self.text_field, field="data.mixture"), float(weight))
            )
        total = sum(w for _, w in specs)
        return [(s, w / total) for s, w in specs]


# ---- documents of one source ----------------------------------------------------------------


@dataclass(frozen=True)
class StreamDoc:
    source: str
    id: str  # "<file or shard>:<row>" (a .txt document: its file name)
    text: str
    epoch: int  # the epoch of this loader worker's stream of its source
    meta: str | None = None  # the source's label field (e.g. SlimPajama's redpajama_set_name)


class _SourceStream:
    """One source's documents for loader worker g of G, epoch after epoch, from a restorable position.

    Position (``state()``): epoch, the cursor at the current window's start, window index k, ``next``
    (every kept document before this stream position has been taken), ``rho`` (see ``_keeps``) and
    ``rule``: after a world-size change, which positions of early epochs the previous run consumed.
    """

    def __init__(
        self, spec: SourceSpec, base, *, seed: int, window: int, worker: int, workers: int, tokenizer, state: dict
    ):
        self.spec, self.base, self.seed, self.tokenizer = spec, base, seed, tokenizer
        self.shuffle = window > 0
        self.W = window or UNSHUFFLED_WINDOW
        self.g, self.G = worker, workers
        self.key = _name_key(spec.name)
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
        order = _rng(self.seed, _SHARDS, self.key, epoch).permutation(n).tolist() if self.shuffle else list(range(n))
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
            _rng(self.seed, _WINDOW, self.key, self.epoch, self.k, gtag).permutation(len(rows))
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


# ---- one loader worker: mixture + packing ----------------------------------------------------


class DocumentBatch(NamedTuple):
    tokens: torch.Tensor  # [B, T + 1] int64
    doc_ids: (
        torch.Tensor
    )  # [B, T + 1] int64: index of each token's document within its sequence (EOS ends its document)


class _Worker:
    """The documents and packed sequences of global loader worker g of G.

    ``state()`` is the position before the document being packed (every source's position and the
    mixture's draw count), that document's position and token offset (the next sequence's first token),
    and the target tokens produced per source."""

    def __init__(self, ds: StreamDataset, g: int, G: int, state: dict, *, tokenize: bool = True):
        self.ds, self.g, self.G = ds, g, G
        tok = ds.tokenizer if tokenize else None
        self.streams = [
            _SourceStream(spec, base, seed=ds.seed, window=ds.window, worker=g, workers=G, tokenizer=tok, state=s)
            for spec, base, s in zip(ds.specs, ds.bases, state["streams"])
        ]
        self.weights = np.asarray(ds.weights)
        self.generation, self.draws, self.counts = state["generation"], state["draws"], list(state["tokens"])
        self._block: tuple[int, np.ndarray] | None = None
        self.current, self.pos, self.doc_epoch, self.offset = -1, -1, -1, 0
        self._before = (self.draws, [s.state() for s in self.streams])
        if state["current"] >= 0:  # re-take the document that was being packed
            self._take()
            self.offset = state["token_offset"]

    def state(self) -> dict:
        draws, streams = self._before
        return {
            "format": STATE_FORMAT,
            "worker": self.g,
            "workers": self.G,
            "seed": self.ds.seed,
            "window": self.ds.window,
            "sources": self.ds.source_names,
            "generation": self.generation,
            "draws": draws,
            "streams": streams,
            "current": self.current,
            "pos": self.pos,
            "doc_epoch": self.doc_epoch,
            "token_offset": self.offset,
            "tokens": list(self.counts),
        }

    def _pick(self, d: int) -> int:
        if len(self.streams) == 1:
            return 0
        block = d // MIX_BLOCK
        if self._block is None or self._block[0] != block:
            rng = _rng(self.ds.seed, _MIX, self.generation, self.g, block)
            self._block = (block, rng.choice(len(self.streams), size=MIX_BLOCK, p=self.weights))
        return int(self._block[1][d % MIX_BLOCK])

    def _take(self) -> StreamDoc:
        self._before = (self.draws, [s.state() for s in self.streams])
        src = self._pick(self.draws)
        self.draws += 1
        self.pos, doc, self.doc_tokens = self.streams[src].take()
        self.current, self.doc_epoch, self.offset = src, doc.epoch, 0
        return doc

    def documents(self) -> Iterator[StreamDoc]:
        while True:
            yield self._take()

    def sequence(self, T: int) -> tuple[np.ndarray, np.ndarray]:
        """T + 1 tokens and their document indices; the last token opens the next sequence."""
        need, parts, ids = T + 1, [], []
        while need:
            if self.current < 0 or self.offset >= len(self.doc_tokens):
                self._take()
            piece = self.doc_tokens[self.offset : self.offset + need]
            parts.append(piece)
            ids.append(np.full(len(piece), len(ids), dtype=np.int64))
            self.counts[self.current] += len(piece) - (
                1 if len(ids) == 1 else 0
            )  # targets only: not the shared first token
            self.offset += len(piece)
            need -= len(piece)
        self.offset -= 1
        return np.concatenate(parts), np.concatenate(ids)


# ---- the dataset ------------------------------------------------------------------------------


def _find_states(obj) -> list[dict]:
    """Our per-worker states anywhere inside a loader state (or a list of them), in worker order."""
    found: list[dict] = []

    def walk(x) -> None:
        if isinstance(x, dict):
            if x.get("format") == STATE_FORMAT:
                found.append(x)
                return
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    walk(obj)
    return sorted(found, key=lambda s: s["worker"])


def token_counts(loader_state, source_names: Sequence[str] | None = None) -> dict[str, int]:
    """Target tokens per source summed over the worker states in ``loader_state`` (one rank's, or all ranks')."""
    states = _find_states(loader_state)
    names = list(source_names or (states[0]["sources"] if states else []))
    totals = dict.fromkeys(names, 0)
    for s in states:
        for name, n in zip(s["sources"], s["tokens"]):
            totals[name] = totals.get(name, 0) + int(n)
    return totals


class StreamDataset(torch.utils.data.IterableDataset):
    """Packed sequences ([T + 1] int64, or (tokens, doc_ids) with document masking) of one rank, endless.

    Sources are opened here (early errors; forked loader workers inherit them); each worker reads,
    shuffles, tokenises and packs its share. ``state_dict`` / ``load_state_dict`` are the worker's
    position, which StatefulDataLoader saves per worker. ``resume_from``: the loader states of every
    rank of a run with another ranks x workers count, to re-derive positions (local sources only).
    """

    def __init__(
        self,
        cfg: StreamConfig,
        tokenizer=None,
        *,
        seq_len: int = 0,
        rank: int = 0,
        world_size: int = 1,
        resume_from=None,
    ):
        check_min("world size", world_size, 1)
        if not 0 <= rank < world_size:
            raise ConfigError(f"rank: {rank} is outside [0, world size {world_size})")
        if tokenizer is not None:
            check_min("data.seq_len", seq_len, 1)
        resolved = cfg.sources()
        self.cfg, self.tokenizer, self.seq_len = cfg, tokenizer, seq_len
        self.rank, self.world_size, self.seed, self.window = rank, world_size, cfg.seed, cfg.shuffle_window
        self.specs = [s for s, _ in resolved]
        self.weights = [w for _, w in resolved]
        self.source_names = [s.name for s in self.specs]
        self.bases = [s.open() for s in self.specs]
        self._resume = _find_states(resume_from) if resume_from is not None else None
        if self._resume is not None:
            self._check_resume(self._resume)
        self._pending: dict | None = None
        self._live: _Worker | None = None

    # -- which worker am I
    def _worker(self, worker_id: int | None = None, num_workers: int | None = None) -> tuple[int, int]:
        if worker_id is None:
            info = torch.utils.data.get_worker_info()
            worker_id, num_workers = (info.id, info.num_workers) if info else (0, 1)
        return self.rank * num_workers + worker_id, self.world_size * num_workers

    def _fresh_state(self, g: int, G: int) -> dict:
        return {
            "format": STATE_FORMAT,
            "worker": g,
            "workers": G,
            "seed": self.seed,
            "window": self.window,
            "sources": self.source_names,
            "generation": 0,
            "draws": 0,
            "streams": [_SourceStream.fresh_state() for _ in self.specs],
            "current": -1,
            "pos": -1,
            "doc_epoch": -1,
            "token_offset": 0,
            "tokens": [0] * len(self.specs),
        }

    def _start_state(self, g: int, G: int) -> dict:
        if self._pending is not None:
            return self._pending
        if self._resume is not None:
            return self._derive(g, G)
        return self._fresh_state(g, G)

    # -- checkpointing
    def _check_same_run(self, state: dict) -> None:
        if state["sources"] != self.source_names:
            key = "data.mixture" if len(self.source_names) > 1 else "data.source"
            raise ConfigError(
                f"{key}: the checkpoint streamed {', '.join(state['sources'])}, this run {', '.join(self.source_names)}"
            )
        if state["seed"] != self.seed or state["window"] != self.window:
            raise ConfigError(
                f"data.seed: the checkpoint's stream used seed {state['seed']} and shuffle window {state['window']}, "
                f"this run {self.seed} and {self.window}"
            )

    def check_loader_state(self, loader_state: dict, num_workers: int) -> None:
        """One-line errors for a loader state this rank cannot load (StatefulDataLoader only asserts)."""
        states = _find_states(loader_state)
        G = self.world_size * max(num_workers, 1)
        want = [self.rank * max(num_workers, 1) + w for w in range(max(num_workers, 1))]
        if not states:
            raise ConfigError("data: the checkpoint holds no streaming loader state")
        if states[0]["workers"] != G or [s["worker"] for s in states] != want:
            raise ConfigError(
                f"data: the checkpoint's loader state is for loader workers {[s['worker'] for s in states]} of "
                f"{states[0]['workers']}, "
                f"this rank runs {want} of {G} (ranks x workers); pass every rank's loader state as resume_from to "
                "re-derive positions"
            )
        for s in states:
            self._check_same_run(s)

    def state_dict(self) -> dict:
        if self._live is not None:
            return self._live.state()
        return self._start_state(*self._worker())

    def load_state_dict(self, state: dict) -> None:
        g, G = self._worker()
        if state.get("format") != STATE_FORMAT:
            raise ConfigError(
                f"data: not a streaming loader state (format {state.get('format')!r}, expected {STATE_FORMAT!r})"
            )
        if (state["worker"], state["workers"]) != (g, G):
            raise ConfigError(
                f"data: the state is for loader worker {state['worker']} of {state['workers']}, this is worker {g} of "
                f"{G}"
            )
        self._check_same_run(state)
        self._pending, self._live = state, None

    # -- world-size changes
    def _check_resume(self, states: list[dict]) -> None:
        if not states:
            raise ConfigError("data: resume_from holds no streaming loader state")
        G_old = states[0]["workers"]
        if [s["worker"] for s in states] != list(range(G_old)):
            raise ConfigError(
                f"data: resume_from holds the states of loader workers {[s['worker'] for s in states]} of {G_old}; "
                "pass every rank's loader state"
            )
        for s in states:
            self._check_same_run(s)

    def check_resume(self, num_workers: int) -> None:
        """Raise the one-line error of an impossible ``resume_from`` now, in the main process, not in a worker."""
        if self._resume is not None:
            for w in range(max(num_workers, 1)):
                self._derive(*self._worker(w, max(num_workers, 1)))

    def _derive(self, g: int, G: int) -> dict:
        old = self._resume
        G_old = old[0]["workers"]
        if G_old == G:  # same global worker count (e.g. 2 ranks x 2 workers -> 4 x 1): positions carry over exactly
            return old[g]
        for spec in self.specs:
            if spec.kind != LOCAL:
                raise ConfigError(
                    f"data: source {spec.name!r} streams from the hub, whose position cannot be re-derived on another "
                    "world size; "
                    f"resume with ranks x loader workers = {G_old}"
                )
        if any(s["rule"] is not None for st in old for s in st["streams"]):
            raise ConfigError(
                "data: the world size changed again before the epoch of the previous change ended; resume with ranks "
                f"x loader workers = {G_old}"
            )
        state = self._fresh_state(g, G)
        state["generation"] = max(s["generation"] for s in old) + 1
        state["streams"] = [self._residual(i, old) for i in range(len(self.specs))]
        if g == 0:  # the run's counts live on, once
            state["tokens"] = [sum(s["tokens"][i] for s in old) for i in range(len(self.specs))]
        return state

    def _residual(self, src: int, old: list[dict]) -> dict:
        """Source ``src``'s start after a world-size change: old worker h consumed the positions = h (mod G_old)
        below its limit in its epoch, all in earlier ones (the document being packed counts as consumed)."""
        entries = []  # (epoch, limit, cursor of a window start at or before the limit, that window)
        for st in old:
            s = st["streams"][src]
            entry = (s["epoch"], s["next"], s["cursor"], s["window"])
            if st["current"] == src:
                entry = (s["epoch"], st["pos"] + 1, s["cursor"], s["window"])
                if st["doc_epoch"] != s["epoch"]:  # taking that document crossed into the next epoch
                    entry = (st["doc_epoch"], st["pos"] + 1, [0, None, 0, 0], 0)
            entries.append(entry)
        first, last = min(e[0] for e in entries), max(e[0] for e in entries)
        limits = [
            [None if e > epoch else (limit if e == epoch else 0) for e, limit, _, _ in entries]
            for epoch in range(first, last + 1)
        ]
        _, _, cursor, window = min((e for e in entries if e[0] == first), key=lambda e: e[1])
        W = self.window or UNSHUFFLED_WINDOW
        rule = {"workers": len(old), "first": first, "limits": limits}
        # every position before the earliest limit is consumed, so counting resumes from that worker's window
        return {"epoch": first, "cursor": cursor, "window": window, "next": window * W, "rho": 0, "rule": rule}

    # -- iteration
    def _begin(self, worker_id: int | None, num_workers: int | None, *, tokenize: bool) -> _Worker:
        g, G = self._worker(worker_id, num_workers)
        if torch.utils.data.get_worker_info() is not None:
            import fsspec.asyn

            fsspec.asyn.reset_lock()  # a forked worker must not reuse the parent's fsspec event loop (hub streaming)
        return _Worker(self, g, G, self._start_state(g, G), tokenize=tokenize)

    def documents(self, worker_id: int | None = None, num_workers: int | None = None) -> Iterator[StreamDoc]:
        """The documents, in packing order, of loader worker ``worker_id`` of ``num_workers`` on this rank, endless."""
        yield from self._begin(worker_id, num_workers, tokenize=False).documents()

    def sequences(
        self, worker_id: int | None = None, num_workers: int | None = None
    ) -> Iterator[torch.Tensor | DocumentBatch]:
        if self.tokenizer is None:
            raise ConfigError("data.tokenizer: packing sequences needs a tokenizer")
        self._live = self._begin(worker_id, num_workers, tokenize=True)
        self._pending = None
        live = self._live
        while True:
            tokens, ids = live.sequence(self.seq_len)
            if self.cfg.document_masking:
                yield DocumentBatch(torch.from_numpy(tokens), torch.from_numpy(ids))
            else:
                yield torch.from_numpy(tokens)

    def __iter__(self):
        return self.sequences()

    def token_counts(self) -> dict[str, int]:
        """Target tokens per source produced by this process's iterator.

        With loader workers, StreamLoader.token_counts."""
        return token_counts(self.state_dict(), self.source_names)


# ---- loader -----------------------------------------------------------------------------------


class StreamLoader(StatefulDataLoader):
    """StatefulDataLoader over a StreamDataset: ``state_dict()`` (per-worker positions) is what a checkpoint saves."""

    def token_counts(self) -> dict[str, int]:
        """Target tokens per source this rank has yielded, as of the last batch."""
        return token_counts(self.state_dict(), self.dataset.source_names)

    def load_state_dict(self, state_dict: dict) -> None:
        self.dataset.check_loader_state(state_dict, self.num_workers)
        super().load_state_dict(state_dict)


def build_stream_loader(
    cfg: StreamConfig,
    tokenizer,
    *,
    seq_len: int,
    batch_size: int,
    rank: int = 0,
    world_size: int = 1,
    num_workers: int | None = None,
    seed: int | None = None,
    resume_from=None,
) -> StreamLoader:
    """Batches [batch_size, seq_len + 1] int64 (DocumentBatch with cfg.document_masking) for one rank.

    ``num_workers`` / ``seed`` override the config's. ``resume_from``: every rank's loader state of a run
    with another ranks x workers count (a same-count run loads its own state with ``load_state_dict``)."""
    check_min("train.batch_size", batch_size, 1)
    cfg = replace(
        cfg,
        num_workers=cfg.num_workers if num_workers is None else num_workers,
        seed=cfg.seed if seed is None else seed,
    )
    ds = StreamDataset(cfg, tokenizer, seq_len=seq_len, rank=rank, world_size=world_size, resume_from=resume_from)
    ds.check_resume(cfg.num_workers)
    return StreamLoader(ds, batch_size=batch_size, num_workers=cfg.num_workers)
