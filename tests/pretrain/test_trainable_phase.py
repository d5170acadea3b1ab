"""The trainable set tells the attention variants whether the backbone trains (``Attention.set_backbone_trains``),
and Focus's entropy penalty follows the paper (section 3.1): on while only the variants' own parameters train, off
once the backbone trains, the mean over layers; ``entropy = "always"`` keeps it whenever the centroids train."""

from __future__ import annotations

import pytest
import torch

from model.attention.focus import FocusConfig
from model.config import AttentionConfig
from model.transformer import build_model
from pretrain.freezing import apply_trainable
from run.config import TrainConfig
from tests.conftest import small_model_config


def focus_model(**options):
    variant = FocusConfig(window=4, **options)
    return build_model(
        small_model_config(n_layers=2, attention=AttentionConfig(kind="focus", options={"focus": variant}))
    )


IDX = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(0))


def aux(model) -> torch.Tensor | None:
    return model.train()(IDX, targets=IDX).aux_loss


def test_the_trainable_set_reaches_every_attention_module():
    model = focus_model()
    cores = [block.attn.core for block in model.blocks]
    two_phase = TrainConfig(trainable=["*.core.*"], unfreeze_at=3, max_steps=6)
    assert apply_trainable(model, two_phase, 0) is not None
    assert [c.backbone_trains for c in cores] == [False, False]
    assert apply_trainable(model, two_phase, 2) is None
    assert apply_trainable(model, two_phase, 3) is not None and all(c.backbone_trains for c in cores)
    apply_trainable(model, TrainConfig(freeze=["blocks.0.mlp.*"]), 0)
    assert all(c.backbone_trains for c in cores), "a partly frozen backbone still trains"


def test_entropy_penalty_in_the_centroid_phase_only_and_averaged_over_layers():
    model = focus_model()
    two_phase = TrainConfig(trainable=["*.core.*"], unfreeze_at=3, max_steps=6)
    apply_trainable(model, two_phase, 0)
    model.set_collect_stats(True)
    out = model.train()(IDX, targets=IDX)
    entropies = [stats["entropy"] for stats in out.layer_stats]
    assert float(out.aux_loss.detach()) == pytest.approx(0.1 * float(sum(entropies)) / len(entropies), rel=1e-6), (
        "layer mean"
    )
    apply_trainable(model, two_phase, 3)
    assert aux(model) is None, "off once the backbone trains"
    apply_trainable(model, TrainConfig(), 0)
    assert aux(model) is None, "from scratch: off by default"


def test_entropy_always_applies_whenever_the_centroids_train():
    model = focus_model(entropy="always")
    apply_trainable(model, TrainConfig(), 0)
    assert aux(model) is not None
    apply_trainable(model, TrainConfig(freeze=["*.core.*"]), 0)
    assert aux(model) is None, "frozen centroids: nothing to penalise"


def test_bad_entropy_option_is_one_line():
    from core.errors import ConfigError

    with pytest.raises(ConfigError, match=r"model.attention.focus.entropy: .*centroid_phase"):
        FocusConfig(entropy="sometimes").validate("model.attention.focus.")
