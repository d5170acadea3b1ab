"""Issue 26: a 4-layer tiny Lazy model and a Focus soft model train at long context on CPU through their blockwise
paths. At T = 2048 three optimiser steps give the dense reference path's losses (within 1e-4 relative); at T = 8192
twenty steps through the blockwise path give finite, falling losses (the ``long_context`` tier: ``pytest
--long-context``). Prints each run's peak RSS growth."""

from __future__ import annotations

import resource
import time

import pytest
import torch

from bench.memory import PeakMemory
from model.attention.common.flex import flex_supports
from model.config import ModelConfig
from model.transformer import Transformer

VOCAB = 64


def tiny(kind: str, seq_len: int, impl: str = "auto") -> Transformer:
    cfg = ModelConfig(vocab_size=VOCAB, max_seq_len=seq_len, d_model=32, n_layers=4, n_heads=2, n_kv_heads=2)
    cfg.attention.kind = kind
    cfg.attention.impl = impl
    torch.manual_seed(0)
    return Transformer(cfg).float()


def batch(seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A periodic token stream (period 23, shuffled symbols): learnable, so the loss falls within a few steps."""
    g = torch.Generator().manual_seed(0)
    symbols = torch.randperm(VOCAB, generator=g)[:23]
    tokens = symbols[torch.arange(seq_len + 1) % 23][None]
    return tokens[:, :-1], tokens[:, 1:]


def train(model: Transformer, seq_len: int, steps: int) -> tuple[list[float], int | None]:
    idx, targets = batch(seq_len)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    with PeakMemory("cpu") as mem:
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            out = model(idx, targets=targets, return_logits=False)
            assert out.loss_sum is not None
            loss = out.loss_sum / out.n_tokens + (0.0 if out.aux_loss is None else out.aux_loss)
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
    return losses, mem.peak


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["lazy", "focus"])
def test_four_layer_model_gives_the_reference_losses_at_2048(kind: str) -> None:
    """Three AdamW steps at T = 2048 through the blockwise path and through the dense reference: equal losses."""
    start = time.perf_counter()
    model = tiny(kind, 2048)
    core = model.blocks[0].attn.core
    q = torch.empty(1, 2, 2048, 16)
    # the comparison is only worth something if "auto" takes the CPU blockwise path, not the reference again
    assert core.has_fast_path(q, None) and not flex_supports(q), kind
    fast, peak = train(model, 2048, 3)
    ref, _ = train(tiny(kind, 2048, impl="reference"), 2048, 3)
    for step, (a, b) in enumerate(zip(fast, ref)):
        assert abs(a - b) <= 1e-4 * abs(b), f"step {step}: blockwise {a} vs reference {b}"
    mib = -1.0 if peak is None else peak / 2**20
    print(f"{kind}: T=2048 blockwise peak RSS growth {mib:.0f} MiB, wall {time.perf_counter() - start:.1f} s")


# 1-3 min each on 2 cores (a third of the suite's budget for two runs): the long_context tier (--long-context).
# What CI needs of these paths it checks cheaper: the blockwise paths equal the dense reference at 2048 through
# three AdamW steps (above), and no temporary grows with T^2 (lazy/test_cpu.py::test_no_tensor_grows_with_t_squared,
# focus/test_soft.py::test_block_rows_bound_the_block_temporaries).
@pytest.mark.long_context
@pytest.mark.parametrize("kind", ["lazy", "focus"])
def test_four_layer_model_trains_20_steps_at_8192(kind: str) -> None:
    start = time.perf_counter()
    losses, peak = train(tiny(kind, 8192), 8192, 20)
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert losses[-1] < 0.8 * losses[0] and min(losses[-5:]) < min(losses[:5]), losses
    mib = -1.0 if peak is None else peak / 2**20
    print(f"{kind}: T=8192 20 steps, peak RSS growth {mib:.0f} MiB, losses {losses[0]:.3f} -> {losses[-1]:.3f}")
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # KiB on Linux: the process's peak so far
    print(f"{kind}: wall {time.perf_counter() - start:.1f} s, process peak RSS {rss:.0f} MiB")
