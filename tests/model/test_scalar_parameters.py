"""No 0-dim parameters: FSDP2's ``fully_shard`` refuses them at wrap time, so the model build names any a variant
introduces. Focus's lambda is shape [1]; checkpoints written while it was 0-dim still load."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch import nn

from model.attention.common import reference as ref
from model.attention.common.base import Attention, AttnOut, VariantConfig, attention_registered, registry
from model.config import AttentionConfig
from model.transformer import build_model
from tests.conftest import small_model_config


@dataclass
class _ScalarConfig(VariantConfig):
    pass


def test_a_variant_with_a_0_dim_parameter_is_named_when_the_model_is_built():
    class Scalar(Attention):
        def __init__(self, cfg, spec):
            super().__init__(cfg, spec)
            self.temperature = nn.Parameter(torch.tensor(1.0))

        def reference(self, q, k, v, *, hidden, q_pos, k_pos, cache):
            p = ref.masked_softmax(ref.scores(q, k, self.temperature), ref.causal_mask(q_pos, k_pos))
            return AttnOut(ref.weighted_values(p, v, q.dtype))

    with attention_registered("scalar_test", _ScalarConfig, Scalar):
        cfg = small_model_config(
            n_layers=2, attention=AttentionConfig(kind="scalar_test", options={"scalar_test": _ScalarConfig()})
        )
        with pytest.raises(ValueError, match=r"'scalar_test': 0-dim parameters blocks\.0\.attn\.core\.temperature, "):
            build_model(cfg)


def test_no_registered_variant_has_a_0_dim_parameter():
    for kind, entry in registry.items():
        for case in entry.cls.suite_cases():
            variant = entry.config_cls(**case.options)
            model = build_model(small_model_config(attention=AttentionConfig(kind=kind, options={kind: variant})))
            assert all(p.dim() > 0 for p in model.parameters()), (kind, case.name)


@pytest.mark.parametrize("learnable", [True, False])
def test_focus_lambda_is_shape_1_and_old_0_dim_checkpoints_load(learnable):
    from model.attention.focus import FocusConfig

    schedule = {} if learnable else {"lambda_schedule": "linear", "lambda_learnable": False}
    variant = FocusConfig(window=4, **schedule)
    model = build_model(small_model_config(attention=AttentionConfig(kind="focus", options={"focus": variant})))
    state = model.state_dict()
    assert state["blocks.0.attn.core.lam"].shape == (1,)
    old = {k: (v.reshape(()) if k.endswith(".lam") else v) for k, v in state.items()}
    old["blocks.0.attn.core.lam"] = torch.tensor(5.5)
    fresh = build_model(small_model_config(attention=AttentionConfig(kind="focus", options={"focus": variant})))
    fresh.load_state_dict(old)
    assert fresh.blocks[0].attn.core.lam.shape == (1,) and fresh.blocks[0].attn.core.lam.item() == 5.5
    idx = torch.randint(0, 50, (1, 12))
    fresh.blocks[0].attn.core.collect_stats = True
    assert fresh(idx).layer_stats[0]["lambda"].shape == ()
