"""``train.float8`` (pretrain/engines/float8.py) on CPU: torch's CPU ``_scaled_mm`` computes the float8 matmuls, so
everything but the speed is checked here. The conversion (which linears, the one log line, unchanged parameter
names), the refusals (one line each), the tensor-parallel styles, activation checkpointing, the fused head and every
attention variant on converted blocks, and 200 training steps of each recipe within 3 % of the same run in high
precision. Multi-process runs, resumes and the export: tests/e2e/test_float8.py."""

from __future__ import annotations

import sys

import pytest
import torch

from core.errors import ConfigError
from model.attention import registry
from model.config import AttentionConfig, ModelConfig
from model.transformer import Transformer, build_model
from pretrain.engines import build_engine
from pretrain.engines import float8 as f8
from pretrain.engines.parallelize import parallelize
from run.config import FLOAT8_RECIPES, TrainConfig
from tests.conftest import small_model_config

pytest.importorskip("torchao")

RECIPES = [r for r in FLOAT8_RECIPES if r != "none"]
# every linear's dimensions multiples of 16 (head_dim 16), but d_ff = 40: the MLP stays high precision
SHAPE = dict(vocab_size=64, max_seq_len=32, d_model=64, n_layers=2, n_heads=4)


def _model(seed: int = 0, **overrides) -> Transformer:
    torch.manual_seed(seed)
    return build_model(ModelConfig(**{**SHAPE, **overrides}))


def _convert(model: Transformer, recipe: str = "tensorwise", **train) -> str:
    return f8.convert(model, TrainConfig(float8=recipe, **train), torch.device("cpu"), fsdp=False)


def test_conversion_filters_names_them_in_one_line_and_keeps_the_parameter_names():
    model = _model(d_ff=40)  # up / gate / down: 40 x 64, not multiples of 16
    plain = build_model(model.cfg)
    line = _convert(model, float8_filter=["blocks.1.attn.wo"])
    converted = sorted(n for n, m in model.named_modules() if f8.is_float8_linear(m))
    expected = [f"blocks.{i}.attn.{w}" for i in (0, 1) for w in ("wq", "wk", "wv", "wo") if (i, w) != (1, "wo")]
    assert converted == sorted(expected)
    assert "\n" not in line and line.startswith("float8 (tensorwise): 7 linear layers converted")
    assert "lm_head (the LM head)" in line and "blocks.1.attn.wo (train.float8_filter)" in line
    assert "blocks.*.mlp.up x2, blocks.*.mlp.gate x2 (40x64, not multiples of 16)" in line
    assert "blocks.*.mlp.down x2 (64x40, not multiples of 16)" in line
    # Float8Linear holds the same parameters: checkpoints, exports and DCP keys do not change
    assert list(model.state_dict()) == list(plain.state_dict())
    assert all(type(p) is torch.nn.Parameter and p.dtype == torch.float32 for p in model.parameters())


def test_a_variants_own_linears_stay_and_a_pattern_matching_nothing_is_one_line():
    model = build_model(small_model_config(d_model=64, attention=AttentionConfig(kind="focus")))
    _, kept = f8.eligible(model, [])
    assert any(".attn.core." in name for name in kept) and all(
        kept[n] == "the attention variant's own" for n in kept if ".attn.core." in n
    )
    with pytest.raises(ConfigError, match=r"^train.float8_filter: pattern 'blocks.9.\*' matches no linear layer"):
        f8.eligible(model, ["blocks.9.*"])


def test_config_refusals_are_one_line_naming_the_field():
    with pytest.raises(ConfigError, match=r"^train.float8: 'fp8' is not one of none, tensorwise, rowwise"):
        TrainConfig(float8="fp8").validate()
    with pytest.raises(ConfigError) as exc:
        TrainConfig(float8="rowwise", engine="deepspeed").validate()
    assert str(exc.value) == (
        "train.float8: not supported with train.engine=deepspeed; engines that support it: single, ddp, fsdp2"
    )
    TrainConfig(float8="rowwise", engine="fsdp2").validate()


def test_device_torchao_and_recipe_refusals(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    cuda = torch.device("cuda", 0)
    with pytest.raises(ConfigError) as exc:
        f8.check_device(TrainConfig(float8="tensorwise"), cuda)
    assert "\n" not in str(exc.value) and str(exc.value).startswith(
        "train.float8: 'tensorwise' needs float8 tensor cores (CUDA compute capability 8.9+"
    )
    assert "NVIDIA A100-SXM4-80GB is 8.0: set train.float8_emulate = true" in str(exc.value)
    f8.check_device(TrainConfig(float8="tensorwise", float8_emulate=True), cuda)  # emulated: allowed
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    f8.check_device(TrainConfig(float8="tensorwise"), cuda)
    f8.check_device(TrainConfig(float8="tensorwise"), torch.device("cpu"))  # CPU: no capability to check

    with pytest.raises(ConfigError, match=r"has no recipe 'blockwise' \(it has: tensorwise, rowwise"):
        f8.recipe_config(TrainConfig(float8="blockwise"), fsdp_all_gather=False)  # as an older torchao would say

    for name in [m for m in sys.modules if m == "torchao" or m.startswith("torchao.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "torchao", None)  # not installed
    with pytest.raises(ConfigError) as missing:
        f8.torchao_float8()
    assert str(missing.value) == "train.float8 needs torchao, which is not installed: pip install -e '.[float8]'"


def test_recipes_and_the_fsdp_all_gather():
    for recipe in RECIPES:
        config = f8.recipe_config(TrainConfig(float8=recipe), fsdp_all_gather=True)
        assert config.enable_fsdp_float8_all_gather == (recipe == "tensorwise")
        assert not config.emulate
    assert f8.recipe_config(TrainConfig(float8="rowwise", float8_emulate=True), fsdp_all_gather=False).emulate


def test_tensor_parallel_plan_uses_torchaos_float8_styles_for_tensorwise_only():
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    from pretrain.engines.tensor_parallel import SequenceSwitch, tp_plan

    for recipe in RECIPES:
        model = _model()
        _convert(model, recipe)
        for sequence in (None, SequenceSwitch(2)):
            plan = tp_plan(model, sequence)
            tensorwise = recipe == "tensorwise"
            assert isinstance(plan["blocks.0.attn.wq"], Float8ColwiseParallel) == tensorwise
            assert isinstance(plan["blocks.1.mlp.down"], Float8RowwiseParallel) == tensorwise
            assert not isinstance(plan["lm_head"], Float8ColwiseParallel)  # high precision
            if sequence is not None:
                assert isinstance(plan["blocks.0.mlp"], PrepareFloat8ModuleInput) == tensorwise
                assert not isinstance(plan["blocks.0.attn"], PrepareFloat8ModuleInput)  # the variant reads `hidden`
            plain = tp_plan(model, sequence, float8_styles=False)  # a CPU (gloo) mesh
            assert not any(isinstance(s, (Float8ColwiseParallel, Float8RowwiseParallel)) for s in plain.values())


def _loss_and_grads(model: Transformer, batch: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    out = model(batch[:, :-1], targets=batch[:, 1:])
    out.loss_sum.backward()
    return out.loss_sum.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_activation_checkpointing_and_the_fused_head_keep_working():
    batch = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(3))
    model = _model(d_model=32, n_heads=2, n_layers=1)
    _convert(model, "rowwise")
    assert model.fused_head_applies(), "the LM head stays an nn.Linear: the fused head + loss still applies"
    loss0, grads0 = _loss_and_grads(model, batch)
    for mode in ("selective", "full"):
        model.activation_checkpointing = mode
        loss, grads = _loss_and_grads(model, batch)
        assert torch.equal(loss, loss0), mode  # the recompute casts the same values to float8 again
        for name, g in grads.items():
            torch.testing.assert_close(g, grads0[name], rtol=0, atol=0, msg=f"{mode}: {name}")
    model.activation_checkpointing = "none"
    model.fused_cross_entropy = False  # the plain head: the same loss to float32 rounding
    plain, _ = _loss_and_grads(model, batch)
    torch.testing.assert_close(plain, loss0, rtol=1e-5, atol=0)


def test_the_selective_policy_keeps_the_float8_matmuls():
    from model.activation_checkpointing import saved_ops

    assert torch.ops.aten._scaled_mm.default in saved_ops()


@pytest.mark.parametrize("kind", sorted(k for k in registry if registry[k].cls.trainable))
def test_each_attention_variant_trains_on_converted_blocks(kind):
    """Only the projections and the MLP change: the variant's own modules stay as built, and the loss and the
    gradients stay near the high-precision model's (float8's rounding, no more)."""
    cfg = small_model_config(d_model=64, n_heads=4, max_seq_len=32, attention=AttentionConfig(kind=kind))
    torch.manual_seed(0)
    ref = build_model(cfg)
    model = build_model(cfg)
    model.load_state_dict(ref.state_dict())
    _convert(model, "tensorwise")
    assert any(f8.is_float8_linear(m) for m in model.modules())
    for block, plain in zip(model.blocks, ref.blocks):
        assert not any(f8.is_float8_linear(m) for m in block.attn.core.modules())
        assert [type(m) for m in block.attn.core.modules()] == [type(m) for m in plain.attn.core.modules()]
    batch = torch.randint(0, cfg.vocab_size, (2, 33), generator=torch.Generator().manual_seed(3))
    loss, grads = _loss_and_grads(model, batch)
    loss_ref, grads_ref = _loss_and_grads(ref, batch)
    assert torch.isfinite(loss) and abs(float(loss / loss_ref) - 1) < 0.02, (float(loss), float(loss_ref))
    assert grads.keys() == grads_ref.keys()
    for name, g in grads.items():
        if not grads_ref[name].any():  # a parameter with no gradient here (Focus's centroids: their own update)
            assert not g.any(), name
            continue
        cos = torch.nn.functional.cosine_similarity(g.flatten(), grads_ref[name].flatten(), dim=0)
        assert cos > 0.95, (name, float(cos))


def _train(recipe: str, steps: int) -> list[float]:
    """``steps`` AdamW steps of a 1-layer, 32-wide model (head_dim 16) through the single engine (the float8
    conversion in its own place), on a stream with a loss floor: each token is the previous one plus 1-4 (uniform),
    modulo the vocabulary, so the loss falls from ln 64 = 4.16 towards ln 4 = 1.39 and stays measurable."""
    torch.manual_seed(0)
    model = build_model(ModelConfig(vocab_size=64, max_seq_len=16, d_model=32, n_layers=1, n_heads=2))
    cfg = TrainConfig(float8=recipe, precision="fp32", lr=3e-3, warmup_steps=10, max_steps=steps, min_lr_ratio=1.0)
    engine = build_engine(model, cfg, torch.device("cpu"))
    assert (engine.float8_summary is not None) == (recipe != "none")
    gen = torch.Generator().manual_seed(7)
    losses = []
    for _ in range(steps):
        start = torch.randint(0, 64, (8, 1), generator=gen)
        batch = torch.cat([start, start + torch.randint(1, 5, (8, 16), generator=gen).cumsum(1)], 1) % 64
        out = engine.micro_step(batch[:, :-1], batch[:, 1:], loss_scale=1 / (8 * 16), aux_scale=1.0, sync=True)
        engine.optimizer_step(1.0)
        losses.append(float(out.loss_sum) / (8 * 16))
    return losses


@pytest.mark.slow
def test_200_steps_of_each_recipe_stay_within_3_percent_of_high_precision():
    """About 20 s on one core (float8's casts cost more than the tiny matmuls on CPU). Measured: the 20-step means
    stay within 0.03 % of high precision for every recipe."""
    steps = 200
    reference = _train("none", steps)
    assert sum(reference[-20:]) / 20 < 0.4 * reference[0], "the stream is learnable: the loss must fall"
    for recipe in RECIPES:
        losses = _train(recipe, steps)
        # every 20-step window's mean (one step's loss is one batch's noise), the last one included
        for end in range(20, steps + 1, 20):
            ours, ref = sum(losses[end - 20 : end]) / 20, sum(reference[end - 20 : end]) / 20
            assert abs(ours / ref - 1) <= 0.03, (recipe, end, ours, ref)


def test_parallelize_converts_before_the_wrap_and_resume_reports_the_change():
    from pretrain.resume_config import LAUNCH, changes

    model = _model()
    out = parallelize(model, TrainConfig(float8="rowwise", activation_checkpointing="full"))
    assert out is model and model.float8_summary.startswith("float8 (rowwise): 14 linear layers converted")
    assert model.blocks[0].checkpointing == "full"
    # the resolved TOML of two launches differing only in train.float8
    (change,) = changes('[train]\nfloat8 = "none"\n', '[train]\nfloat8 = "tensorwise"\n')
    assert change.kind == LAUNCH and change.line(3) == "train.float8: 'none' -> 'tensorwise' (this launch's setting)"


def test_plain_unwraps_the_float8_all_gather_weight():
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    model = _model()
    f8.convert(model, TrainConfig(float8="tensorwise"), torch.device("cpu"), fsdp=True)
    weight = model.blocks[0].attn.wq.weight
    assert isinstance(weight.data, WeightWithDynamicFloat8CastTensor) or isinstance(
        weight, WeightWithDynamicFloat8CastTensor
    )
    state = f8.plain_state({k: v.detach() for k, v in model.state_dict().items()})
    assert all(type(v) is torch.Tensor for v in state.values())
    assert torch.equal(state["blocks.0.attn.wq.weight"], weight.detach()._tensor)


@pytest.mark.slow
def test_compile_per_block_trains_converted_blocks_like_eager():
    """torch.compile per block (inductor traces torchao's casts; about a minute on CPU): the same losses as eager to
    float32 rounding, the same parameter names. Measured: equal to 1e-6 relative over 3 steps."""
    batch = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(1))
    losses, names = {}, {}
    for compiled in (False, True):
        torch.manual_seed(0)
        model = build_model(ModelConfig(vocab_size=64, max_seq_len=32, d_model=32, n_layers=1, n_heads=2))
        cfg = TrainConfig(precision="fp32", lr=1e-2, warmup_steps=0, max_steps=10, compile=compiled)
        cfg.float8 = "tensorwise"
        engine = build_engine(model, cfg, torch.device("cpu"))
        names[compiled] = list(model.state_dict())
        losses[compiled] = []
        for _ in range(3):
            out = engine.micro_step(batch[:, :-1], batch[:, 1:], loss_scale=1 / 64, aux_scale=1.0, sync=True)
            engine.optimizer_step(1.0)
            losses[compiled].append(float(out.loss_sum))
    assert names[True] == names[False]
    assert losses[True] == pytest.approx(losses[False], rel=1e-5)


def test_emulation_computes_the_same_float8_values():
    """``train.float8_emulate`` (a GPU below compute capability 8.9): the same float8-rounded operands, multiplied in
    high precision instead of by ``_scaled_mm``: the same loss to float32 rounding."""
    batch = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(3))
    for recipe in RECIPES:
        losses = []
        for emulate in (False, True):
            model = _model(d_model=32, n_heads=2, n_layers=1)
            _convert(model, recipe, float8_emulate=emulate)
            assert all(m.config.emulate == emulate for m in model.modules() if f8.is_float8_linear(m))
            losses.append(_loss_and_grads(model, batch)[0])
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=0, msg=recipe)
