"""Focus soft mode's fast paths against the dense reference (``naive.soft_attention``).

The blockwise CPU path (model/attention/focus/soft/cpu.py), through the module (so gradients reach the centroids,
the group projection and lambda through g): float64 values and gradients within 1e-10, float32 within 1e-5, on a
fixed seed list; both gates, both Sinkhorn scopes, softmax assignment, a window wider than the sequence, batch 2,
grouped KV heads (4 query heads on 2), T not a multiple of the query block (blocks forced small), a scheduled lambda;
chunked prefill and one-token decoding onto a KV cache equal the full forward; the statistics the trainer logs are
the reference's.

The FlexAttention ``score_mod`` (soft/flex.py) on the CPU: forward against the dense gate (training, chunked prefill
and decode shapes), and with lambda folded into the captured vectors, values and gradients (lambda included) through
FlexAttention's eager implementation.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from model.attention import KVCache, LayerSpec, build_attention
from model.attention.common import reference as ref
from model.attention.focus import FocusConfig, naive
from model.attention.focus.soft import cpu as soft_cpu
from model.attention.focus.soft.flex import flex_soft_attention
from tests.attention.test_suite import random_inputs

SPEC = LayerSpec(d_model=32, n_heads=4, n_kv_heads=2, head_dim=8, max_seq_len=256, layer_idx=0, n_layers=1)
SEEDS = (0, 1, 2)
TOL = {torch.float64: dict(atol=1e-10, rtol=1e-10), torch.float32: dict(atol=1e-5, rtol=1e-5)}


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    """Blocks of MIN_BLOCK = 32 query rows here, so T = 75 is three blocks, the last one partial."""
    monkeypatch.setattr(soft_cpu, "BLOCK_ELEMENTS", 1)
    monkeypatch.setattr(soft_cpu, "BLOCK_SHARE", 0)


def module(seed: int, dtype: torch.dtype, **options) -> torch.nn.Module:
    cfg = FocusConfig(**{"window": 8, **options})
    torch.manual_seed(seed)
    m = build_attention("focus", cfg, SPEC).to(dtype)
    with torch.no_grad():  # lambda and the centroids off their initial values, so the gate varies across pairs
        m.centroids.mul_(3.0)
        m.lam.add_(0.7 * seed)
    return m.train()


def run(m, impl: str, inputs: list[torch.Tensor], t: int):
    m.impl = impl
    m.zero_grad(set_to_none=True)
    for x in inputs:
        x.grad = None
    out = m(*inputs[:3], hidden=inputs[3], positions=torch.arange(t))
    weights = torch.linspace(-1, 1, out.output.numel(), dtype=out.output.dtype).view_as(out.output)
    loss = (out.output * weights).sum() + (out.aux_loss if out.aux_loss is not None else 0.0)
    loss.backward()
    grads = {f"input {i}": x.grad.clone() for i, x in enumerate(inputs)}
    grads.update({n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None})
    return out.output.detach(), grads, out.stats


CASES = [
    pytest.param({}, id="additive-prefix"),
    pytest.param({"gate": "multiplicative"}, id="multiplicative-prefix"),
    pytest.param({"sinkhorn_scope": "sequence"}, id="additive-sequence"),
    pytest.param({"gate": "multiplicative", "sinkhorn_scope": "sequence"}, id="multiplicative-sequence"),
    pytest.param({"assignment": "softmax"}, id="additive-softmax"),
    pytest.param({"window": 200}, id="window-wider-than-T"),
    pytest.param({"lambda_learnable": False, "lambda_schedule": "linear"}, id="scheduled-lambda"),
]


PARAMS = [
    pytest.param(*case.values, dtype, seed, id=f"{case.id}-{str(dtype)[6:]}-seed{seed}", marks=marks)
    for case in CASES
    for dtype in (torch.float64, torch.float32)
    for seed in SEEDS
    # the fast tier: every case in float64 and the two gates in float32, on the first seed; the rest is slow
    for marks in [
        () if seed == SEEDS[0] and (dtype == torch.float64 or case.id.endswith("prefix")) else pytest.mark.slow
    ]
]


@pytest.mark.parametrize("options,dtype,seed", PARAMS)
def test_blockwise_equals_the_dense_reference(options, dtype, seed):
    t = 75
    m = module(seed, dtype, **options)
    assert m.has_fast_path(torch.empty(1, 4, t, 8, dtype=dtype), None)
    inputs = [x.requires_grad_(True) for x in random_inputs(SPEC, 2, t, dtype, seed)]
    ref_out, ref_grads, _ = run(m, "reference", inputs, t)
    out, grads, _ = run(m, "auto", inputs, t)
    torch.testing.assert_close(out, ref_out, **TOL[dtype], msg=lambda s, seed=seed: f"seed {seed}: {s}")
    assert grads.keys() == ref_grads.keys()
    expected = {"input 0", "input 1", "input 2", "input 3", "w_g.weight", "centroids"}
    assert expected <= grads.keys() and ("lam" in grads) == m.cfg.lambda_learnable
    for name in ref_grads:
        torch.testing.assert_close(
            grads[name], ref_grads[name], **TOL[dtype], msg=lambda s, n=name, seed=seed: f"seed {seed}, {n}: {s}"
        )


@pytest.mark.parametrize("lam", [-200.0, 400.0])
def test_a_gate_past_the_sigmoids_underflow_uses_logsigmoid(lam):
    q, k, v, hidden = random_inputs(SPEC, 1, 40, torch.float64, 0)
    g = torch.softmax(torch.randn(1, 40, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0)), -1)
    ins = [x.requires_grad_(True) for x in (q, k, v, g, torch.tensor([lam], dtype=torch.float64))]
    m = module(0, torch.float64)
    pos = torch.arange(40)
    results = []

    def dense():
        return naive.soft_attention(
            *ins[:4], ins[3], m.lam, q_pos=pos, k_pos=pos, window=8, scale=m._scale(), gate="additive"
        )

    for fn in (dense, lambda: _soft(m, ins)):
        with torch.no_grad():
            m.lam.fill_(lam)
        for x in ins:
            x.grad = None
        out = fn()
        out.sum().backward()
        results.append([out.detach()] + [x.grad.clone() for x in ins[:4]])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


def _soft(m, ins):
    return soft_cpu.cpu_soft_attention(*ins[:3], ins[3], ins[3], m.lam, window=8, scale=m._scale(), gate="additive")


@pytest.mark.parametrize("gate", ["additive", "multiplicative"])
def test_chunked_prefill_and_decoding_equal_the_full_forward(gate):
    t = 75
    m = module(1, torch.float64, gate=gate).eval()
    q, k, v, hidden = random_inputs(SPEC, 2, t, torch.float64, 5)
    with torch.no_grad():
        full = m(q, k, v, hidden=hidden, positions=torch.arange(t)).output
        cache = KVCache(2, SPEC.n_kv_heads, SPEC.head_dim, t, dtype=torch.float64, device="cpu")
        parts = []
        for lo, hi in ((0, 33), (33, 34), (34, 70), (70, 71), (71, 72), (72, 75)):
            chunk = (q[:, :, lo:hi], k[:, :, lo:hi], v[:, :, lo:hi])
            parts.append(m(*chunk, hidden=hidden[:, lo:hi], positions=torch.arange(lo, hi), cache=cache).output)
    torch.testing.assert_close(torch.cat(parts, 2), full, atol=1e-12, rtol=1e-10)


def test_statistics_are_the_references():
    t = 75
    m = module(0, torch.float32)
    m.collect_stats = True
    inputs = [x.requires_grad_(True) for x in random_inputs(SPEC, 2, t, torch.float32, 0)]
    _, _, ref_stats = run(m, "reference", inputs, t)
    _, _, stats = run(m, "auto", inputs, t)
    assert stats.keys() == ref_stats.keys() and "gate_distant" in stats
    for key in stats:
        torch.testing.assert_close(stats[key], ref_stats[key], atol=0, rtol=0)


def test_fast_path_on_cpu_only_for_float32_and_float64():
    m = module(0, torch.float32)
    assert m.has_fast_path(torch.empty(1, 4, 8, 8), None)
    assert not m.has_fast_path(torch.empty(1, 4, 8, 8, dtype=torch.bfloat16), None)


def test_block_rows_bound_the_block_temporaries(monkeypatch):
    monkeypatch.setattr(soft_cpu, "BLOCK_ELEMENTS", 1 << 20)
    monkeypatch.setattr(soft_cpu, "BLOCK_SHARE", 2)
    assert soft_cpu.block_rows(1, 4, 16384, 16384, 64) == 128  # a [B, H, Bq, T] temporary of twice q's size
    assert soft_cpu.block_rows(1, 4, 1024, 1024, 64) == 256  # 4 MiB
    assert soft_cpu.block_rows(1, 4, 100, 100, 64) == 100  # a short sequence is one block


# ---- FlexAttention (soft/flex.py) ----------------------------------------------------------------------------------
@pytest.mark.parametrize("gate", ["additive", "multiplicative"])
@pytest.mark.parametrize("q_range", [(0, 40), (25, 40), (39, 40)])
def test_soft_flex_score_mod_equals_the_reference_forward(gate, q_range):
    """CPU has no FlexAttention backward: the score_mod is checked forward-only here (training,
    chunked prefill and decode shapes); CUDA compares values and gradients in the shared suite."""
    module = build_attention("focus", FocusConfig(window=6, gate=gate, lambda_init=4.0), SPEC).double()
    q, k, v, hidden = random_inputs(SPEC, 2, 40, torch.float64, 3)
    with torch.no_grad():
        g_all = module.assignments(hidden, None)[0]
        lo, hi = q_range
        q_pos, k_pos = torch.arange(lo, hi), torch.arange(40)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fast = flex_soft_attention(
                q[:, :, lo:hi] * 2, k, v, g_all[:, lo:hi], g_all, module.lam, q_pos, window=6, scale=module._scale(),
                gate=gate,
            )  # fmt: skip
        s = ref.scores(q[:, :, lo:hi] * 2, k, 1 / math.sqrt(8))
        gates, distant = naive.gate_logits(g_all[:, lo:hi], g_all, module.lam, q_pos, k_pos, window=6, gate=gate)
        s = (
            s + torch.where(distant, gates, 0.0)[:, None]
            if gate == "additive"
            else torch.where(distant, s * gates[:, None], s)
        )
        dense = ref.weighted_values(ref.masked_softmax(s, ref.causal_mask(q_pos, k_pos)), v, q.dtype)
    torch.testing.assert_close(fast, dense, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("gate", ["additive", "multiplicative"])
def test_soft_flex_values_and_gradients_with_folded_lambda(gate, eager_flex_backward):
    """The learnable lambda reaches the score_mod only through the captured per-token vectors; eager FlexAttention's
    backward then gives every gradient (q, k, v, hidden, w_g, centroids, lambda) equal to the dense reference's."""
    module = build_attention("focus", FocusConfig(window=16, gate=gate, lambda_init=4.0), SPEC).double()
    q, k, v, hidden = random_inputs(SPEC, 2, 300, torch.float64, 0)
    pos = torch.arange(300)
    results = {}
    for impl in ("reference", "flex"):
        xs = [x.clone().requires_grad_(True) for x in (q, k, v, hidden)]
        module.zero_grad(set_to_none=True)
        if impl == "reference":
            module.impl = "reference"
            out = module(*xs[:3], hidden=xs[3], positions=pos).output
        else:
            g_q, g_k = module.assignments(xs[3], None)
            cfg = module.cfg
            out = flex_soft_attention(
                *xs[:3], g_q, g_k, module.lam, pos, window=cfg.window, scale=module._scale(), gate=cfg.gate
            )
        weights = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
        (out * weights).sum().backward()
        results[impl] = (out.detach(), [x.grad for x in xs], {n: p.grad for n, p in module.named_parameters()})
    (ref_out, ref_grads, ref_pgrads), (out, grads, pgrads) = results["reference"], results["flex"]
    torch.testing.assert_close(out, ref_out, atol=1e-12, rtol=0)
    for a, r in zip(grads, ref_grads):
        torch.testing.assert_close(a, r, atol=1e-11, rtol=0)
    assert pgrads["lam"] is not None and pgrads["lam"].abs() > 0
    for name, r in ref_pgrads.items():
        torch.testing.assert_close(pgrads[name], r, atol=1e-10, rtol=0, msg=name)
