"""Dynamic Group Attention's memory-linear CPU parts form (``cpu.py``) against the dense reference (the module's
and ``naive.py``'s plain functions), values and gradients, and at an offset (context parallelism)."""

from __future__ import annotations

import math

import pytest
import torch

from model.attention.common import reference as ref
from model.attention.dga import cpu, naive
from tests.attention.dga.helpers import dga, inputs, run

PARTS_CASES = [
    dict(selection="causal", chunk_size=8, group_size=2, gamma=0.2, sample_recent=2, sample_random=3),
    dict(selection="causal", chunk_size=7, group_size=3, gamma=0.15, sample_recent=1, sample_random=2),
    dict(selection="causal", chunk_size=8, group_size=4, gamma=0.5, sample_recent=3, sample_random=1),
    dict(selection="sequence", group_size=2, gamma=0.2, sample_recent=2, sample_random=3),
    dict(selection="sequence", group_size=3, gamma=0.3, sample_recent=2, sample_random=3),
]


@pytest.mark.parametrize("impl", ["auto", "gathered"])
@pytest.mark.parametrize("t", [37, 40])
@pytest.mark.parametrize("options", PARTS_CASES, ids=lambda o: f"{o['selection']}-m{o['group_size']}-g{o['gamma']}")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_parts_form_equals_the_dense_reference(options, t, impl, dtype, monkeypatch):
    """The memory-linear parts form (cpu.py; impl "auto" on the CPU) and the gathered form against the dense
    float64 reference: values and gradients for q, k, v, batch 2, GQA, T a multiple of no block (37) or of the chunk
    (40). float64 within 1e-10; float32 within 1e-5 of each tensor's largest magnitude (the float32 reference itself
    is off by about 5e-6 of it). Small groups of chunks and sequence blocks exercise the staircase masks and several
    blocks."""
    monkeypatch.setattr(cpu, "COMPRESSED_ROWS", 16)
    monkeypatch.setattr(cpu, "SEQUENCE_BLOCK", 8)
    calls = []
    forward = cpu._FWD
    monkeypatch.setattr(cpu, "_FWD", lambda *a, **kw: calls.append(1) or forward(*a, **kw))
    weight = torch.randn(2, 4, t, 8, generator=torch.Generator().manual_seed(t), dtype=torch.float64)
    results = []
    for path, dt in (("reference", torch.float64), (impl, dtype)):
        module = dga(**options).to(dt)
        q, k, v, hidden = (x.to(dt).requires_grad_(True) for x in inputs(t=t, seed=t))
        out = run(module, q, k, v, hidden, path)
        (out.output * weight.to(dt)).sum().backward()
        results.append([x.detach().double() for x in (out.output, q.grad, k.grad, v.grad, out.stats["key_ratio"])])
    for name, want, got in zip(("output", "dq", "dk", "dv", "key_ratio"), *results):
        atol = 1e-10 if dtype == torch.float64 else 1e-5 * float(want.abs().max())
        torch.testing.assert_close(got, want, atol=atol, rtol=0, msg=lambda m, name=name: f"{name}: {m}")
    assert bool(calls) == (impl == "auto"), "the CPU training forward takes the parts form"


@pytest.mark.parametrize("options", PARTS_CASES, ids=lambda o: f"{o['selection']}-m{o['group_size']}-g{o['gamma']}")
def test_parts_form_equals_the_naive_functions(options, monkeypatch):
    """The parts form (impl "auto" on the CPU, float64) against ``naive.attention`` over ``naive.masks`` of the
    same compression: the plain dense reference, without the module's reference path."""
    calls = []
    forward = cpu._FWD
    monkeypatch.setattr(cpu, "_FWD", lambda *a, **kw: calls.append(1) or forward(*a, **kw))
    module = dga(**options)
    q, k, v, hidden = inputs(t=37, seed=5)
    out = run(module, q, k, v, hidden, "auto").output
    assert calls, "the CPU forward takes the parts form"
    kx, vx = ref.expand_kv(k, 4), ref.expand_kv(v, 4)
    pos = torch.arange(37)
    comp = module._compress_uncached(q, kx, vx, 36)[0]
    cfg = module.cfg
    raw, agg = naive.masks(comp.focal_pos, comp.members, pos, pos, selection=cfg.selection, chunk_size=cfg.chunk_size)
    want = naive.attention(q, kx, vx, comp.agg_k, comp.agg_v, raw, agg, 1 / math.sqrt(8))
    torch.testing.assert_close(out, want, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("q0", [8, 16, 32])
def test_causal_parts_at_an_offset_are_the_whole_sequences_rows(q0):
    """``cpu.CausalPlan(q0=...)`` (context parallelism: a chunk's queries against the keys before and in it) gives the
    whole-sequence plan's rows from q0 on, values and gradients of q, k, v and the entries, float64."""
    t, c, e = 48, 8, 3
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, t, 4, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(3))
    ck, cv = (torch.randn(1, 2, e * (t // c), 4, generator=gen, dtype=torch.float64, requires_grad=True) for _ in "kv")
    w = torch.randn(1, 2, t, 4, generator=gen, dtype=torch.float64)
    w[:, :, :q0] = 0  # only the rows the offset call computes
    whole = cpu.parts_attention(q, k, v, ck, cv, cpu.CausalPlan(t, c, e, torch.float64), 0.5)
    expect = torch.autograd.grad((whole * w).sum(), (q, k, v, ck, cv))
    part = cpu.parts_attention(q[:, :, q0:], k, v, ck, cv, cpu.CausalPlan(t - q0, c, e, torch.float64, q0=q0), 0.5)
    grads = torch.autograd.grad((part * w[:, :, q0:]).sum(), (q, k, v, ck, cv))
    torch.testing.assert_close(part, whole[:, :, q0:], rtol=1e-12, atol=1e-12)
    for g, x in zip(grads, expect, strict=True):
        torch.testing.assert_close(g, x, rtol=1e-12, atol=1e-12)
