"""The trainer's own part of a checkpoint (``trainer.pt``), typed.

Model and optimizer state belong to the engine; everything else a resume needs is here. Stored as
plain Python values and tensors, so ``torch.load(weights_only=True)`` reads it. Older layouts are
upgraded in ``from_state_dict`` (the one place that knows them), so old checkpoints still resume.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from run.checkpoint import TRAINER_STATE_FORMAT, NewerFormat

FORMAT = TRAINER_STATE_FORMAT  # 1: the plain dict written before this class (no "format" key); 2: this class


@dataclass
class TrainState:
    step: int = 0  # optimizer steps taken
    tokens: int = 0  # target tokens consumed, all ranks
    rng: list[dict[str, Any]] = field(default_factory=list)  # core.rng state, one per rank
    world_size: int = 1
    loader: list[Any] = field(default_factory=list)  # data loader state, one per rank (a stream's differ)
    data_fingerprint: str = ""
    tokenizer_fingerprint: str = ""
    config: str = ""  # the resolved run config, TOML
    code_version: str = "unknown"

    def state_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, **dataclasses.asdict(self)}

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> TrainState:
        state = dict(state)
        version = state.pop("format", 1)
        if version > FORMAT:
            raise NewerFormat(f"trainer.pt: format {version} is newer than this code reads ({FORMAT}); update the code")
        # format 1, as first written by single-process runs: one RNG state and one loader state
        if not isinstance(state.get("rng"), list):
            state["rng"] = [state["rng"]] if "rng" in state else []
        if not isinstance(state.get("loader"), list):
            state["loader"] = [state["loader"]] if "loader" in state else []
        state.setdefault("world_size", len(state["rng"]) or 1)
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in state.items() if k in known})

    def rng_for(self, rank: int, world_size: int) -> dict[str, Any]:
        """Same world size: each rank its own generators; resharded: every rank takes rank 0's."""
        return self.rng[rank] if len(self.rng) == world_size else self.rng[0]
