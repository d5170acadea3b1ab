"""The prefix Sinkhorn as one custom op (model/attention/focus/sinkhorn_op.py, issue 48 item 1): values and gradients
of ``focus_sinkhorn::prefix`` against ``sinkhorn_prefix``'s autograd in float64 (the reference), ``gradcheck`` of the
op, the torch form (CPU tensors) here and the Triton kernels under ``TRITON_INTERPRET=1`` in a child pytest (set
before triton loads, as ``test_soft_triton.py`` does), with several position tiles per sequence and a group count
that is not a power of two.
"""

from __future__ import annotations

import torch

from model.attention.focus import sinkhorn_op
from model.attention.focus.sinkhorn import sinkhorn_prefix
from model.attention.focus.sinkhorn_op import prefix_assignments
from tests.attention.interpreter import interpreted, parent, run_child

SHAPES = [(2, 37, 4), (1, 50, 8), (3, 16, 3)]  # under the interpreter: 3, 4 and 1 tiles of 16 positions


def check_against_reference(dtype: torch.dtype, atol: float, shapes: list[tuple[int, int, int]] = SHAPES) -> None:
    g = torch.Generator().manual_seed(0)
    for b, t, k in shapes:
        s = (torch.randn(b, t, k, generator=g, dtype=dtype) * 10).requires_grad_()  # scores as at tau = 0.1
        s64 = s.detach().double().requires_grad_()
        want = sinkhorn_prefix(s64, 10)[0]
        w = torch.randn(want.shape, generator=g, dtype=torch.float64)
        (g_want,) = torch.autograd.grad((want * w).sum(), s64)
        got = sinkhorn_op.sinkhorn_prefix_op(s, 10)
        (g_got,) = torch.autograd.grad((got * w.to(dtype)).sum(), s)
        assert got.dtype == dtype
        torch.testing.assert_close(got.double(), want, atol=atol, rtol=0)
        torch.testing.assert_close(g_got.double(), g_want, atol=atol, rtol=0)


def gradcheck_op(t: int = 21, iters: int = 4) -> None:
    s = (torch.randn(1, t, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 4).requires_grad_()
    assert torch.autograd.gradcheck(lambda x: sinkhorn_op.sinkhorn_prefix_op(x, iters), (s,))


@parent
def test_op_equals_the_reference_values_and_gradients_torch_form():
    assert not sinkhorn_op._triton_runs(torch.zeros(1))  # CPU tensors outside the interpreter: the torch form
    check_against_reference(torch.float64, 1e-12)
    check_against_reference(torch.float32, 5e-6)
    gradcheck_op(21, 4)


@parent
def test_no_state_is_saved_without_a_backward():
    s = torch.randn(1, 9, 4)
    with torch.no_grad():
        _, state = sinkhorn_op._prefix_op(s, 10, False)
    assert state.numel() == 0
    _, state = sinkhorn_op._prefix_op(s, 10, True)
    assert state.shape == (20, 1, 9, 4)


@parent
def test_the_gpu_paths_take_the_op_and_the_cpu_path_the_reference(monkeypatch):
    from model.attention.common import flex

    s = torch.randn(2, 30, 4, dtype=torch.float64)
    calls: list[int] = []
    real = sinkhorn_op._prefix_op
    monkeypatch.setattr(sinkhorn_op, "_prefix_op", lambda x, n, save: calls.append(n) or real(x, n, save))
    plain = prefix_assignments(s, 10)
    assert calls == []
    with flex.gpu_paths_forced():
        forced = prefix_assignments(s, 10)
    assert calls == [10]
    torch.testing.assert_close(forced, plain, atol=1e-13, rtol=0)


@parent
def test_selective_checkpointing_keeps_the_op_and_its_state():
    """The op is one of Focus's ``attention_ops``: selective checkpointing saves its outputs (the assignments and the
    per-iteration state) and the replay does not run it again; gradients equal the plain run's."""
    from model.activation_checkpointing import checkpointed
    from model.attention.common import flex

    s = torch.randn(2, 30, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(2)) * 5
    w = torch.randn(2, 30, 4, dtype=torch.float64)
    runs = []
    calls: list[bool] = []
    real = sinkhorn_op._torch_forward
    with flex.gpu_paths_forced():
        for mode in ("none", "selective"):
            x = s.clone().requires_grad_()

            def fn(x: torch.Tensor) -> torch.Tensor:
                return (prefix_assignments(x, 10) * w).sum()

            sinkhorn_op._torch_forward = lambda *a: calls.append(True) or real(*a)  # type: ignore[assignment]
            try:
                loss = fn(x) if mode == "none" else checkpointed(fn, mode, x)
                calls.clear()
                loss.backward()
            finally:
                sinkhorn_op._torch_forward = real  # type: ignore[assignment]
            assert not calls, f"{mode}: the backward ran the op's forward again"
            runs.append(x.grad)
    torch.testing.assert_close(runs[1], runs[0], atol=1e-14, rtol=0)


@parent
def test_kernels_under_the_interpreter():
    run_child(__file__, timeout=600)


@interpreted
def test_triton_kernels_equal_the_reference_values_and_gradients():
    assert sinkhorn_op._triton_runs(torch.zeros(1))
    check_against_reference(torch.float64, 1e-12)
    check_against_reference(torch.float32, 5e-6, SHAPES[:1])
    gradcheck_op(18, 2)  # two tiles; each check is one interpreted launch
