"""Focus hard-mode decode on the device (issue 37, item 4): ``hard/decode_device.py``'s static-shape step, taken on
CPU inside ``gpu_paths_forced`` as on CUDA.

- token by token over a prompt and 42 decoded tokens it equals the float64 dense reference and the CPU decode path
  (top_k 1 and 2, several K, GQA, batch 2), and leaves the cache's Sinkhorn state and membership words as they do
  (the attention here in torch over the group page tables; the Triton kernel's run: test_decode_paged.py);
- the step itself with a different position per sequence (ragged batch) equals the reference per sequence;
- one step traced with ``fullgraph=True`` under an ``aot_autograd`` recorder: no graph break, no op that reads a
  device value on the host or has a data-dependent shape, consecutive tokens share the one static-shape graph (no
  recompile), and the attention gathers pages (no whole-cache SDPA).
"""

from __future__ import annotations

import pytest
import torch

from model.attention import KVCache, LayerSpec, build_attention
from model.attention.common import flex as flex_mod
from model.attention.focus import FocusConfig, naive
from model.attention.focus import module as focus_module
from model.attention.focus.hard.decode_device import device_decode_step
from model.attention.focus.hard.decode_pages import build_pages
from model.attention.focus.naive import membership_bits
from model.attention.focus.sinkhorn import sinkhorn_prefix
from tests.attention.test_suite import random_inputs

SPEC = LayerSpec(d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, max_seq_len=512, layer_idx=0, n_layers=1)  # GQA
TOL = dict(atol=1e-12, rtol=1e-10)  # float64


def _module(cfg: FocusConfig):
    torch.manual_seed(0)
    module = build_attention("focus", cfg, SPEC).eval().double()
    with torch.no_grad():
        module.centroids.mul_(3.0)  # confident assignments: groups differ from token to token
    return module


def _decode(module, inputs, prompt: int, *, forced: bool, impl: str = "auto") -> tuple[torch.Tensor, KVCache]:
    """A prefill of ``prompt`` tokens onto a cache, then one token at a time; the outputs of every token."""
    q, k, v, hidden = inputs
    b, t = q.shape[0], q.shape[2]
    module.impl = impl
    cache = KVCache(b, SPEC.n_kv_heads, SPEC.head_dim, t + 3, dtype=q.dtype, device="cpu")  # room left unused
    pieces = []
    with torch.no_grad():
        for lo, hi in ((0, prompt), *((p, p + 1) for p in range(prompt, t))):
            chunk = dict(hidden=hidden[:, lo:hi], positions=torch.arange(lo, hi), cache=cache)
            if forced:
                with flex_mod.gpu_paths_forced():
                    pieces.append(module(q[:, :, lo:hi], k[:, :, lo:hi], v[:, :, lo:hi], **chunk).output)
            else:
                pieces.append(module(q[:, :, lo:hi], k[:, :, lo:hi], v[:, :, lo:hi], **chunk).output)
    return torch.cat(pieces, 2), cache


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")  # the prefill's eager FlexAttention
@pytest.mark.parametrize(
    "n_groups,top_k,assignment",
    [
        (4, 1, "sinkhorn"),
        (4, 2, "sinkhorn"),
        (3, 1, "softmax"),
        (6, 3, "sinkhorn"),
    ],
)
def test_device_decode_equals_dense_reference_and_cpu_decode(n_groups, top_k, assignment, monkeypatch):
    cfg = FocusConfig(n_groups=n_groups, window=8, mode="hard", top_k=top_k, assignment=assignment)
    module = _module(cfg)
    steps = []

    def spy(*args, **kwargs):
        steps.append(1)
        return device_decode_step(*args, **kwargs)

    monkeypatch.setattr(focus_module, "device_decode_step", spy)
    t, prompt = 56, 14  # 42 decoded tokens, most past the window (8): far keys of the token's groups count
    inputs = random_inputs(SPEC, 2, t, torch.float64, seed=n_groups + top_k)
    reference, ref_cache = _decode(module, inputs, prompt, forced=False, impl="reference")
    cpu, _ = _decode(module, inputs, prompt, forced=False)
    assert not steps, "the CPU path does not take the device step"
    device, cache = _decode(module, inputs, prompt, forced=True)
    assert len(steps) == t - prompt, "every decode token after the prefill takes the device step"
    torch.testing.assert_close(device, reference, **TOL)
    torch.testing.assert_close(device, cpu, **TOL)
    assert "focus_lists" not in cache.extra  # the host lists are the CPU paths'
    assert cache.length == t
    assert cache.extra["focus_bits"][:, :t].equal(ref_cache.extra["focus_bits"][:, :t])
    torch.testing.assert_close(cache.extra["focus_g"][:, :t], ref_cache.extra["focus_g"][:, :t], **TOL)
    if assignment == "sinkhorn":
        torch.testing.assert_close(cache.extra["focus_sinkhorn"], ref_cache.extra["focus_sinkhorn"], **TOL)


@pytest.mark.parametrize("top_k", [1, 2])
def test_device_step_with_a_position_per_sequence_equals_the_reference(top_k):
    """The step itself, three sequences at different lengths in one static-shape cache (q_pos [B]): the new token's
    assignment is the prefix Sinkhorn of its sequence's scores, its word lands at its position, and its output is
    the dense hard reference over that sequence's keys; rows past a sequence's length (filled with noise here) and
    GQA's query heads per key head change nothing."""
    g = torch.Generator().manual_seed(top_k)
    b, cap, n_groups, iters, window, d_model = 3, 48, 5, 10, 6, 32
    lengths = [17, 48, 30]
    q = torch.randn(b, SPEC.n_heads, 1, SPEC.head_dim, generator=g, dtype=torch.float64)
    k_all, v_all = (torch.randn(b, SPEC.n_kv_heads, cap, SPEC.head_dim, generator=g, dtype=torch.float64) for _ in "kv")
    scores = torch.randn(b, cap, n_groups, generator=g, dtype=torch.float64) * 3  # earlier tokens' group scores
    fold = torch.randn(n_groups, d_model, generator=g, dtype=torch.float64)
    hidden = torch.randn(b, 1, d_model, generator=g, dtype=torch.float64)
    token_scores = (hidden.unsqueeze(2) * fold).sum(-1)  # [B, 1, K]
    g_all = torch.rand(b, cap, n_groups, generator=g, dtype=torch.float64)
    bits_all = membership_bits(g_all, top_k)
    state = torch.stack([sinkhorn_prefix(scores[i : i + 1, : n - 1], iters)[1][0] for i, n in enumerate(lengths)])
    q_pos = torch.tensor(lengths) - 1
    kw = dict(iters=iters, top_k=top_k, window=window, scale=0.25)
    pages = build_pages(bits_all, q_pos, n_groups, window)  # each sequence's tokens before its position
    out = device_decode_step(q, k_all, v_all, hidden, fold, q_pos, state, g_all, bits_all, pages, **kw)
    for i, n in enumerate(lengths):
        whole = torch.cat([scores[i : i + 1, : n - 1], token_scores[i : i + 1]], 1)
        g_want, state_want = sinkhorn_prefix(whole, iters)
        torch.testing.assert_close(g_all[i, n - 1], g_want[0, -1], **TOL)
        torch.testing.assert_close(state[i], state_want[0], **TOL)
        bits_q = membership_bits(g_want[:, -1:], top_k)
        assert bits_all[i, n - 1] == bits_q[0, 0]
        want = naive.hard_attention(
            q[i : i + 1], k_all[i : i + 1, :, :n], v_all[i : i + 1, :, :n], bits_q, bits_all[i : i + 1, :n],
            q_pos=torch.tensor([n - 1]), k_pos=torch.arange(n), window=window, scale=0.25,
        )  # fmt: skip
        torch.testing.assert_close(out[i : i + 1], want, **TOL)


# a dynamo + AOT trace of the step: ~5 s alone on 2 cores (9 s beside other work); top_k = 2 (its sort) ~4 s more
# in the slow tier
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("top_k", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_device_decode_step_is_one_static_graph_without_host_sync(top_k, monkeypatch):
    """Through the module (``decode_step_fn`` as on CUDA, here compiled ``fullgraph=True``, ``dynamic=False``, under
    an ``aot_autograd`` backend that keeps the ATen ops): no graph break, none of the ops that read a device value on
    the host or have a data-dependent output shape, and several consecutive tokens (cache lengths) run one graph."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    from tests.attention.test_compiled_block import SYNC_OPS

    graphs: list[set[str]] = []

    def record(gm, example_inputs):
        graphs.append({str(node.target).split(".default")[0] for node in gm.graph.nodes if node.op == "call_function"})
        return make_boxed_func(gm.forward)

    backend = aot_autograd(fw_compiler=record)
    compiled = torch.compile(device_decode_step, backend=backend, fullgraph=True, dynamic=False)
    monkeypatch.setattr(focus_module, "_DECODE_STEP", [compiled])
    monkeypatch.setattr(focus_module, "_compiles_whole", lambda q: True)
    module = _module(FocusConfig(n_groups=4, window=8, mode="hard", top_k=top_k))
    inputs = random_inputs(SPEC, 2, 36, torch.float64, seed=top_k)
    torch._dynamo.reset()
    try:
        device, _ = _decode(module, inputs, 32, forced=True)
    finally:
        torch._dynamo.reset()
    reference, _ = _decode(module, inputs, 32, forced=False, impl="reference")
    torch.testing.assert_close(device, reference, **TOL)
    assert len(graphs) == 1, f"{len(graphs)} graphs for 4 consecutive tokens (one static-shape graph expected)"
    synced = graphs[0] & (SYNC_OPS | {"aten.masked_scatter", "aten.index.Tensor"})
    assert not synced, f"host synchronisations or data-dependent shapes in the decode step: {sorted(synced)}"
    # the attention gathers the token's groups' pages and the window (torch form off CUDA), not the whole cache
    assert {"aten.gather", "aten.bmm"} <= graphs[0], f"no paged attention in the graph: {sorted(graphs[0])}"
    assert not any("scaled_dot_product" in op for op in graphs[0]), "a whole-cache attention call is back"
