"""The training loop's hook vocabulary (``pretrain.callbacks`` explains it): the base class every callback extends."""

from __future__ import annotations

from pathlib import Path
from typing import Any

# pretrain.loop.Trainer, which imports this module (the layering contract forbids the cycle even for types)
Trainer = Any


class Callback:
    """Every hook is optional; the defaults do nothing."""

    def pre_train(self, trainer: Trainer) -> None:
        pass

    def pre_step(self, trainer: Trainer) -> None:
        pass

    def post_step(self, trainer: Trainer, record: dict[str, Any]) -> None:
        pass

    def post_checkpoint(self, trainer: Trainer, path: Path) -> None:
        pass

    def post_train(self, trainer: Trainer) -> None:
        pass
