"""The shared suite on a CUDA device (skipped without one): what the CPU suite cannot reach.

- Every variant's fast path (FlexAttention compositions, fused kernels) against its dense reference at T = 300 and
  700 (several 128-token blocks: block skipping, full and partial blocks, a partial last block), values and
  gradients, in float32 (atol 1e-4, rtol 1e-3) and under bf16 autocast. Under autocast both paths take the same
  bf16 inputs and are measured against the float32 reference on those inputs: the fast path's error (relative
  norm) may be at most twice the reference path's own bf16 error plus 1e-2 (a gradient that is mostly
  cancellation has a large bf16 error on either path, so a fixed bound would test the format, not the code).
- Causality (float32, T = 300) and KV-cache generation equal to the full forward (float32) on the device.
"""

from __future__ import annotations

import pytest
import torch

from model.attention import build_attention
from tests.attention.test_suite import CASES, SPEC, random_inputs, tiny_model, variant_config

pytestmark = pytest.mark.cuda  # skipped without a CUDA device (tests/conftest.py)
CUDA = "cuda"
F32_TOL = dict(atol=1e-4, rtol=1e-3)
BF16_SLACK = 1e-2  # relative-norm error allowed beyond twice the reference path's own bf16 error


def _module(name, case, seed):
    module = build_attention(name, variant_config(name, case), SPEC).to(CUDA, torch.float32)
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed)
        for p in module.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype).to(CUDA))
    return module


def _run(module, impl, inputs, positions, autocast: bool):
    module.impl = impl
    module.zero_grad(set_to_none=True)
    xs = [x.detach().clone().requires_grad_(True) for x in inputs]
    with torch.autocast(CUDA, dtype=torch.bfloat16, enabled=autocast):
        out = module(*xs[:3], hidden=xs[3], positions=positions)
        weight = torch.linspace(-1, 1, out.output.numel(), device=CUDA).view_as(out.output)
        loss = (out.output.float() * weight).sum()
        if out.aux_loss is not None:
            loss = loss + out.aux_loss.float()
    loss.backward()
    return out.output.detach().float(), [x.grad.float() if x.grad is not None else None for x in xs]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


@pytest.mark.parametrize("precision", ["float32", "bf16-autocast"])
@pytest.mark.parametrize("t", [300, 700])
@pytest.mark.parametrize("name,case", CASES)
def test_fast_path_matches_reference_on_cuda(name, case, t, precision):
    seed = 1000 + t
    module = _module(name, case, seed)
    inputs = [x.to(CUDA) for x in random_inputs(SPEC, 2, t, torch.float32, seed)]
    if not module.has_fast_path(inputs[0], None):
        pytest.skip(f"{name}/{case.name}: no fast path on CUDA")
    positions = torch.arange(t, device=CUDA)
    if precision == "float32":
        ref_out, ref_grads = _run(module, "reference", inputs, positions, autocast=False)
        fast_out, fast_grads = _run(module, "auto", inputs, positions, autocast=False)
        torch.testing.assert_close(fast_out, ref_out, **F32_TOL)
        for i, (a, b) in enumerate(zip(fast_grads, ref_grads)):
            assert (a is None) == (b is None), f"input {i}: gradient presence differs"
            if a is not None:
                torch.testing.assert_close(a, b, **F32_TOL, msg=lambda m, i=i: f"input {i}: {m}")
        return
    low = [x.to(torch.bfloat16) for x in inputs]
    truth_out, truth_grads = _run(module, "reference", [x.float() for x in low], positions, autocast=False)
    ref_out, ref_grads = _run(module, "reference", low, positions, autocast=True)
    fast_out, fast_grads = _run(module, "auto", low, positions, autocast=True)
    assert torch.isfinite(fast_out).all()
    pairs = [("output", fast_out, ref_out, truth_out)]
    pairs += [(f"input {i} gradient", a, b, c) for i, (a, b, c) in enumerate(zip(fast_grads, ref_grads, truth_grads))]
    for what, fast, ref, truth in pairs:
        assert (fast is None) == (ref is None), f"{what}: presence differs"
        if fast is None or truth is None or float(truth.norm()) == 0.0:
            continue
        err_fast, err_ref = _rel(fast, truth), _rel(ref, truth)
        assert err_fast <= 2 * err_ref + BF16_SLACK, f"{what}: fast {err_fast:.3g}, the reference {err_ref:.3g}"


@pytest.mark.parametrize("name,case", [c for c in CASES if c.values[1].causal])
def test_causality_on_cuda(name, case):
    model = tiny_model(name, case, dtype=torch.float32, max_seq_len=512).to(CUDA)
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 97, (2, 300), generator=g).to(CUDA)
    with torch.no_grad():
        base = model(idx).logits
        for t in (1, 150, 290):
            perturbed = idx.clone()
            perturbed[:, t] = (perturbed[:, t] + 1) % 97
            out = model(perturbed).logits
            assert (out[:, t:] - base[:, t:]).abs().max() > 1e-4, "the perturbation must change later outputs"
            before = (out[:, :t] - base[:, :t]).abs().max().item()
            assert before <= 1e-5, f"{name}/{case.name}: outputs before t={t} changed by {before:.3g}"


@pytest.mark.parametrize("name,case", [c for c in CASES if c.values[1].causal])
def test_kv_cache_generation_matches_full_forward_on_cuda(name, case):
    model = tiny_model(name, case, dtype=torch.float32, max_seq_len=512).to(CUDA)
    prompt = torch.randint(0, 97, (2, 150), generator=torch.Generator().manual_seed(2)).to(CUDA)
    new = 12
    tokens, logits = model.generate(prompt, new, return_logits=True)
    seq, ref_logits = prompt, []
    with torch.no_grad():
        for _ in range(new):
            step = model(seq).logits[:, -1]
            ref_logits.append(step)
            seq = torch.cat([seq, step.argmax(-1, keepdim=True)], dim=1)
    torch.testing.assert_close(logits, torch.stack(ref_logits, 1), atol=1e-3, rtol=1e-3)
    assert torch.equal(tokens, seq), "greedy tokens differ between cached and uncached generation"
