"""Deterministic, resumable batches: the global batch of step s is fixed by (seed, s) alone.

Sequence g of the run (g = 0, 1, ...) is element ``g % N`` of epoch ``g // N``'s
permutation of the N sequences, seeded by (seed, epoch). Step s takes the global
sequences [s*B, (s+1)*B); rank r takes its contiguous share, split into
micro-batches. So any world size and micro-batch size see the same global batch,
and the whole loader state is the number of sequences consumed.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np
import torch

from core.errors import ConfigError

if TYPE_CHECKING:
    from data.packing import PackedDataset
    from data.shards import PreparedDataset
    from data.stream_config import StreamConfig
    from data.tokenizer import Tokenizer


def epoch_permutation(n: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.Generator(np.random.PCG64([seed, epoch])).permutation(n)


class BatchLoader:
    def __init__(
        self,
        dataset: PackedDataset | PreparedDataset,
        *,
        batch_size: int,
        micro_batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
    ):
        accum_steps = check_batch_layout(batch_size, micro_batch_size, world_size)
        if seed < 0:  # numpy's seed sequences take non-negative integers only
            raise ConfigError(f"train.seed: must be >= 0, got {seed}")
        if not 0 <= rank < world_size:
            raise ConfigError(f"rank: {rank} is outside [0, world size {world_size})")
        if len(dataset) == 0:
            raise ConfigError(
                "data.seq_len: the training split holds no complete sequence; lower data.seq_len or add data"
            )
        self.dataset = dataset
        self.batch_size, self.micro_batch_size = batch_size, micro_batch_size
        self.rank, self.world_size = rank, world_size
        self.seed, self.shuffle = seed, shuffle
        self.accum_steps = accum_steps
        self.consumed = 0  # global sequences handed out so far
        self._perm: tuple[int, np.ndarray] | None = None

    def _index(self, g: int) -> int:
        n = len(self.dataset)
        epoch, pos = divmod(g, n)
        if not self.shuffle:
            return pos
        if self._perm is None or self._perm[0] != epoch:
            self._perm = (epoch, epoch_permutation(n, self.seed, epoch))
        return int(self._perm[1][pos])

    def next_step(self) -> list[torch.Tensor]:
        """This rank's micro-batches for one optimizer step: ``accum_steps`` tensors [micro, seq_len + 1]."""
        per_rank = self.batch_size // self.world_size
        start = self.consumed + self.rank * per_rank
        indices = [self._index(g) for g in range(start, start + per_rank)]
        self.consumed += self.batch_size
        m = self.micro_batch_size
        return [self.dataset.batch(indices[i : i + m]) for i in range(0, per_rank, m)]

    def token_counts(self) -> dict[str, int]:
        return {}

    def state_dict(self) -> dict:
        return {
            "kind": "index",
            "consumed": self.consumed,
            "seed": self.seed,
            "num_sequences": len(self.dataset),
            "shuffle": int(self.shuffle),
        }

    def load_state_dict(self, state: dict | list[dict]) -> None:
        """A state, or every rank's (checkpoints hold one per rank; for this loader they agree)."""
        state = state[0] if isinstance(state, list) else state
        if state.get("kind", "index") != "index":
            raise ConfigError(
                "data.source: the checkpoint was written by a streamed run; resume it with the same data settings"
            )
        if state["num_sequences"] != len(self.dataset):
            raise ConfigError(
                f"data.seq_len: the training split has {len(self.dataset)} sequences but the checkpoint's loader had "
                f"{state['num_sequences']}; the data or data.seq_len changed"
            )
        if state["seed"] != self.seed or bool(state["shuffle"]) != self.shuffle:
            raise ConfigError(
                f"train.seed: the checkpoint's data order used seed {state['seed']}, this run {self.seed}"
            )
        self.consumed = int(state["consumed"])


def check_batch_layout(batch_size: int, micro_batch_size: int, world_size: int) -> int:
    """Accumulation steps per optimizer step; one-line errors for a layout that does not divide."""
    for name, value in (
        ("train.batch_size", batch_size),
        ("train.micro_batch_size", micro_batch_size),
        ("world size", world_size),
    ):
        if value < 1:
            raise ConfigError(f"{name}: must be >= 1, got {value}")
    if batch_size % (micro_batch_size * world_size):
        raise ConfigError(
            f"train.batch_size: {batch_size} is not divisible by train.micro_batch_size ({micro_batch_size}) x world "
            f"size ({world_size})"
        )
    return batch_size // (micro_batch_size * world_size)


class StreamBatchLoader:
    """The BatchLoader surface over a stream (data.streaming): each rank draws ``micro_batch_size``
    sequences per forward from its own StatefulDataLoader (tokenising in its workers). The state is
    per rank (every worker's position); a checkpoint holds all ranks', so a run resumes exactly on
    the same world size and, for local sources, re-derives positions on another one."""

    def __init__(
        self,
        stream: StreamConfig,
        tokenizer: Tokenizer,
        *,
        seq_len: int,
        batch_size: int,
        micro_batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
    ):
        self.accum_steps = check_batch_layout(batch_size, micro_batch_size, world_size)
        self.stream, self.tokenizer, self.seq_len = stream, tokenizer, seq_len
        self.batch_size, self.micro_batch_size, self.rank, self.world_size, self.seed = (
            batch_size,
            micro_batch_size,
            rank,
            world_size,
            seed,
        )
        self._build(None)

    def _build(self, resume_from: list[dict] | None) -> None:
        from data.streaming import build_stream_loader

        self.loader = build_stream_loader(
            self.stream,
            self.tokenizer,
            seq_len=self.seq_len,
            batch_size=self.micro_batch_size,
            rank=self.rank,
            world_size=self.world_size,
            seed=self.seed,
            resume_from=resume_from,
        )
        self._it: Iterator[torch.Tensor] | None = None

    def next_step(self) -> list[torch.Tensor]:
        if self._it is None:
            self._it = iter(self.loader)
        return [next(self._it) for _ in range(self.accum_steps)]

    def token_counts(self) -> dict[str, int]:
        """Target tokens per source drawn by this rank so far."""
        return self.loader.token_counts()

    def state_dict(self) -> dict:
        return {"kind": "stream", "world_size": self.world_size, "state": self.loader.state_dict()}

    def load_state_dict(self, states: dict | list[dict]) -> None:
        states = states if isinstance(states, list) else [states]
        if any(s.get("kind") != "stream" for s in states):
            raise ConfigError(
                "data.source: the checkpoint was written by an indexable (non-streamed) run; resume it with the same "
                "data settings"
            )
        if len(states) == self.world_size:
            self.loader.load_state_dict(states[self.rank]["state"])
            self._it = None
        else:  # another world size: local sources re-derive every worker's position (hub sources refuse)
            self._build([s["state"] for s in states])


def eval_batches(
    dataset: PackedDataset | PreparedDataset, *, batch_size: int, max_batches: int, rank: int = 0, world_size: int = 1
) -> Iterator[torch.Tensor]:
    """A fixed validation set: the first ``batch_size * world_size * max_batches`` sequences in
    order (a multiple of the world size), each global batch split into equal contiguous
    per-rank shares. With ``batch_size`` = the per-rank micro-batch the set does not depend on
    the world size, and every rank runs the same number of forwards (sharded engines need that)."""
    n = min(len(dataset), batch_size * world_size * max_batches)
    n -= n % world_size
    if n == 0:
        raise ConfigError(
            f"data.val_fraction: the validation split has {len(dataset)} sequences, fewer than the {world_size} ranks"
        )
    step = batch_size * world_size
    for start in range(0, n, step):
        share = (min(start + step, n) - start) // world_size
        lo = start + rank * share
        yield dataset.batch(range(lo, lo + share))
