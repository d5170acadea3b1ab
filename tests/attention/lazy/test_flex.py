"""Lazy attention's FlexAttention path (model/attention/lazy/flex.py) against the dense reference, values and
gradients, through eager FlexAttention on CPU; its block-mask cache and its compile (one graph per regime)."""

from __future__ import annotations

import warnings

import pytest
import torch

from model.attention import LayerSpec, build_attention
from model.attention.lazy import LazyConfig
from model.attention.lazy import flex as lazy_flex


def inputs(t=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, t, 8, generator=g, dtype=torch.float64)
    k = torch.randn(2, 2, t, 8, generator=g, dtype=torch.float64)
    v = torch.randn(2, 2, t, 8, generator=g, dtype=torch.float64)
    return q, k, v, torch.zeros(2, t, 32, dtype=torch.float64)


TAUS = {
    "negative": [-1.0, -0.5, -2.0, -0.05],  # the paper reports learned negative offsets
    "mixed": [-1.0, 0.7, -0.3, 1.0],
    "positive": [1.0, 0.4, 0.05, 2.0],  # 1.0: the first query keeps nothing (p = 1 = tau / 1)
}


@pytest.fixture
def flex_backward_on_cpu(monkeypatch):
    """FlexAttention refuses inputs that require grad on CPU (it has no compiled CPU backward), but its eager
    (math) implementation computes values and gradients, captured tensors included: lift the device check."""
    import torch.nn.attention.flex_attention as flex

    monkeypatch.setattr(flex, "_validate_device", lambda *tensors: None)


def lazy_module(tau, seed=5, max_distance=16):
    """Bias table (16) shorter than the contexts below, so distances past it read its last entry."""
    spec = LayerSpec(32, 4, 2, 8, max_seq_len=512, layer_idx=0, n_layers=1)
    module = build_attention("lazy", LazyConfig(max_distance=max_distance), spec).double()
    with torch.no_grad():
        module.distance_bias.normal_(0, 2.0, generator=torch.Generator().manual_seed(seed))
        module.tau.copy_(torch.tensor(tau, dtype=torch.float64))
    return module


def fast_and_reference(module, q, k, v, q_pos, dtype=torch.float64):
    """Outputs and gradients (q, k, v, bias table, tau) of both paths, for one fixed projection of the output."""
    module = module.to(dtype)
    k_pos = torch.arange(k.shape[2])
    hidden = torch.zeros(q.shape[0], q.shape[2], 32, dtype=dtype)
    w = torch.randn(q.shape, dtype=dtype, generator=torch.Generator().manual_seed(9))
    results = []
    for path in (module.flex, module.reference):
        leaves = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
        module.zero_grad()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = path(*leaves, hidden=hidden, q_pos=q_pos, k_pos=k_pos, cache=None).output
            (out * w).sum().backward()
        grads = [x.grad for x in leaves] + [module.distance_bias.grad.clone(), module.tau.grad.clone()]
        results.append((out.detach(), grads))
    return results


@pytest.mark.parametrize("taus", list(TAUS))
@pytest.mark.parametrize(
    "t,q_from",
    [(37, 0), (37, 29), (37, 36), pytest.param(300, 0, marks=pytest.mark.slow), (300, 170), (300, 299)],
    ids=["37-train", "37-chunk", "37-decode", "300-train", "300-chunk", "300-decode"],
)
def test_two_pass_flex_composition_equals_the_reference(flex_backward_on_cpu, taus, t, q_from):
    """The fast path's FlexAttention composition (eager FlexAttention on CPU) against the dense reference,
    values and gradients, float64: any sign of tau, mixed across heads, a bias table shorter than the context,
    scores spread wide (tens of nats: where a clamped pass 2 dropped the |tau|/n floor), T below and above
    FlexAttention's 128-token block, training, chunked prefill (queries q_from..t-1 on t keys) and decode."""
    module = lazy_module(TAUS[taus])
    q, k, v, _ = inputs(t=t, seed=6)
    q = q[:, :, q_from:] * 12
    (fast, fast_grads), (ref, ref_grads) = fast_and_reference(module, q, k, v, torch.arange(q_from, t))
    assert ref.abs().max() > 0
    torch.testing.assert_close(fast, ref, atol=1e-10, rtol=1e-9)
    for name, got, want in zip(("q", "k", "v", "distance_bias", "tau"), fast_grads, ref_grads):
        torch.testing.assert_close(got, want, atol=1e-9, rtol=1e-8, msg=lambda m, name=name: f"grad {name}: {m}")


def test_two_pass_flex_composition_in_float32(flex_backward_on_cpu):
    module = lazy_module(TAUS["mixed"])
    q, k, v, _ = inputs(t=300, seed=7)
    (fast, fast_grads), (ref, ref_grads) = fast_and_reference(
        module, q[:, :, 150:] * 4, k, v, torch.arange(150, 300), torch.float32
    )
    torch.testing.assert_close(fast, ref, atol=1e-5, rtol=1e-4)
    for got, want in zip(fast_grads, ref_grads):
        # A bias-table entry sums thousands of pair gradients that cancel (the last entry, every distance past the
        # table): its float32 error scales with the table's largest entries, not with its own (an entry of 0.029
        # among entries up to 6 moved by 1.4e-4 between runs: FlexAttention accumulates captured-tensor gradients
        # in a thread-dependent order). Exactness is the float64 test's.
        scale = max(1.0, want.abs().max().item())
        torch.testing.assert_close(got, want, atol=1e-4 * scale, rtol=1e-3)


def test_causal_block_masks_are_cached_per_shape_and_decode_needs_none():
    from model.attention.lazy.flex import causal_block_mask

    assert causal_block_mask(1, 300, "cpu") is None
    mask = causal_block_mask(170, 300, "cpu")
    assert causal_block_mask(170, 300, "cpu") is mask and causal_block_mask(171, 300, "cpu") is not mask
    dense = torch.tensor(
        [[bool(mask.mask_mod(0, 0, torch.tensor(i), torch.tensor(j))) for j in range(300)] for i in range(0, 170, 7)]
    )
    q_pos = torch.arange(130, 300)[::7]
    assert torch.equal(dense, torch.arange(300)[None, :] <= q_pos[:, None])


@pytest.mark.slow
def test_compiled_fast_path_does_not_recompile_per_length(monkeypatch):
    """The CUDA path compiles ``elastic_two_pass`` with COMPILE_OPTIONS; the same compile with a counting
    backend on CPU shows one graph per regime (prefill of one or several blocks, decode, chunked prefill),
    whatever the lengths: decode and variable-length evaluation do not recompile per length."""
    import torch._dynamo

    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(lazy_flex.elastic_two_pass, backend=counting, **lazy_flex.COMPILE_OPTIONS)
    monkeypatch.setattr(lazy_flex, "elastic_two_pass", compiled)
    module = lazy_module(TAUS["mixed"])
    g = torch.Generator().manual_seed(0)
    counts = {}
    for regime, shapes in {
        "prefill-one-block": [(40, 40), (60, 60)],
        "prefill-blocks": [(140, 140), (200, 200), (260, 260)],
        "decode": [(1, 100), (1, 101), (1, 230), (1, 231)],
        "chunked": [(20, 150), (20, 300), (21, 310)],
    }.items():
        before = len(graphs)
        for tq, tk in shapes:
            q = torch.randn(1, 4, tq, 8, dtype=torch.float64, generator=g)
            k, v = (torch.randn(1, 2, tk, 8, dtype=torch.float64, generator=g) for _ in range(2))
            q_pos, k_pos = torch.arange(tk - tq, tk), torch.arange(tk)
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                out = module.flex(q, k, v, hidden=None, q_pos=q_pos, k_pos=k_pos, cache=None).output
                ref = module.reference(q, k, v, hidden=None, q_pos=q_pos, k_pos=k_pos, cache=None).output
            torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-9)
        counts[regime] = len(graphs) - before
    torch._dynamo.reset()
    assert all(n <= 1 for n in counts.values()), counts
