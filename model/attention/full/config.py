"""Options of ``full`` (``[model.attention.full]``): which kernel runs the fast path."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from core.errors import check_choice, missing_extra
from model.attention.common.base import VariantConfig

BACKENDS = ("auto", "sdpa", "flash_attn")
HAS_FLASH_ATTN = importlib.util.find_spec("flash_attn") is not None


@dataclass
class FullConfig(VariantConfig):
    # auto: flash_attn when installed and usable (CUDA, 16-bit, no cache), else SDPA
    backend: str = "auto"

    def validate(self, prefix: str) -> None:
        check_choice(prefix + "backend", self.backend, BACKENDS)
        if self.backend == "flash_attn" and not HAS_FLASH_ATTN:
            raise missing_extra("flash_attn", f"{prefix}backend = flash_attn")
