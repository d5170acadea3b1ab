"""Loss and perplexity against context length: the check for long-context work (RoPE scaling,
raised bases, length extrapolation of Lazy / Focal).

Every length is scored on the same leading tokens of a held-out stream, cut into
non-overlapping windows of that length, so the figures differ only in how much context each
prediction had.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from eval.perplexity import mean_loss, perplexity

if TYPE_CHECKING:
    from data.shards import TokenStream
    from model.transformer import Transformer


def loss_by_length(
    model: Transformer,
    tokens: np.ndarray | TokenStream,
    lengths: list[int],
    *,
    max_tokens: int,
    device: torch.device,
    batch_size: int = 4,
) -> dict[int, dict]:
    """{length: {loss, perplexity, tokens, windows}} over the first ``max_tokens`` + 1 tokens."""
    results: dict[int, dict] = {}
    budget = min(max_tokens, len(tokens) - 1)
    for length in lengths:
        windows = budget // length
        if windows == 0:
            results[length] = {"skipped": f"fewer than {length + 1} held-out tokens"}
            continue
        if model.pos_emb is not None and length > model.cfg.max_seq_len:
            results[length] = {"skipped": f"learned positions stop at model.max_seq_len={model.cfg.max_seq_len}"}
            continue
        seqs = [torch.from_numpy(tokens[i * length : i * length + length + 1].astype(np.int64)) for i in range(windows)]
        batches = (torch.stack(seqs[i : i + batch_size]) for i in range(0, windows, batch_size))
        loss, n = mean_loss(model, batches, device=device)
        results[length] = {"loss": loss, "perplexity": perplexity(loss), "tokens": n, "windows": windows}
    return results
