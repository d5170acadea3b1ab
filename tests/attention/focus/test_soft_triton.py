"""Focus soft mode's Triton kernels (model/attention/focus/soft/triton.py) against the float64 dense reference
(``naive.soft_attention``), run on CPU tensors by Triton's interpreter: values and the gradients of q, k, v, g_q, g_k
and lambda, both gates, windows 0, 1 and wider, GQA, lengths that leave ragged last tiles, queries at the end of a
longer key sequence (chunked prefill, context parallelism, decode), K in {2, 4, 8}; float32 within a stated
tolerance; the module's choice of path (``gpu_paths_forced`` + the interpreter: the Triton op, with the loss and
gradients of the FlexAttention path); (slow) the op under torch.compile and the whole compiled block with selective
activation checkpointing keeping the op's output.

As tests/attention/lazy/test_triton.py: the interpreter must be on when triton is first imported, so the kernel
tests run in a child pytest over this file with ``TRITON_INTERPRET=1`` (the fast tier's, and the slow tier's
compiled-block check); run directly with the variable set, the file runs those tests.
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch

from model.attention import LayerSpec, build_attention
from model.attention.common import triton as common
from model.attention.common.flex import gpu_paths_forced
from model.attention.focus import FocusConfig, naive
from model.attention.focus.soft import triton as soft_triton
from tests.attention.interpreter import interpreted, numpy_scalars, parent, run_child  # noqa: F401  (autouse)
from tests.attention.test_suite import random_inputs


@parent
def test_kernels_under_the_interpreter():
    """This file's fast interpreted tests, in a child pytest with ``TRITON_INTERPRET=1`` set before triton loads."""
    run_child(__file__, "not slow")


@parent
@pytest.mark.slow  # dynamo + AOT traces, interpreted: about 40 s on 2 cores
def test_compiled_block_under_the_interpreter():
    """This file's slow interpreted tests (the op and the whole block under torch.compile)."""
    run_child(__file__, "slow")


def make(b, h, hk, tq, tk, d, k_groups, lam, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, tq, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, hk, tk, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, hk, tk, d, generator=g, dtype=torch.float64)
    g_k = torch.softmax(3 * torch.randn(b, tk, k_groups, generator=g, dtype=torch.float64), -1)
    g_q = g_k[:, tk - tq :].clone()  # the queries' own assignments (independent leaves: both gradients checked)
    w = torch.randn(b, h, tq, d, generator=g, dtype=torch.float64)
    return [q, k, v, g_q, g_k, torch.tensor([lam], dtype=torch.float64)], w


def reference(q, k, v, g_q, g_k, lam, *, window, scale, gate):
    rep = q.shape[1] // k.shape[1]
    tq, tk = q.shape[2], k.shape[2]
    return naive.soft_attention(
        q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), g_q, g_k, lam, q_pos=torch.arange(tk - tq, tk),
        k_pos=torch.arange(tk), window=window, scale=scale, gate=gate,
    )  # fmt: skip


def values_and_grads(fn, inputs, w):
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    out = fn(*leaves)
    grads = torch.autograd.grad((out.double() * w).sum(), leaves)
    return [out.double(), *(g.double() for g in grads)]


NAMES = ("out", "dq", "dk", "dv", "dg_q", "dg_k", "dlam")
# (gate, batch, heads, kv heads, Tq, Tk, head dim, K, lambda, window); tiles of 16 positions
CASES = {
    "additive-gqa-ragged-k4": ("additive", 1, 4, 2, 37, 37, 16, 4, 3.0, 5),
    "multiplicative-gqa-ragged-k4": ("multiplicative", 1, 4, 2, 37, 37, 16, 4, 3.0, 5),
    "additive-window0-k8-offset": ("additive", 1, 2, 1, 20, 45, 16, 8, 6.0, 0),  # queries at 25 .. 44
    "multiplicative-window1-k2-offset": ("multiplicative", 1, 2, 1, 7, 29, 24, 2, -4.0, 1),  # head dim 24 -> 32
    "additive-window-past-tile-k2": ("additive", 1, 2, 2, 40, 40, 16, 2, 12.0, 20),  # lambda at the schedule's end
    "multiplicative-decode-k8-batch2": ("multiplicative", 2, 2, 1, 1, 33, 16, 8, 2.0, 3),
}


# (block_m query rows, block_n keys): tile shapes move the causal and window masks and the ragged edges across tiles
TILES = {"16x16": (16, 16), "32x16": (32, 16), "16x32": (16, 32)}


@interpreted
@pytest.mark.parametrize("tiles", TILES)
@pytest.mark.parametrize("case", CASES)
def test_matches_float64_reference(case, tiles):
    gate, b, h, hk, tq, tk, d, k_groups, lam, window = CASES[case]
    inputs, w = make(b, h, hk, tq, tk, d, k_groups, lam)
    opts = dict(window=window, scale=1.0 / math.sqrt(d), gate=gate)
    got = values_and_grads(lambda *x: soft_triton.triton_soft_attention(*x, **opts, tiles=TILES[tiles]), inputs, w)
    want = values_and_grads(lambda *x: reference(*x, **opts), inputs, w)
    for name, a, e in zip(NAMES, got, want):
        assert a.shape == e.shape, name
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-10, msg=lambda m, name=name: f"{case} {tiles} {name}: {m}")


@interpreted
@pytest.mark.parametrize("gate", ["additive", "multiplicative"])
def test_float32_within_tolerance(gate):
    """float32 inputs (float32 accumulators, ieee dots, the gate in float32) against the float64 reference: within
    2e-5 (measured about 1e-6)."""
    inputs, w = make(1, 2, 1, 29, 29, 16, 4, 3.0)
    opts = dict(window=5, scale=0.25, gate=gate)
    got = values_and_grads(lambda *x: soft_triton.triton_soft_attention(*x, **opts), [x.float() for x in inputs], w)
    want = values_and_grads(lambda *x: reference(*x, **opts), inputs, w)
    for name, a, e in zip(NAMES, got, want):
        torch.testing.assert_close(a, e, rtol=2e-5, atol=2e-5, msg=lambda m, name=name: f"{name}: {m}")


SPEC = LayerSpec(d_model=32, n_heads=4, n_kv_heads=2, head_dim=16, max_seq_len=256, layer_idx=0, n_layers=1)


def focus_module(gate: str) -> torch.nn.Module:
    torch.manual_seed(0)
    module = build_attention("focus", FocusConfig(window=6, gate=gate, lambda_init=4.0), SPEC).double().train()
    with torch.no_grad():
        module.centroids.mul_(3.0)  # the gate varies across pairs
    return module


@interpreted
def test_module_takes_the_triton_op_with_the_flex_paths_loss_and_gradients(eager_flex_backward, monkeypatch):
    """Inside ``gpu_paths_forced`` with the interpreter on, the soft forward goes through the Triton op (counted),
    and its output, aux loss and every gradient (q, k, v, hidden, w_g, centroids, lambda) equal the FlexAttention
    path's (``soft_kernel = "flex"``, eager FlexAttention's backward) and the dense reference's."""
    calls = []
    original = soft_triton.triton_soft_attention

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(soft_triton, "triton_soft_attention", counted)
    module = focus_module("additive")  # the kernel tests above cover both gates
    q, k, v, hidden = random_inputs(SPEC, 1, 40, torch.float64, 1)
    pos = torch.arange(40)
    results = {}
    for kernel in ("auto", "flex", "reference"):
        module.soft_kernel, module.impl = ("flex", "reference") if kernel == "reference" else (kernel, "auto")
        xs = [x.clone().requires_grad_(True) for x in (q, k, v, hidden)]
        module.zero_grad(set_to_none=True)
        with gpu_paths_forced():
            assert module.soft_triton_supports(q) == (kernel == "auto")
            out = module(*xs[:3], hidden=xs[3], positions=pos)
        weights = torch.linspace(-1, 1, out.output.numel(), dtype=out.output.dtype).view_as(out.output)
        loss = (out.output * weights).sum() + out.aux_loss
        loss.backward()
        grads = [x.grad for x in xs] + [p.grad for p in module.parameters()]
        results[kernel] = [loss.detach(), out.output.detach(), *grads]
        assert len(calls) == 1  # the first pass only
    for other in ("flex", "reference"):
        for a, e in zip(results["auto"], results[other]):
            torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-11, msg=lambda m, other=other: f"{other}: {m}")


@interpreted
@pytest.mark.slow  # a dynamo + AOT trace (about 7 s); the compiled block below traces the op too
def test_op_compiles_as_one_graph():
    """Under torch.compile (fullgraph) the kernels are two custom ops: one graph forward and backward, the eager
    gradients."""
    inputs, w = make(1, 2, 1, 20, 20, 16, 4, 3.0)

    def loss(q, k, v, g_q, g_k, lam):
        out = soft_triton.triton_soft_attention(q, k, v, g_q, g_k, lam, window=4, scale=0.25, gate="additive")
        return (out * w).sum()

    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
    leaves = [x.clone().requires_grad_() for x in inputs]
    compiled(*leaves).backward()
    eager = [x.clone().requires_grad_() for x in inputs]
    loss(*eager).backward()
    for a, e in zip(leaves, eager):
        torch.testing.assert_close(a.grad, e.grad, rtol=1e-12, atol=1e-12)


@interpreted
@pytest.mark.slow
def test_compiled_block_traces_the_op_and_keeps_its_output(monkeypatch):
    """tests/attention/test_compiled_block.py's check, for Focus soft through the Triton op (the interpreter and
    ``gpu_paths_forced`` select it on CPU): the block forward and backward are one graph each without host
    synchronisation, the op runs in the forward graph, and selective activation checkpointing keeps its output
    (the backward graph does not re-run it)."""
    from model.attention.focus import module as focus_module_code
    from tests.attention import test_compiled_block as compiled_block

    def not_flex(*args, **kwargs):
        raise AssertionError("the FlexAttention path was taken")

    monkeypatch.setattr(focus_module_code, "flex_soft_attention", not_flex)
    (case,) = [c for c in type(focus_module("additive")).suite_cases() if c.name == "soft-prefix"]
    compiled_block.test_block_forward_backward_is_one_graph_without_host_sync("focus", case, "selective", monkeypatch)


@parent
@pytest.mark.parametrize("capability", [(8, 0), (8, 9), (9, 0), (10, 0)])
def test_tile_configs_per_target(capability):
    """Every kernel has a non-empty preference list per target family whose tiles the kernels accept (powers of two,
    at least 16: ``tl.dot``'s minimum); the defaults take 128-row query tiles in the forward and dq kernels;
    float32 inputs start at the smaller fallbacks; the interpreter takes small tiles."""
    for kernel in soft_triton._LAUNCHED:
        for bd in (64, 128):
            configs = soft_triton.tile_configs(kernel, capability, bd, torch.bfloat16)
            assert configs and len(set(configs)) == len(configs)
            for c in configs:
                for n in (c.block_m, c.block_n):
                    assert n >= 16 and n & (n - 1) == 0, c
                assert c.num_warps in (4, 8) and c.num_stages >= 1
            first = configs[0]
            assert kernel == "_dkv_kernel" or first.block_m == 128
            fp32 = soft_triton.tile_configs(kernel, capability, bd, torch.float32)
            assert fp32 and first not in fp32
    interp = soft_triton.tile_configs("_dq_kernel", None, 128, torch.float64)
    assert interp == [common.INTERPRETER_TILES]


@parent
def test_backward_has_no_atomics():
    """The gate's gradients are tile products written once per row (d a_q in the dq pass, d a_k in the dk/dv pass)."""
    source = inspect.getsource(soft_triton)
    assert "tl.atomic" not in source


@parent
def test_path_choice():
    """CUDA tensors take the Triton op where triton imports, but for inference on fewer than 128 query rows; CPU
    tensors only with the interpreter on inside ``gpu_paths_forced`` (without it the compile tests trace
    FlexAttention); ``soft_kernel = "flex"`` opts out; the op is one of the variant's attention ops (selective
    activation checkpointing keeps its output)."""
    module = focus_module("additive").float()
    q = torch.zeros(1, 4, 16, 16)
    assert not module.soft_triton_supports(q)
    with gpu_paths_forced():
        assert not module.soft_triton_supports(q)
    cuda_q = q.to("meta").as_subclass(_Cuda)
    assert module.soft_triton_supports(cuda_q) == soft_triton.available()
    assert module._soft_takes_triton(cuda_q) == soft_triton.available()
    with torch.no_grad():  # inference on a short query chunk (decode): FlexAttention's split-KV decoding kernel
        assert not module._soft_takes_triton(cuda_q)
        long_q = torch.zeros(1, 4, 128, 16, device="meta").as_subclass(_Cuda)
        assert module._soft_takes_triton(long_q) == soft_triton.available()
    module.soft_kernel = "flex"
    assert not module.soft_triton_supports(cuda_q)
    assert torch.ops.focus_triton.soft_forward.default in type(module).attention_ops()


class _Cuda(torch.Tensor):
    """A meta tensor that says it is on CUDA (the path choice reads only ``is_cuda``, the device type and dtype)."""

    @property
    def is_cuda(self):
        return True


@parent
@pytest.mark.cuda
@pytest.mark.parametrize("gate", ["additive", "multiplicative"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_compiled_kernels_match_reference(dtype, gate):
    """On a GPU (compiled kernels, the default tiles of ``tile_configs``): a ragged length, GQA, K = 8, against the
    float64 reference of the same inputs."""
    tol = {torch.float32: 2e-4, torch.bfloat16: 3e-2}[dtype]
    inputs, w = make(2, 8, 2, 1000, 1000, 128, 8, 4.0)
    inputs, w = [x.cuda() for x in inputs], w.cuda()
    inputs = [x.to(dtype) for x in inputs[:3]] + [x.float() for x in inputs[3:]]
    opts = dict(window=128, scale=128**-0.5, gate=gate)
    got = values_and_grads(lambda *x: soft_triton.triton_soft_attention(*x, **opts), inputs, w)
    want = values_and_grads(lambda *x: reference(*x, **opts), [x.double() for x in inputs], w)
    for name, a, e in zip(NAMES, got, want):
        atol = tol * max(1.0, e.abs().max().item())
        torch.testing.assert_close(a, e, rtol=tol, atol=atol, msg=lambda m, name=name: f"{name}: {m}")
