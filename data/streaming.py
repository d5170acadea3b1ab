"""Streaming training data: hub or local documents -> split by rank and loader worker -> seeded window
shuffle -> weighted mixture -> tokenised and packed inside the loader workers, restorable exactly.

The pieces: ``data.stream_sources`` (hub repos, their local mirrors and local files, read through datasets),
``data.source_stream`` (one source for one loader worker: sharding, shuffle windows, epochs),
``data.mixture`` (the mixture weighting and the packing; a worker's state), ``data.stream_resume``
(checkpoint states, token counts, world-size changes) and, here, the dataset and loader over them.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from core.errors import ConfigError, check_min
from data.mixture import STATE_FORMAT, DocumentBatch, DocumentMixer, TokenMixer, fresh_state, make_mixer
from data.source_stream import StreamDoc
from data.stream_config import StreamConfig
from data.stream_resume import (
    check_resume_states,
    check_same_run,
    derive_state,
    find_states,
    token_counts,
)
from data.stream_sources import HUB_SOURCES, HubSource, SourceSpec
from model.documents import document_mask, document_positions  # re-exported: the streams' doc ids feed them

if TYPE_CHECKING:
    from data.tokenizer import Tokenizer

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
        tokenizer: Tokenizer | None = None,
        *,
        seq_len: int = 0,
        rank: int = 0,
        world_size: int = 1,
        resume_from: object = None,
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
        self.weighting = cfg.weighting
        self.source_names = [s.name for s in self.specs]
        self.bases = [s.open() for s in self.specs]
        self._resume = find_states(resume_from) if resume_from is not None else None
        if self._resume is not None:
            check_resume_states(self._resume)
            for s in self._resume:
                self._check_same_run(s)
        self._pending: dict | None = None
        self._live: DocumentMixer | TokenMixer | None = None

    # -- which worker am I
    def _worker(self, worker_id: int | None = None, num_workers: int | None = None) -> tuple[int, int]:
        if worker_id is None:
            info = torch.utils.data.get_worker_info()
            worker_id, num_workers = (info.id, info.num_workers) if info else (0, 1)
        assert num_workers is not None  # given with worker_id
        return self.rank * num_workers + worker_id, self.world_size * num_workers

    def _fresh_state(self, g: int, G: int) -> dict:
        return fresh_state(self.weighting, g=g, G=G, seed=self.seed, window=self.window, sources=self.source_names)

    def _start_state(self, g: int, G: int) -> dict:
        if self._pending is not None:
            return self._pending
        if self._resume is not None:
            return derive_state(self, self._resume, g, G)
        return self._fresh_state(g, G)

    # -- checkpointing
    def _check_same_run(self, state: dict) -> None:
        check_same_run(state, sources=self.source_names, seed=self.seed, window=self.window, weighting=self.weighting)

    def check_loader_state(self, loader_state: dict, num_workers: int) -> None:
        """One-line errors for a loader state this rank cannot load (StatefulDataLoader only asserts)."""
        states = find_states(loader_state)
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
    def check_resume(self, num_workers: int) -> None:
        """Raise the one-line error of an impossible ``resume_from`` now, in the main process, not in a worker."""
        if self._resume is not None:
            for w in range(max(num_workers, 1)):
                derive_state(self, self._resume, *self._worker(w, max(num_workers, 1)))

    # -- iteration
    def _begin(self, worker_id: int | None, num_workers: int | None, *, tokenize: bool) -> DocumentMixer | TokenMixer:
        g, G = self._worker(worker_id, num_workers)
        if torch.utils.data.get_worker_info() is not None:
            import fsspec.asyn

            fsspec.asyn.reset_lock()  # a forked worker must not reuse the parent's fsspec event loop (hub streaming)
        return make_mixer(self, g, G, self._start_state(g, G), tokenize=tokenize)

    def documents(self, worker_id: int | None = None, num_workers: int | None = None) -> Iterator[StreamDoc]:
        """The documents, in packing order, of loader worker ``worker_id`` of ``num_workers`` on this rank, endless.

        Under token weighting the order depends on document sizes: tokens with a tokenizer, else UTF-8 bytes."""
        yield from self._begin(worker_id, num_workers, tokenize=self.weighting == "tokens").documents()

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

    def __iter__(self) -> Iterator[torch.Tensor | DocumentBatch]:
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
    tokenizer: Tokenizer | None,
    *,
    seq_len: int,
    batch_size: int,
    rank: int = 0,
    world_size: int = 1,
    num_workers: int | None = None,
    seed: int | None = None,
    resume_from: object = None,
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
