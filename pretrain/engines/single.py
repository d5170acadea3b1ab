"""``single``: one process, one device."""

from __future__ import annotations

from pathlib import Path

import torch

from core.files import plain_mode
from pretrain.checkpoint import MODEL_FILE, load_weights
from pretrain.engines.base import Engine
from pretrain.engines.parallel import DCP_DIR, read_dcp_state
from run.safe_load import torch_load

OPTIMIZER_FILE = "optimizer.pt"


class SingleEngine(Engine):
    """One process, one device. Model weights as safetensors, optimizer + schedule as a torch file; it also resumes a
    ddp / fsdp2 (DCP) checkpoint."""

    name = "single"

    def write_state(self, directory: Path) -> None:
        from safetensors.torch import save_model

        save_model(self.raw_model, str(directory / MODEL_FILE))
        plain_mode(directory / MODEL_FILE)
        torch.save(
            {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()},
            directory / OPTIMIZER_FILE,
        )

    def read_state(self, directory: Path) -> None:
        if not (directory / OPTIMIZER_FILE).is_file() and (directory / DCP_DIR).is_dir():
            # written by ddp / fsdp2 (any data, tensor or context parallel layout): DCP reads it onto one process
            read_dcp_state(self.raw_model, self.optimizer, self.scheduler, directory, no_dist=True)
            return
        load_weights(self.raw_model, directory, device=self.device)
        state = torch_load(directory / OPTIMIZER_FILE, map_location=self.device)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
