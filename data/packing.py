"""Documents -> one flat token stream with EOS after every document -> fixed-length windows."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from data.tokenizer import Tokenizer


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= np.iinfo(np.uint16).max + 1 else np.dtype(np.uint32)


def pack_documents(texts: Iterable[str], tokenizer: Tokenizer, *, chunk: int = 256) -> np.ndarray:
    """Tokenise ``texts`` (in batches of ``chunk`` documents) and concatenate, EOS after each."""
    dtype = token_dtype(tokenizer.vocab_size)
    parts: list[np.ndarray] = []
    batch: list[str] = []

    def flush() -> None:
        for ids in tokenizer.encode_batch(batch):
            parts.append(np.asarray([*ids, tokenizer.eos_id], dtype=dtype))
        batch.clear()

    for text in texts:
        batch.append(text)
        if len(batch) == chunk:
            flush()
    if batch:
        flush()
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)


class PackedDataset:
    """Sequence i is ``tokens[i*T : i*T + T + 1]``: inputs ``x[:-1]``, targets ``x[1:]``.

    Consecutive windows share one token, so every token is a target exactly once.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int):
        self.tokens = tokens
        self.seq_len = seq_len

    def __len__(self) -> int:
        return max(0, (len(self.tokens) - 1) // self.seq_len)

    def __getitem__(self, i: int) -> torch.Tensor:
        if not 0 <= i < len(self):
            raise IndexError(f"sequence {i} out of range [0, {len(self)})")
        start = i * self.seq_len
        return torch.from_numpy(self.tokens[start : start + self.seq_len + 1].astype(np.int64))

    def batch(self, indices: Sequence[int]) -> torch.Tensor:
        return torch.stack([self[int(i)] for i in indices])
