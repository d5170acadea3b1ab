"""Per-block training options: activation checkpointing (none / selective / full) and
torch.compile per block. Both must leave the loss and the gradients as they were; checkpointing
must change what is recomputed in backward, which is what the tests count."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from model.config import ModelConfig
from model.transformer import Transformer
from pretrain.engines import build_engine
from run.config import TrainConfig

CFG = dict(vocab_size=64, max_seq_len=32, d_model=32, n_layers=2, n_heads=4)


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def _run(mode: str, batch: torch.Tensor, dtype=torch.float64):
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**CFG, dropout=0.1)).to(dtype)  # dropout: recompute must replay the RNG
    model.activation_checkpointing = mode
    torch.manual_seed(1)
    out = model(batch[:, :-1], targets=batch[:, 1:])
    counter = OpCounter()
    with counter:
        out.loss_sum.backward()
    return out.loss_sum.detach(), {n: p.grad for n, p in model.named_parameters()}, counter.counts


def test_checkpointing_modes_give_the_same_loss_and_gradients_and_recompute_what_they_should():
    batch = torch.randint(0, 64, (2, 25), generator=torch.Generator().manual_seed(3))
    runs = {mode: _run(mode, batch) for mode in ("none", "selective", "full")}
    loss0, grads0, ops0 = runs["none"]
    for mode in ("selective", "full"):
        loss, grads, _ = runs[mode]
        assert torch.equal(loss, loss0), mode
        for name, g in grads.items():
            torch.testing.assert_close(g, grads0[name], rtol=0, atol=1e-12, msg=f"{mode}: {name}")
    matmuls = {mode: sum(c.get(op, 0) for op in ("mm", "addmm", "bmm")) for mode, (_, _, c) in runs.items()}
    # full replays each block's forward matmuls in backward; selective keeps their outputs
    assert matmuls["full"] > matmuls["none"] and matmuls["selective"] == matmuls["none"], matmuls
    # ...but recomputes the cheap ops (norm, activation, rope): more elementwise work than none
    cheap = {mode: sum(c.get(op, 0) for op in ("mul", "rsqrt", "silu", "add")) for mode, (_, _, c) in runs.items()}
    assert cheap["selective"] > cheap["none"], cheap


def test_checkpointing_is_off_for_evaluation_and_cached_decoding(monkeypatch):
    import model.transformer as transformer

    calls = []
    real = transformer.checkpointed
    monkeypatch.setattr(transformer, "checkpointed", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    model = Transformer(ModelConfig(**CFG))
    model.activation_checkpointing = "full"
    batch = torch.randint(0, 64, (1, 9))
    model(batch)
    assert calls == ["full", "full"], "a training forward recomputes each block"
    calls.clear()
    model.eval()
    with torch.no_grad():
        model(batch)
    assert model.generate(batch[:, :5], 4).shape == (1, 9)
    assert calls == [], "evaluation and cached decoding keep no graph to recompute"


def test_bad_mode_is_a_one_line_error():
    from core.errors import ConfigError

    with pytest.raises(ConfigError, match="train.activation_checkpointing"):
        TrainConfig(activation_checkpointing="some").validate()
    cfg = TrainConfig()
    cfg.options("fsdp2").replicate = 2
    with pytest.raises(ConfigError, match="train.fsdp2.replicate: set, but train.engine = 'single'"):
        cfg.validate()


@pytest.mark.slow
def test_compile_per_block_trains_like_eager_and_keeps_parameter_names():
    batch = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(1))
    losses, names = {}, {}
    for compiled in (False, True):
        torch.manual_seed(0)
        model = Transformer(ModelConfig(**CFG))
        eng = build_engine(
            model,
            TrainConfig(
                precision="fp32",
                lr=1e-2,
                warmup_steps=0,
                max_steps=10,
                compile=compiled,
                activation_checkpointing="selective",
            ),
            torch.device("cpu"),
        )
        names[compiled] = list(model.state_dict())
        losses[compiled] = []
        for _ in range(3):
            out = eng.micro_step(batch[:, :-1], batch[:, 1:], loss_scale=1 / 64, aux_scale=1.0, sync=True)
            eng.optimizer_step(1.0)
            losses[compiled].append(float(out.loss_sum))
    assert names[True] == names[False], "in-place compile: checkpoints stay engine- and compile-independent"
    assert losses[True] == pytest.approx(losses[False], rel=1e-5)
