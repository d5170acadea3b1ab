"""Lazy attention's Triton kernels (model/attention/lazy/triton.py) against the float64 dense reference, run on CPU
tensors by Triton's interpreter: values and all five gradients (q, k, v, bias table, tau) at lengths that leave
ragged last blocks, both signs of tau (and mixed per head), GQA, queries at an offset, a table shorter than the
context; the reduction scheme (no atomics); the module's choice of path; the op under torch.compile.

The interpreter must be on when triton is first imported (triton.language's own jitted helpers, ``tl.zeros``, are
interpreted only then), and other tests import triton without it (inductor does): so the kernel tests run in a
child pytest over this file with ``TRITON_INTERPRET=1`` (``test_kernels_under_the_interpreter``, about 30 s), and
nothing of the interpreter reaches another test. Run directly with the variable set, the file runs those tests.
"""

from __future__ import annotations

import inspect
import math
import subprocess
import sys
from typing import Any

import pytest
import torch

from model.attention import LayerSpec, build_attention
from model.attention.common import triton as common
from model.attention.common.flex import gpu_paths_forced
from model.attention.lazy import LazyConfig, naive
from model.attention.lazy import triton as lazy_triton
from tests.attention.interpreter import interpreted, numpy_scalars, parent, run_child  # noqa: F401  (autouse)
from tests.conftest import REPO


@parent
def test_kernels_under_the_interpreter():
    """This file's interpreted tests, in a child pytest with ``TRITON_INTERPRET=1`` set before triton is imported."""
    run_child(__file__, timeout=600)


def make(b, h, hk, tq, tk, d, table, taus, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, tq, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, hk, tk, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, hk, tk, d, generator=g, dtype=torch.float64)
    bias = torch.randn(h, table, generator=g, dtype=torch.float64)
    tau = torch.tensor(taus, dtype=torch.float64)
    w = torch.randn(b, h, tq, d, generator=g, dtype=torch.float64)
    return [x.to(dtype) for x in (q, k, v, bias, tau)], w


def reference(q, k, v, bias, tau, scale, last):
    rep = q.shape[1] // k.shape[1]
    tq, tk = q.shape[2], k.shape[2]
    return naive.attention(
        q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), torch.arange(tk - tq, tk), torch.arange(tk),
        bias, tau, scale, last,
    )  # fmt: skip


def values_and_grads(fn, inputs, w):
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    out = fn(*leaves)
    grads = torch.autograd.grad((out.double() * w).sum(), leaves)
    return [out.double(), *(g.double() for g in grads)]


NAMES = ("out", "dq", "dk", "dv", "dbias", "dtau")
# (batch, heads, kv heads, Tq, Tk, head dim, table, tau per head, tiles (block_m, block_n) to run at)
CASES = {
    # ragged last block; table shorter than the context (distances past 15 read the last entry); tau = 1 puts the
    # first query's only weight on the threshold; tau = 0; GQA
    "mixed-gqa-ragged": (2, 4, 2, 37, 37, 16, 16, [1.0, 0.4, -0.5, 0.0], [(16, 16), (32, 16), (16, 32)]),
    "negative-one-pass": (1, 2, 2, 50, 50, 16, 64, [-1.0, -0.05], [(16, 16), (32, 16)]),  # the relu never fires
    "positive-mha": (1, 3, 3, 45, 45, 16, 8, [2.0, 0.3, 1.0], [(32, 32), (32, 16)]),
    # queries at 25 .. 44 (context parallelism, chunked prefill)
    "offset-context-parallel": (2, 4, 1, 20, 45, 16, 64, [-0.3, 0.7, 1.0, -1.0], [(16, 16), (32, 16), (16, 32)]),
    "offset-inside-a-block": (1, 2, 1, 7, 29, 24, 12, [0.5, -0.5], [(16, 16), (16, 32)]),  # head dim 24: padded to 32
    "decode": (2, 2, 1, 1, 33, 16, 16, [1.0, -0.5], [(16, 16), (32, 16)]),
    "one-token": (1, 2, 2, 1, 1, 16, 4, [1.0, -0.5], [(16, 16)]),
    "long-ragged": (1, 2, 1, 200, 200, 16, 200, [0.5, -0.2], [(32, 32), (64, 16)]),
}


@interpreted
@pytest.mark.parametrize("case", CASES)
def test_matches_float64_reference(case):
    """Values and the five gradients equal the float64 reference at every listed tile shape (tile sizes move the
    masking, the ragged edges and the d bias runs)."""
    b, h, hk, tq, tk, d, table, taus, tiles = CASES[case]
    inputs, w = make(b, h, hk, tq, tk, d, table, taus)
    scale, last = 1.0 / math.sqrt(d), table - 1
    want = values_and_grads(lambda *x: reference(*x, scale, last), inputs, w)
    for tile in tiles:
        got = values_and_grads(lambda *x, t=tile: lazy_triton.elastic_triton(*x, scale, last, block=t), inputs, w)
        for name, a, e in zip(NAMES, got, want):
            assert a.shape == e.shape, name
            torch.testing.assert_close(
                a, e, rtol=1e-9, atol=1e-10, msg=lambda m, n=name, t=tile: f"{case} {t} {n}: {m}"
            )


@interpreted
def test_float32_within_tolerance():
    """float32 inputs (float32 accumulators, ieee dots) against the float64 reference."""
    inputs, w = make(2, 4, 2, 37, 37, 16, 16, [1.0, 0.4, -0.5, 0.0])
    scale, last = 0.25, 15
    got = values_and_grads(lambda *x: lazy_triton.elastic_triton(*x, scale, last), [x.float() for x in inputs], w)
    want = values_and_grads(lambda *x: reference(*x, scale, last), inputs, w)
    for name, a, e in zip(NAMES, got, want):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-4, msg=lambda m, name=name: f"{name}: {m}")


@interpreted
def test_forward_without_gradient_skips_u():
    """Without a gradient the forward takes its 3-product form (no u): the same values; u is empty."""
    inputs, _ = make(1, 4, 2, 37, 37, 16, 16, [1.0, 0.4, -0.5, 0.0])
    with torch.no_grad():
        out = lazy_triton.elastic_triton(*inputs, 0.25, 15, block=(32, 16))
    leaves = [x.clone().requires_grad_() for x in inputs]
    torch.testing.assert_close(out, lazy_triton.elastic_triton(*leaves, 0.25, 15, block=(32, 16)).detach())
    ops = torch.ops.lazy_triton.forward
    assert ops(*inputs, 0.25, 15, 32, 16, False)[2].numel() == 0
    assert ops(*inputs, 0.25, 15, 32, 16, True)[2].shape == inputs[0].shape


@parent
def test_saved_and_returned_tensors_stay_in_the_input_dtype():
    """out and u in q's dtype (bf16 here), lse in float32; dq / dk / dv in their inputs' dtypes (the fake kernels
    give the shapes and dtypes the launches allocate)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k, v = (torch.empty(1, h, 64, 32, dtype=torch.bfloat16) for h in (4, 2, 2))
        bias, tau = torch.empty(4, 64), torch.empty(4)
        out, lse, u = torch.ops.lazy_triton.forward(q, k, v, bias, tau, 0.2, 63, 0, 0, True)
        grads = torch.ops.lazy_triton.backward(out, q, k, v, bias, tau, lse, u, 0.2, 63, 0, 0)
    assert (out.dtype, u.dtype, lse.dtype) == (torch.bfloat16, torch.bfloat16, torch.float32)
    assert [g.dtype for g in grads[:3]] == [torch.bfloat16] * 3 and grads[2].shape == v.shape


def _dots(fn: Any, helpers: dict[str, Any]) -> list[tuple[int, int]]:
    """(tile products, of which under an ``if``) in each innermost loop of a kernel, in source order: ``tl.dot``
    calls in the loop body plus those of the helpers it calls."""
    import ast
    import textwrap

    def tree(f):
        return ast.parse(textwrap.dedent(inspect.getsource(f)))

    def count(node, conditional):
        total, cond = 0, 0
        for child in ast.iter_child_nodes(node):
            under_if = conditional or isinstance(node, ast.If)
            call = child.func if isinstance(child, ast.Call) else None
            n = 0
            if isinstance(call, ast.Attribute) and call.attr == "dot":
                n = 1
            elif isinstance(call, ast.Name) and call.id in helpers:
                n = count(tree(helpers[call.id]), False)[0]
            inner, inner_cond = count(child, under_if)
            total, cond = total + n + inner, cond + n * under_if + inner_cond
        return total, cond

    loops = [n for n in ast.walk(tree(fn)) if isinstance(n, ast.For)]
    innermost = [n for n in loops if not any(isinstance(m, ast.For) for m in ast.walk(n) if m is not n)]
    return [count(loop, False) for loop in sorted(innermost, key=lambda n: n.lineno)]


@parent
def test_tile_products_per_tile():
    """Issue 47's budget, counted in the kernels' source: the forward does 3 tile products per tile (pass 1 QK only;
    pass 2 QK, w @ v, and 1[w > 0] @ v only when a gradient is needed: 4 then, see the module docstring); a tau <= 0
    head one pass of at most 3; the backward 7 (dq 3 + dk/dv 4, d bias and d tau folded in, no separate pass)."""
    helpers = {name: getattr(lazy_triton, name) for name in lazy_triton._HELPERS}
    counts = {name: _dots(getattr(lazy_triton, name), helpers) for name in lazy_triton._LAUNCHED}
    assert counts == {
        "_fwd_kernel": [(3, 1), (1, 0), (3, 1)],  # one pass (tau <= 0), pass 1, pass 2 (tau > 0)
        "_dq_kernel": [(3, 0)],
        "_dkv_kernel": [(4, 0)],
    }
    assert {k: [n for n, _ in v] for k, v in counts.items()} == {
        k: list(v.values()) for k, v in lazy_triton.TILE_PRODUCTS.items()
    }
    one_pass, pass1, pass2 = counts["_fwd_kernel"]
    assert one_pass[0] <= 3 and pass1[0] + pass2[0] - pass2[1] == 3 and pass1[0] + pass2[0] == 4
    assert counts["_dq_kernel"][0][0] + counts["_dkv_kernel"][0][0] == 7
    assert "_dbias_kernel" not in lazy_triton._LAUNCHED


@parent
def test_tile_configs_per_target():
    """Every kernel has candidates on sm_80 - sm_12x at head dims up to 128 (none before Ampere or past 128): powers
    of two from 16 to 128, the dk/dv kernel's keys no more than its query rows; the interpreter's small tiles; float32
    inputs get the small tiles; fixed tiles (the tests) keep the dk/dv rule."""
    tc = lazy_triton.tile_configs
    for kernel in lazy_triton._LAUNCHED:
        assert tc(kernel, None, 128, torch.bfloat16) == [common.INTERPRETER_TILES]
        assert tc(kernel, (7, 5), 64, torch.float16) == [] and tc(kernel, (9, 0), 256, torch.bfloat16) == []
        for cap in [(8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0)]:
            for bd in (16, 32, 64, 128):
                for dtype in (torch.bfloat16, torch.float16, torch.float32):
                    configs = tc(kernel, cap, bd, dtype)
                    assert configs, (kernel, cap, bd, dtype)
                    for t in configs:
                        assert {t.block_m, t.block_n} <= {16, 32, 64, 128} and t.num_warps in (4, 8)
                        assert kernel != "_dkv_kernel" or t.block_n <= t.block_m
        assert tc(kernel, (9, 0), 128, torch.float32) == [lazy_triton._WIDE_TILES]
    q = torch.zeros(1, 1, 4, 16)
    assert [(t.block_m, t.block_n) for t in lazy_triton._candidates("_dkv_kernel", q, 16, 16, 32)] == [(16, 16)]
    assert [(t.block_m, t.block_n) for t in lazy_triton._candidates("_fwd_kernel", q, 16, 16, 32)] == [(16, 32)]


@parent
def test_backward_has_no_atomics_and_bias_partials_fold_by_distance():
    """d bias and d tau are reduced without atomics. Each key block J writes one run of diagonal sums per (batch,
    head): contiguous distances from ``bases[J]``, long enough for every tile of J (a tile (I, J) spans the distances
    ``I * bm - J * bn - (bn - 1) .. I * bm + bm - 1 - J * bn``), ``bm`` per tile plus ``w - bm``; the runs follow each
    other, and the fold index is the distance clamped to the table."""
    source = inspect.getsource(lazy_triton)
    assert "tl.atomic" not in source
    for p, tq, tk, bm, bn in [(0, 37, 37, 16, 16), (25, 20, 45, 32, 16), (0, 50, 50, 16, 32), (3, 7, 10, 64, 16)]:
        w = 1 << (bm + bn - 2).bit_length()
        starts, bases, lengths = lazy_triton._bias_rows(p, tq, tk, bm, bn, w)
        assert len(starts) == -(-tk // bn) and starts == [sum(lengths[:j]) for j in range(len(starts))]
        i_end = -(-(p + tq) // bm)
        for j, (base, length) in enumerate(zip(bases, lengths)):
            i_start = max(j * bn // bm, p // bm)
            assert length == (i_end - i_start) * bm + w - bm
            for i in range(i_start, i_end):
                assert i * bm - j * bn - (bn - 1) == base + (i - i_start) * bm  # the tile's lowest diagonal
                assert i * bm + bm - 1 - j * bn <= base + length - 1
        last = 9
        index = lazy_triton._bias_index(starts, bases, lengths, last, torch.device("cpu"))
        for start, base, length in zip(starts, bases, lengths):
            expected = [min(max(base + t, 0), last) for t in range(length)]
            assert index[start : start + length].tolist() == expected


def lazy_module(taus, table=16, seed=5):
    spec = LayerSpec(64, 4, 2, 16, max_seq_len=256, layer_idx=0, n_layers=1)
    module = build_attention("lazy", LazyConfig(max_distance=table), spec).double()
    with torch.no_grad():
        module.distance_bias.normal_(0, 2.0, generator=torch.Generator().manual_seed(seed))
        module.tau.copy_(torch.tensor(taus, dtype=torch.float64))
    return module


@interpreted
def test_module_triton_path_matches_reference():
    """The module's ``triton`` path (called directly: CPU tensors never choose it) against its ``reference``."""
    module = lazy_module([1.0, -0.5, 0.3, 0.0])
    (q, k, v, _, _), w = make(2, 4, 2, 21, 40, 16, 16, [0.0] * 4)
    q_pos, k_pos = torch.arange(19, 40), torch.arange(40)
    hidden = torch.zeros(2, 21, 64, dtype=torch.float64)
    results = []
    for path in (module.triton, module.reference):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        module.zero_grad()
        out = path(*leaves, hidden=hidden, q_pos=q_pos, k_pos=k_pos, cache=None).output
        (out * w).sum().backward()
        results.append([out.detach(), *(x.grad for x in leaves), module.distance_bias.grad, module.tau.grad])
    for name, a, e in zip(NAMES, *results):
        torch.testing.assert_close(a, e, rtol=1e-9, atol=1e-10, msg=lambda m, name=name: f"{name}: {m}")


@parent
def test_path_choice_by_device():
    """CUDA tensors take the Triton path where triton imports; CPU tensors never, not under gpu_paths_forced (the
    compile tests trace the FlexAttention path there) either."""
    q = torch.zeros(1, 4, 16, 16)
    module = lazy_module([1.0] * 4).float()
    assert not module.triton_supports(q)
    with gpu_paths_forced():
        assert not module.triton_supports(q)
    assert module.triton_supports(q.to("meta").as_subclass(_Cuda)) == lazy_triton.available()


class _Cuda(torch.Tensor):
    """A meta tensor that says it is on CUDA (the path choice reads only ``is_cuda`` and the dtype)."""

    @property
    def is_cuda(self):
        return True


@interpreted
def test_compiles_as_one_graph():
    """Under torch.compile the kernels are two custom ops (forward, backward): one graph, no break."""
    inputs, w = make(1, 2, 1, 20, 20, 16, 8, [1.0, -0.5])

    def loss(q, k, v, bias, tau):
        return (lazy_triton.elastic_triton(q, k, v, bias, tau, 0.25, 7, block=16) * w).sum()

    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
    leaves = [x.clone().requires_grad_() for x in inputs]
    compiled(*leaves).backward()
    eager = [x.clone().requires_grad_() for x in inputs]
    loss(*eager).backward()
    for a, e in zip(leaves, eager):
        torch.testing.assert_close(a.grad, e.grad, rtol=1e-12, atol=1e-12)


@parent
def test_imports_without_triton():
    """The product imports (and LazyAttention runs its other paths) where triton is missing."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "from model.attention.lazy import triton as t\n"
        "from model.attention.lazy.module import LazyAttention\n"
        "import torch\n"
        "assert not t.available() and t.tl is None\n"
        "assert not LazyAttention.triton_supports(torch.zeros(1, 1, 8, 16))\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=120)


@parent
@pytest.mark.cuda
@pytest.mark.parametrize("shape", [(1000, 1000), (300, 777), (1, 513)], ids=["ragged", "offset", "decode"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_compiled_kernels_match_reference(dtype, shape):
    """On a GPU (compiled kernels, the device's default tiles): a ragged length, GQA, queries at an offset, a clamped
    table, both tau signs, against the float64 reference of the same inputs; and the module takes this path for CUDA
    tensors."""
    tol = {torch.float32: 2e-4, torch.bfloat16: 3e-2}[dtype]
    tq, tk = shape
    inputs, w = make(2, 8, 2, tq, tk, 128, 256, [1.0, 0.5, 0.05, 0.0, -0.05, -0.5, -1.0, 2.0])
    inputs, w = [x.cuda() for x in inputs], w.cuda()
    scale, last = 128**-0.5, 255
    inputs = [x.to(dtype) for x in inputs[:3]] + [x.float() for x in inputs[3:]]  # parameters stay float32
    got = values_and_grads(lambda *x: lazy_triton.elastic_triton(*x, scale, last), inputs, w)
    # the reference of the same (rounded) inputs: what is measured is the kernel's arithmetic
    want = values_and_grads(lambda *x: reference(*x, scale, last), [x.double() for x in inputs], w)
    for name, a, e in zip(NAMES, got, want):
        atol = tol * max(1.0, e.abs().max().item())
        torch.testing.assert_close(a, e, rtol=tol, atol=atol, msg=lambda m, name=name: f"{name}: {m}")
    assert lazy_module([1.0] * 4).cuda().triton_supports(torch.zeros(1, 4, 8, 16, device="cuda"))
