from __future__ import annotations

import contextlib

import pytest
import torch

from core.device import autocast_dtype
from core.errors import ConfigError
from model.config import ModelConfig
from model.transformer import Transformer
from pretrain.engines import build_engine
from run.config import TrainConfig


def engine(precision="fp32", seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    model = Transformer(ModelConfig(vocab_size=64, max_seq_len=32, d_model=32, n_layers=2, n_heads=4)).to(dtype)
    return build_engine(
        model, TrainConfig(precision=precision, lr=1e-2, warmup_steps=0, max_steps=10), torch.device("cpu")
    )


def test_accumulation_equals_one_large_batch():
    batch = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(1))
    one, two = engine(dtype=torch.float64), engine(dtype=torch.float64)  # float64: only summation order differs
    n = 4 * 16
    one.micro_step(batch[:, :-1], batch[:, 1:], loss_scale=1 / n, aux_scale=1.0, sync=True)
    for i in range(2):
        mb = batch[2 * i : 2 * i + 2]
        two.micro_step(mb[:, :-1], mb[:, 1:], loss_scale=1 / n, aux_scale=0.5, sync=i == 1)
    for (name, a), b in zip(one.raw_model.named_parameters(), two.raw_model.parameters()):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-12, rtol=1e-10, msg=name)
    assert float(one.optimizer_step(1.0)) == pytest.approx(float(two.optimizer_step(1.0)), rel=1e-10)
    for a, b in zip(one.raw_model.parameters(), two.raw_model.parameters()):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-8)


def test_clipping_bounds_the_update_norm_and_reports_the_raw_norm():
    e = engine()
    batch = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(2))
    e.micro_step(batch[:, :-1], batch[:, 1:], loss_scale=1000.0, aux_scale=1.0, sync=True)  # huge gradients
    raw = torch.sqrt(sum((p.grad.float() ** 2).sum() for p in e.raw_model.parameters())).item()
    assert float(e.optimizer_step(0.5)) == pytest.approx(raw, rel=1e-4)
    assert all(p.grad is None for p in e.raw_model.parameters())


def test_precision_policy():
    assert autocast_dtype("auto", torch.device("cpu")) is None
    assert autocast_dtype("auto", torch.device("cuda")) is torch.bfloat16
    assert autocast_dtype("fp32", torch.device("cuda")) is None
    e = engine("bf16")
    batch = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(3))
    out = e.micro_step(batch[:, :-1], batch[:, 1:], loss_scale=1 / 32, aux_scale=1.0, sync=True)
    assert torch.isfinite(out.loss_sum) and out.n_tokens == 32
    assert all(p.dtype == torch.float32 for p in e.raw_model.parameters()), "autocast keeps fp32 master weights"


@pytest.fixture
def toy_engine():
    """A throwaway engine registered for one test, and removed after it."""
    from pretrain.engines import ENGINES, register_engine
    from pretrain.engines.single import SingleEngine
    from run.engines import ENGINE_SPECS, EngineSpec

    class ToyEngine(SingleEngine):
        name = "toy"

    register_engine(ToyEngine, EngineSpec("toy", "a test's engine", changes_trainable=False))
    yield ToyEngine
    ENGINES.pop("toy")
    ENGINE_SPECS.pop("toy")


def test_a_registered_engine_joins_validation_errors_and_building(toy_engine):
    from core.errors import ConfigError

    TrainConfig(engine="toy").validate()  # accepted by name
    with pytest.raises(ConfigError, match=r"train.engine: 'nope' is not one of .*\btoy\b"):
        TrainConfig(engine="nope").validate()
    # its declared capability is checked once, at validation, naming the engines that have it
    with pytest.raises(ConfigError, match=r"train.unfreeze_at: not supported with train.engine=toy.*: single"):
        TrainConfig(engine="toy", unfreeze_at=5, max_steps=10).validate()
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=64, max_seq_len=32, d_model=32, n_layers=2, n_heads=4))
    assert isinstance(build_engine(model, TrainConfig(engine="toy"), torch.device("cpu")), toy_engine)


def test_every_engine_has_a_spec_and_every_spec_an_engine():
    from pretrain.engines import ENGINES
    from run.engines import ENGINE_SPECS

    assert set(ENGINES) == set(ENGINE_SPECS)
    assert all(cls.name == name for name, cls in ENGINES.items())


def test_config_validation_knows_the_harness_tasks_without_importing_lm_eval():
    pytest.importorskip("lm_eval")
    from eval.harness import SOURCES
    from run.config import LM_EVAL_TASKS

    assert set(LM_EVAL_TASKS) == set(SOURCES)


def test_engine_options_live_in_their_own_tables_and_old_keys_still_read(capsys):
    from core.errors import ConfigError
    from run.config import load_run_config

    cfg = load_run_config(None, ["train.engine=deepspeed", "train.deepspeed.zero_stage=3"])
    assert cfg.train.options("deepspeed").zero_stage == 3 and "[train.deepspeed]" in cfg.to_toml()
    old = load_run_config(None, ["train.engine=deepspeed", "train.zero_stage=2", "train.deepspeed_config="])
    assert old.train.options("deepspeed").zero_stage == 2
    notes = capsys.readouterr().err.splitlines()
    assert "note: train.zero_stage is deprecated; use train.deepspeed.zero_stage" in notes
    assert "note: train.deepspeed_config is deprecated; use train.deepspeed.config" in notes
    assert "zero_stage = 2" in old.to_toml() and "\nzero_stage" not in old.to_toml().split("[train.deepspeed]")[0]
    hsdp = load_run_config(None, ["train.engine=fsdp2", "train.fsdp_replicate=2"])
    assert hsdp.train.options("fsdp2").replicate == 2
    with pytest.raises(ConfigError, match=r"^train.zero_stage: moved to train.deepspeed.zero_stage, which is set too"):
        load_run_config(None, ["train.zero_stage=2", "train.deepspeed.zero_stage=3"])
    with pytest.raises(ConfigError, match=r"^train.deepspeed.zero_stage: must be in \[0, 3\], got 4$"):
        load_run_config(None, ["train.engine=deepspeed", "train.deepspeed.zero_stage=4"])


def test_sdpa_backend_order_puts_the_chosen_backend_first_and_the_rest_after():
    from torch.nn.attention import SDPBackend as B

    from model.attention.common.sdpa import sdpa_backend_order

    auto = [B.CUDNN_ATTENTION, B.FLASH_ATTENTION, B.EFFICIENT_ATTENTION, B.MATH]
    assert sdpa_backend_order("auto") == auto
    assert sdpa_backend_order("flash") == [B.FLASH_ATTENTION, B.CUDNN_ATTENTION, B.EFFICIENT_ATTENTION, B.MATH]
    assert sdpa_backend_order("math")[0] == B.MATH and set(sdpa_backend_order("math")) == set(auto)
    with pytest.raises(ConfigError, match=r"^train.sdpa_backend: 'fa9' is not one of auto, cudnn, flash"):
        TrainConfig(sdpa_backend="fa9").validate()


def test_the_training_forward_runs_under_the_sdpa_priority_on_cuda(monkeypatch):
    """The engine enters ``sdpa_kernel(order, set_priority=True)`` around the forward on CUDA (forced here: the
    model stays on the CPU, whose build keeps the same priority flags): SDPA's priority inside the forward is the
    configured order, and the previous one comes back after. On the CPU nothing is entered."""
    from torch.nn.attention import SDPBackend as B

    from model.attention.common import sdpa
    from pretrain.engines import base

    devices: list[str] = []

    def on_cuda(name: str, device_type: str):
        devices.append(device_type)
        return sdpa.sdpa_backends(name, "cuda")

    monkeypatch.setattr(base, "sdpa_backends", on_cuda)
    before = torch._C._get_sdp_priority_order()
    e = engine()
    e.cfg.sdpa_backend = "flash"
    seen: list[list[int]] = []
    forward = e.model.forward

    def spied(*args, **kwargs):
        seen.append(torch._C._get_sdp_priority_order())
        return forward(*args, **kwargs)

    monkeypatch.setattr(e.model, "forward", spied)
    batch = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(4))
    e.micro_step(batch[:, :-1], batch[:, 1:], loss_scale=1 / 32, aux_scale=1.0, sync=True)
    order = [int(b) for b in (B.FLASH_ATTENTION, B.CUDNN_ATTENTION, B.EFFICIENT_ATTENTION, B.MATH)]
    assert devices == ["cpu"] and seen and seen[0][:4] == order
    assert torch._C._get_sdp_priority_order() == before
    assert isinstance(sdpa.sdpa_backends("auto", "cpu"), contextlib.nullcontext)
