from __future__ import annotations

import math

import pytest
import torch

from model.transformer import Transformer
from pretrain.optim import build_optimizer, build_scheduler, lr_multiplier, param_groups
from run.config import TrainConfig
from tests.conftest import small_model_config


def test_cosine_with_warmup_and_floor_by_hand():
    cfg = TrainConfig(max_steps=110, warmup_steps=10, min_lr_ratio=0.1, schedule="cosine")
    assert lr_multiplier(0, cfg) == pytest.approx(0.1)
    assert lr_multiplier(9, cfg) == pytest.approx(1.0)
    assert lr_multiplier(10, cfg) == pytest.approx(1.0)
    assert lr_multiplier(60, cfg) == pytest.approx(0.1 + 0.9 * 0.5)  # halfway through the cosine
    assert lr_multiplier(110, cfg) == pytest.approx(0.1)
    assert lr_multiplier(500, cfg) == pytest.approx(0.1)  # past the end: the floor


def test_linear_constant_and_wsd():
    lin = TrainConfig(max_steps=100, warmup_steps=0, min_lr_ratio=0.0, schedule="linear")
    assert lr_multiplier(25, lin) == pytest.approx(0.75)
    const = TrainConfig(max_steps=100, warmup_steps=5, schedule="constant")
    assert lr_multiplier(2, const) == pytest.approx(0.6) and lr_multiplier(90, const) == 1.0
    wsd = TrainConfig(max_steps=100, warmup_steps=10, min_lr_ratio=0.0, schedule="wsd", decay_fraction=0.2)
    assert lr_multiplier(50, wsd) == 1.0 and lr_multiplier(79, wsd) == 1.0
    assert lr_multiplier(90, wsd) == pytest.approx(0.5)


def test_scheduler_drives_optimizer_lr():
    model = torch.nn.Linear(2, 2)
    cfg = TrainConfig(lr=1.0, max_steps=20, warmup_steps=4, min_lr_ratio=0.0)
    opt = build_optimizer(model, cfg, torch.device("cpu"))
    sched = build_scheduler(opt, cfg)
    seen = []
    for _ in range(6):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert seen[5] == pytest.approx(0.5 * (1 + math.cos(math.pi * 1 / 16)))


def test_no_decay_on_norms_biases_and_embeddings():
    model = Transformer(small_model_config("gpt2", vocab_size=20, max_seq_len=8, d_model=16, n_heads=2))
    decay, no_decay = param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    assert decayed == {
        "blocks.0.attn.wq.weight",
        "blocks.0.attn.wk.weight",
        "blocks.0.attn.wv.weight",
        "blocks.0.attn.wo.weight",
        "blocks.0.mlp.up.weight",
        "blocks.0.mlp.down.weight",
    }
    assert no_decay["weight_decay"] == 0.0
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_adamw_is_the_fused_kernel_on_cuda_and_cpu(device):
    """One kernel launch per parameter group rather than a loop of per-tensor ops (issue 36: what a user runs on a
    large GPU). The parameters stay on the CPU here; the flag follows the device the engine names."""
    model = Transformer(small_model_config())
    opt = build_optimizer(model, TrainConfig(), torch.device(device))
    assert opt.defaults["fused"] is True and not opt.defaults["foreach"]
