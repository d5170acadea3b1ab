"""Focus: the soft gate, exact hard inference (the batched decomposition against ``naive``), statistics, the lambda
schedule. Sinkhorn is test_sinkhorn.py's, the fast paths test_soft.py's and test_hard.py's.

The shared suite (test_suite.py) covers causality (prefix scope soft and hard; the sequence scope
must leak), hard fast-vs-reference values and gradients, and KV-cache generation in both modes.
"""

from __future__ import annotations

import math

import pytest
import torch

from core.errors import ConfigError
from model.attention import LayerSpec, build_attention
from model.attention.common import reference as ref
from model.attention.focus import FocusConfig, lambda_at, naive
from model.attention.focus.hard.group_sparse import hard_attention
from model.attention.focus.naive import hard_mask, membership_bits
from model.attention.focus.sinkhorn import group_imbalance
from model.config import ModelConfig
from model.transformer import Transformer
from tests.attention.test_suite import cache_chunk, random_inputs

SPEC = LayerSpec(d_model=32, n_heads=4, n_kv_heads=2, head_dim=8, max_seq_len=256, layer_idx=0, n_layers=1)


def qkv(b, t, dtype=torch.float64, seed=0, spec=SPEC):
    return random_inputs(spec, b, t, dtype, seed)


# ---- exact hard inference ---------------------------------------------------------------
def _bits(kind: str, b: int, t: int, n_groups: int, top_k: int, g: torch.Generator) -> torch.Tensor:
    if kind == "balanced":  # every group the same size (up to one token): a permutation of round-robin groups
        base = torch.arange(t) % n_groups
        groups = torch.stack([base[torch.randperm(t, generator=g)] for _ in range(b)])
        scores = torch.nn.functional.one_hot(groups, n_groups).double() * 10 + torch.rand(
            b, t, n_groups, generator=g, dtype=torch.float64
        )
    else:  # skewed: group 0 takes most tokens, the last group almost none
        skew = torch.linspace(3.0, -3.0, n_groups, dtype=torch.float64)
        scores = skew + torch.randn(b, t, n_groups, generator=g, dtype=torch.float64)
    return membership_bits(scores, top_k)


@pytest.mark.parametrize("n_groups", [4, 3])
@pytest.mark.parametrize("kind", ["balanced", "unbalanced"])
def test_hard_decomposition_equals_dense_masked_reference_float32(n_groups, kind):
    g = torch.Generator().manual_seed(n_groups)
    b, t = 3, 203  # batch > 1, T not a multiple of K
    for top_k in range(1, n_groups + 1):
        bits = _bits(kind, b, t, n_groups, top_k, g)
        sizes = torch.stack([((bits >> c) & 1).sum(1) for c in range(n_groups)], 1)
        if kind == "unbalanced" and top_k == 1:
            assert sizes.max() > 2 * sizes.min() + 10, sizes
        q, k, v, _ = qkv(b, t, torch.float32, seed=top_k)
        q = q * 2.0  # sharper patterns
        pos = torch.arange(t)
        for window in (1, 16):
            fast = hard_attention(
                q, k, v, bits_q=bits, bits_k=bits, q_pos=pos, window=window, scale=1 / math.sqrt(8), n_groups=n_groups
            )
            mask = hard_mask(bits, bits, pos, pos, window)
            dense = ref.weighted_values(
                ref.masked_softmax(ref.scores(q, k, 1 / math.sqrt(8)), mask[:, None]), v, torch.float32
            )
            cos = torch.nn.functional.cosine_similarity(fast.flatten(), dense.flatten(), dim=0)
            assert f"{cos.item():.4f}" == "1.0000" and (fast - dense).abs().max() <= 1e-5, (top_k, window, cos.item())
            if top_k == n_groups:
                assert mask.equal(ref.causal_mask(pos, pos).expand_as(mask)), "k = K keeps every causal pair"


def test_hard_decomposition_for_decode_and_chunks():
    b, t, n_groups = 2, 40, 4
    bits = _bits("unbalanced", b, t, n_groups, 2, torch.Generator().manual_seed(1))
    q, k, v, _ = qkv(b, t)
    pos = torch.arange(t)
    dense = ref.weighted_values(
        ref.masked_softmax(ref.scores(q, k, 0.3), hard_mask(bits, bits, pos, pos, 5)[:, None]), v, q.dtype
    )
    for lo, hi in ((39, 40), (20, 33), (0, 7)):
        part = hard_attention(
            **cache_chunk(q, k, v, bits, lo, hi), q_pos=pos[lo:hi], window=5, scale=0.3, n_groups=n_groups
        )
        torch.testing.assert_close(part, dense[:, :, lo:hi], atol=1e-13, rtol=0)


def test_membership_ties_break_to_the_lower_group():
    g = torch.tensor([[[0.25, 0.25, 0.25, 0.25], [0.1, 0.4, 0.4, 0.1]]])
    assert membership_bits(g, 1).tolist() == [[1, 2]]
    assert membership_bits(g, 2).tolist() == [[3, 6]]


# ---- the module ------------------------------------------------------------------------
def model_with(**options) -> Transformer:
    cfg = ModelConfig(vocab_size=60, max_seq_len=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2)
    cfg.attention.kind = "focus"
    for key, value in options.items():
        setattr(cfg.attention.options["focus"], key, value)
    cfg.validate()
    torch.manual_seed(0)
    return Transformer(cfg).double().eval()


def test_window_covering_the_sequence_is_full_attention():
    cfg = ModelConfig(vocab_size=60, max_seq_len=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2)
    torch.manual_seed(0)
    full = Transformer(cfg).double().eval()
    idx = torch.randint(0, 60, (2, 40), generator=torch.Generator().manual_seed(1))
    for options in ({"window": 64}, {"window": 4, "mode": "hard", "top_k": 4}):
        focus = model_with(**options)
        missing, unexpected = focus.load_state_dict(full.state_dict(), strict=False)
        assert unexpected == [] and all(".core." in m for m in missing)
        torch.testing.assert_close(focus(idx).logits, full(idx).logits, atol=1e-12, rtol=0)
    gated = model_with(window=4)
    gated.load_state_dict(full.state_dict(), strict=False)
    assert (gated(idx).logits - full(idx).logits).abs().max() > 1e-3


def test_soft_gate_values():
    module = build_attention("focus", FocusConfig(window=3, lambda_init=5.0), SPEC).double()
    g = torch.tensor([[[1.0, 0, 0, 0], [0, 1.0, 0, 0], [1.0, 0, 0, 0], [0.5, 0.5, 0, 0]]], dtype=torch.float64)
    pos = torch.arange(4)
    gate, distant = naive.gate_logits(g, g, module.lam, pos, pos, window=3, gate="additive")
    assert distant.tolist()[3] == [True, False, False, False]
    torch.testing.assert_close(gate[0, 2, 0], torch.nn.functional.logsigmoid(torch.tensor(2.5, dtype=torch.float64)))
    torch.testing.assert_close(gate[0, 1, 0], torch.nn.functional.logsigmoid(torch.tensor(-2.5, dtype=torch.float64)))
    torch.testing.assert_close(
        gate[0, 3, 0],
        torch.tensor(0.0, dtype=torch.float64) + torch.nn.functional.logsigmoid(torch.tensor(0.0, dtype=torch.float64)),
    )
    mult = build_attention("focus", FocusConfig(window=3, lambda_init=5.0, gate="multiplicative"), SPEC).double()
    torch.testing.assert_close(
        naive.gate_logits(g, g, mult.lam, pos, pos, window=3, gate="multiplicative")[0][0, 2, 0],
        torch.sigmoid(torch.tensor(5.0, dtype=torch.float64)),
    )


@pytest.mark.parametrize("gate", ["additive", "multiplicative"])
def test_statistics_compile_in_one_graph(gate):
    """Logging steps collect the statistics inside the compiled block (``train.compile``, a soft-mode training
    forward): their counts and sums stay on the device with static shapes, so the block keeps one graph (bincount, a
    boolean index or ``int()`` would break it on every logging step), and the values are the eager ones."""
    import torch._dynamo

    module = build_attention("focus", FocusConfig(window=4, n_groups=4, gate=gate), SPEC)
    module.collect_stats = True
    q, k, v, hidden = qkv(2, 24, dtype=torch.float32, seed=5)
    pos = torch.arange(24)
    eager = module(q, k, v, hidden=hidden, positions=pos).stats
    torch._dynamo.reset()

    def call(q, k, v, hidden, positions):
        return module(q, k, v, hidden=hidden, positions=positions)

    explained = torch._dynamo.explain(call)(q, k, v, hidden, pos)
    assert explained.graph_break_count == 0, explained.break_reasons
    torch._dynamo.reset()
    compiled = torch.compile(call, backend="eager")(q, k, v, hidden, pos).stats
    assert compiled.keys() == eager.keys() and "gate_distant" in eager
    for key in eager:
        torch.testing.assert_close(compiled[key], eager[key], msg=key)


def test_statistics_match_hand_computation():
    module = build_attention("focus", FocusConfig(window=4, n_groups=4), SPEC).double()
    module.collect_stats = True
    q, k, v, hidden = qkv(2, 24, seed=5)
    out = module(q, k, v, hidden=hidden, positions=torch.arange(24))
    g = module.assignments(hidden, None)[0]
    counts = torch.bincount(g.argmax(-1).flatten(), minlength=4)
    assert out.stats["max_group_share"].item() == pytest.approx(counts.max().item() / 48)
    torch.testing.assert_close(out.stats["confidence"], g.max(-1).values.mean())
    torch.testing.assert_close(out.stats["imbalance"], group_imbalance(g))
    gate = torch.sigmoid(module.lam * (g @ g.transpose(1, 2) - 0.5))
    pos = torch.arange(24)
    pairs = (pos[:, None] - pos[None, :]) >= 4
    torch.testing.assert_close(out.stats["gate_distant"], gate[:, pairs].mean())
    hard = build_attention("focus", FocusConfig(window=4, mode="hard", top_k=2), SPEC).double()
    hard.load_state_dict(module.state_dict())
    hard.collect_stats = True
    kept = hard(q, k, v, hidden=hidden, positions=pos).stats["pairs_kept"]
    bits = membership_bits(g, 2)
    assert kept.item() == pytest.approx(hard_mask(bits, bits, pos, pos, 4).sum().item() / (2 * 300))
    assert 0 < kept < 1


def test_stability_on_the_reference_batch():
    model = model_with(window=4)
    idx = torch.randint(0, 60, (2, 30), generator=torch.Generator().manual_seed(2))
    assert model.reference_batch_stats(idx) == {}, "no previous pass yet"
    assert model.reference_batch_stats(idx)["attn/focus/stability"] == 1.0
    with torch.no_grad():
        for block in model.blocks:
            block.attn.core.centroids.normal_()
    assert model.reference_batch_stats(idx)["attn/focus/stability"] < 1.0


def test_entropy_penalty_only_while_centroids_train():
    model = model_with(window=4, entropy_weight=0.1).train()
    idx = torch.randint(0, 60, (2, 30), generator=torch.Generator().manual_seed(2))
    out = model(idx, targets=idx)
    assert out.aux_loss is not None and out.aux_loss > 0
    out.aux_loss.backward()
    assert model.blocks[0].attn.core.centroids.grad.abs().sum() > 0
    for block in model.blocks:
        block.attn.core.centroids.requires_grad_(False)
    assert model(idx, targets=idx).aux_loss is None
    assert model_with(window=4).eval()(idx).aux_loss is None


def test_lambda_schedule():
    cfg = FocusConfig(
        lambda_schedule="linear", lambda_learnable=False, lambda_init=2.0, lambda_end=12.0, lambda_warmup=0.5
    )
    assert [lambda_at(cfg, s, 100) for s in (0, 25, 50, 90)] == [2.0, 7.0, 12.0, 12.0]
    cos = FocusConfig(lambda_schedule="cosine", lambda_learnable=False)
    assert lambda_at(cos, 25, 100) == pytest.approx(7.0) and lambda_at(cos, 10, 100) < 7.0 - 1
    module = build_attention("focus", cfg, SPEC)
    assert "lam" in dict(module.named_buffers()) and "lam" not in dict(module.named_parameters())
    module.set_train_progress(25, 100)
    assert module.lam.item() == 7.0
    assert "lam" in module.state_dict(), "the scheduled value is saved with the weights"


def test_bad_focus_options():
    with pytest.raises(ConfigError, match=r"model.attention.focus.lambda_learnable: a scheduled lambda"):
        FocusConfig(lambda_schedule="linear").validate("model.attention.focus.")
    with pytest.raises(ConfigError, match=r"model.attention.focus.top_k: must be in \[1, 4\], got 5"):
        FocusConfig(top_k=5).validate("model.attention.focus.")
    with pytest.raises(
        ConfigError, match="model.attention.focus.sinkhorn_scope: 'global' is not one of prefix, sequence"
    ):
        FocusConfig(sinkhorn_scope="global").validate("model.attention.focus.")
