"""``single``: one process, one device."""

from __future__ import annotations

from pathlib import Path

import torch

from pretrain.checkpoint import MODEL_FILE, load_weights
from pretrain.engines.base import Engine
from run.safe_load import torch_load


class SingleEngine(Engine):
    """One process, one device. Model weights as safetensors, optimizer + schedule as a torch file."""

    name = "single"

    def write_state(self, directory: Path) -> None:
        from safetensors.torch import save_model

        save_model(self.raw_model, str(directory / MODEL_FILE))
        torch.save(
            {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()},
            directory / "optimizer.pt",
        )

    def read_state(self, directory: Path) -> None:
        load_weights(self.raw_model, directory, device=self.device)
        state = torch_load(directory / "optimizer.pt", map_location=self.device)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
