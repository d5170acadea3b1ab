"""Focus hard-mode decode over the group page tables (``hard/decode_pages.py``) and its split-KV Triton kernel
(``hard/decode_triton.py``), run on CPU tensors by Triton's interpreter (issue 48, item 4):

- the kernel's parts merged by log-sum-exp equal the torch form and the float64 dense reference (ragged positions
  per sequence, GQA, top_k 1-3, window 0, a window wider than the sequence, a head dim that is no power of two);
  in float32, within float32 error;
- the rows one step reads, counted by the kernel (an atomic add per loaded tile): exactly the keys the token attends
  (the dense hard mask's row), so for groups of equal size at most (top_k^2 / K + window / L) of the cache plus one
  page per group (each key is in top_k groups; (1 / K + window / L) at top_k = 1): at a 1024-row cache, K = 8,
  window 64, 18% of the rows at top_k = 1, where the whole-cache step read them all;
- token by token over 42 decoded tokens (float64, GQA, batch 2, top_k 2; top_k 1 in the slow tier) the module's
  device decode with the kernel equals the CPU (host) decode;
- (slow) the step with the kernel traced ``fullgraph=True``, ``dynamic=False``: one graph for consecutive tokens,
  the kernel one opaque op, no synchronising op.

As tests/attention/focus/test_soft_triton.py: the interpreter must be on when triton is first imported, so these run
in a child pytest over this file with ``TRITON_INTERPRET=1``; run directly with the variable set, the file runs them.
"""

from __future__ import annotations

import pytest
import torch

from model.attention.focus import FocusConfig, naive
from model.attention.focus import module as focus_module
from model.attention.focus.hard import decode_pages, decode_triton
from model.attention.focus.hard.decode_device import device_decode_step
from model.attention.focus.hard.decode_pages import PAGE, build_pages, merge, token_groups, torch_partials
from model.attention.focus.naive import membership_bits
from tests.attention.focus.test_decode_device import SPEC, TOL, _decode, _module
from tests.attention.interpreter import interpreted, numpy_scalars, parent, run_child  # noqa: F401  (autouse)
from tests.attention.test_suite import random_inputs


@parent
def test_kernel_under_the_interpreter():
    """This file's fast tests, in a child pytest with ``TRITON_INTERPRET=1`` set before triton loads (~35 s on 2
    cores: the interpreter runs ~0.3 s per decode step)."""
    run_child(__file__, "not slow")


@parent
@pytest.mark.slow  # ~40 s on 2 cores
def test_kernel_under_the_interpreter_slow():
    """This file's slow interpreted tests (top_k = 1 decode, the step with the kernel under torch.compile)."""
    run_child(__file__, "slow")


def _step_inputs(b, hq, hkv, cap, dim, n_groups, top_k, lengths, window, *, bits=None, seed=0):
    """A cache of ``cap`` rows (noise past each sequence's length), tables of the tokens before each position, the
    token appended: what the step's attention reads."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, 1, dim, generator=g, dtype=torch.float64)
    k_all, v_all = (torch.randn(b, hkv, cap, dim, generator=g, dtype=torch.float64) for _ in "kv")
    g_all = torch.rand(b, cap, n_groups, generator=g, dtype=torch.float64)
    bits_all = membership_bits(g_all, top_k) if bits is None else bits.clone()
    p = (torch.tensor(lengths) - 1).reshape(-1, 1)
    token_g = g_all.gather(1, p[:, :, None].expand(b, 1, n_groups))
    groups = token_groups(token_g, top_k)
    if bits is not None:  # the token's groups from its given word
        groups = torch.stack([torch.nonzero((w >> torch.arange(n_groups)) & 1)[:top_k, 0] for w in bits[:, -1]])
    bits_q = torch.bitwise_left_shift(torch.ones_like(groups), groups).sum(-1, keepdim=True)
    bits_all.scatter_(1, p, bits_q)
    pages = build_pages(bits_all, p.reshape(-1), n_groups, window)
    decode_pages.append(pages, groups, p, bits_all, window)
    return q, k_all, v_all, bits_all, pages, groups, bits_q, p


def _dense(q, k_all, v_all, bits_all, bits_q, lengths, window, scale):
    outs = []
    for i, n in enumerate(lengths):
        outs.append(
            naive.hard_attention(
                q[i : i + 1],
                k_all[i : i + 1, :, :n],
                v_all[i : i + 1, :, :n],
                bits_q[i : i + 1],
                bits_all[i : i + 1, :n],
                q_pos=torch.tensor([n - 1]),
                k_pos=torch.arange(n),
                window=window,
                scale=scale,
            )  # fmt: skip
        )
    return torch.cat(outs)


# (batch, Hq, Hkv, cache rows, head dim, K, top_k, lengths, window, splits)
CASES = {
    "gqa-ragged-k1": (3, 4, 2, 48, 16, 5, 1, [17, 48, 30], 6, 2),
    "gqa-ragged-k2": (3, 4, 2, 48, 16, 5, 2, [17, 48, 30], 6, 3),
    "window0-k3": (2, 2, 1, 40, 16, 6, 3, [40, 23], 0, 2),
    "wide-window-dim24": (2, 3, 3, 64, 24, 4, 2, [30, 64], 100, 1),
}


@interpreted
@pytest.mark.parametrize("case", CASES)
def test_kernel_parts_merge_to_the_dense_reference(case):
    b, hq, hkv, cap, dim, n_groups, top_k, lengths, window, splits = CASES[case]
    q, k_all, v_all, bits_all, pages, groups, bits_q, p = _step_inputs(
        b, hq, hkv, cap, dim, n_groups, top_k, lengths, window, seed=len(case)
    )
    kw = dict(window=window, scale=0.3)
    kernel = merge(*decode_triton.triton_partials(q, k_all, v_all, bits_all, pages, groups, bits_q, p, **kw,
                                                  splits=splits))  # fmt: skip
    torch_form = merge(*torch_partials(q, k_all, v_all, bits_all, pages, groups, bits_q, p, **kw))
    want = _dense(q, k_all, v_all, bits_all, bits_q, lengths, window, 0.3)
    torch.testing.assert_close(kernel, want, **TOL)
    torch.testing.assert_close(torch_form, want, **TOL)


@interpreted
def test_kernel_in_float32_is_within_float32_error_of_the_float64_reference():
    b, hq, hkv, cap, dim, n_groups, top_k, lengths, window, splits = CASES["gqa-ragged-k2"]
    q, k_all, v_all, bits_all, pages, groups, bits_q, p = _step_inputs(
        b, hq, hkv, cap, dim, n_groups, top_k, lengths, window, seed=5
    )
    q32, k32, v32 = (x.float() for x in (q, k_all, v_all))
    outs, lses = decode_triton.triton_partials(q32, k32, v32, bits_all, pages, groups, bits_q, p, window=window,
                                               scale=0.3, splits=splits)  # fmt: skip
    assert outs.dtype == lses.dtype == torch.float32
    want = _dense(q, k_all, v_all, bits_all, bits_q, lengths, window, 0.3)
    torch.testing.assert_close(merge(outs, lses).double(), want, atol=2e-6, rtol=1e-5)


@interpreted
@pytest.mark.parametrize("top_k", [1, 2])
def test_step_reads_only_the_token_groups_pages_and_the_window(top_k, monkeypatch):
    """Groups of equal size (token i in groups i % K .. i + top_k - 1 % K), a full cache of L rows: the kernel loads
    exactly the keys the token attends (each once: a key in two of its groups is read in the lower), which is at
    most (top_k^2 / K + window / L) of the cache plus one page per group: (1 / K + window / L) at top_k = 1."""
    hkv, cap, n_groups, window = 2, 1024, 8, 64
    tokens = torch.arange(cap)
    bits = sum(1 << ((tokens + i) % n_groups) for i in range(top_k))[None]
    q, k_all, v_all, bits_all, pages, groups, bits_q, p = _step_inputs(
        1, 4, hkv, cap, 16, n_groups, top_k, [cap], window, bits=bits
    )
    counter = torch.zeros(1, dtype=torch.long)
    monkeypatch.setattr(decode_triton, "ROWS_READ", [counter])
    kw = dict(window=window, scale=0.25)
    outs, lses = decode_triton.triton_partials(q, k_all, v_all, bits_all, pages, groups, bits_q, p, **kw, splits=4)
    rows = int(counter) / hkv  # per key/value head
    attended = naive.hard_mask(bits_q, bits_all, torch.tensor([cap - 1]), tokens, window).sum().item()
    assert rows == attended, f"read {rows} rows for {attended} attended keys"
    # a group holds top_k / K of the keys (each key is in top_k groups): the top_k / K at top_k = 1
    bound = (top_k * top_k / n_groups + window / cap) * cap + top_k * PAGE
    assert rows <= bound, f"read {rows} of {cap} rows, bound {bound}"
    assert rows / cap < 0.25 * top_k  # the whole-cache step read every row
    want = _dense(q, k_all, v_all, bits_all, bits_q, [cap], window, 0.25)
    torch.testing.assert_close(merge(outs, lses), want, **TOL)


@interpreted
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")  # the prefill's eager FlexAttention
@pytest.mark.parametrize("top_k", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_device_decode_with_the_kernel_equals_the_cpu_decode(top_k, monkeypatch):
    """Token by token: the kernel's decode equals the CPU decode (host assignments, per-group lists), which
    test_decode_device.py holds equal to the dense reference; over the whole generation the kernel reads exactly the
    keys the tokens attend (its row counter against the dense mask's rows, per key head)."""
    calls = []
    counter = torch.zeros(1, dtype=torch.long)
    monkeypatch.setattr(decode_triton, "ROWS_READ", [counter])

    def spy(*args, **kwargs):
        calls.append(1)
        return triton_partials(*args, **kwargs)

    triton_partials = decode_triton.triton_partials
    monkeypatch.setattr(decode_triton, "triton_partials", spy)
    module = _module(FocusConfig(n_groups=4, window=8, mode="hard", top_k=top_k))
    t, prompt = 54, 12  # 42 decoded tokens
    inputs = random_inputs(SPEC, 2, t, torch.float64, seed=top_k)
    cpu, _ = _decode(module, inputs, prompt, forced=False)
    device, cache = _decode(module, inputs, prompt, forced=True)
    assert len(calls) == t - prompt, "every decoded token takes the kernel"
    for i in range(prompt, t):  # token by token
        torch.testing.assert_close(device[:, :, i], cpu[:, :, i], **TOL, msg=lambda m, i=i: f"token {i}: {m}")
    assert cache.extra["focus_pages"].length == t
    bits = cache.extra["focus_bits"][:, :t]
    positions = torch.arange(prompt, t)
    attended = naive.hard_mask(bits[:, prompt:], bits, positions, torch.arange(t), module.cfg.window).sum()
    assert int(counter) == SPEC.n_kv_heads * int(attended)


@interpreted
@pytest.mark.slow  # a dynamo + AOT trace (~8 s); the torch form's trace is in the fast tier (test_decode_device.py)
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_step_with_the_kernel_is_one_static_graph(monkeypatch):
    """``fullgraph=True``, ``dynamic=False`` under an ``aot_autograd`` recorder: one graph for 4 consecutive tokens,
    the kernel one opaque op, no synchronising op or data-dependent shape."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    from tests.attention.test_compiled_block import SYNC_OPS

    graphs: list[set[str]] = []

    def record(gm, example_inputs):
        graphs.append({str(node.target).split(".default")[0] for node in gm.graph.nodes if node.op == "call_function"})
        return make_boxed_func(gm.forward)

    compiled = torch.compile(device_decode_step, backend=aot_autograd(fw_compiler=record), fullgraph=True,
                             dynamic=False)  # fmt: skip
    monkeypatch.setattr(focus_module, "_DECODE_STEP", [compiled])
    monkeypatch.setattr(focus_module, "_compiles_whole", lambda q: True)
    module = _module(FocusConfig(n_groups=4, window=8, mode="hard", top_k=1))
    inputs = random_inputs(SPEC, 2, 36, torch.float64, seed=3)
    torch._dynamo.reset()
    try:
        device, _ = _decode(module, inputs, 32, forced=True)
    finally:
        torch._dynamo.reset()
    reference, _ = _decode(module, inputs, 32, forced=False, impl="reference")
    torch.testing.assert_close(device, reference, **TOL)
    assert len(graphs) == 1, f"{len(graphs)} graphs for 4 consecutive tokens (one static-shape graph expected)"
    assert "focus_triton.decode_partials" in graphs[0], sorted(graphs[0])
    synced = graphs[0] & (SYNC_OPS | {"aten.masked_scatter", "aten.index.Tensor"})
    assert not synced, f"host synchronisations or data-dependent shapes in the decode step: {sorted(synced)}"
