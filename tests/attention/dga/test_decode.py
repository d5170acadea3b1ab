"""Dynamic Group Attention's static decode step (issue 48, item 4): on the GPU a decoded token runs ``decode_step``
(or ``fold_step`` when it folds a chunk) over whole, fixed buffers with the counts on the device, so the step has
static shapes and no host read (CUDA-graph capturable). Checked on CPU: inside ``gpu_paths_forced`` the cache takes
that step, and it equals the host path token by token and the uncached forward (float64); a fullgraph trace with
``dynamic=False`` over successive steps compiles once and holds no host synchronisation."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

from model.attention import KVCache
from model.attention.common import reference as ref
from model.attention.common.flex import gpu_paths_forced
from model.attention.dga.cached import decode_step, fold_step
from tests.attention.dga.helpers import SMALL, dga, inputs, run
from tests.attention.dga.test_cache import feed

# ATen ops whose result the host reads (as tests/attention/test_compiled_block.py)
SYNC_OPS = {"_local_scalar_dense", "item", "nonzero", "masked_select", "is_nonzero", "equal", "_unique2"}


def per_token(module, q, k, v, hidden, calls, static: bool):
    cache = KVCache(2, 2, 8, q.shape[2], dtype=torch.float64, device="cpu")
    if static:
        with gpu_paths_forced():
            return feed(module, q, k, v, hidden, cache, calls)
    return feed(module, q, k, v, hidden, cache, calls)


@pytest.mark.parametrize("calls", [[13] + [1] * 47, [1] * 60, [3, 20, 1, 1, 9, 1, 8, 16, 1]])
def test_static_decode_equals_the_host_decode_token_by_token_and_the_uncached_forward(calls):
    """Folds included (chunks of 8: a fold every 8 decoded tokens), from a prefill, from nothing, and between
    chunked prefills (the host path's writes keep the device counts)."""
    module = dga(selection="causal", chunk_size=8, **SMALL)
    q, k, v, hidden = inputs(t=60)
    full = run(module, q, k, v, hidden, "auto").output
    module.impl = "auto"
    host = per_token(module, q, k, v, hidden, calls, static=False)
    static = per_token(module, q, k, v, hidden, calls, static=True)
    torch.testing.assert_close(static, host, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(static, full, atol=1e-12, rtol=1e-10)


class Traced:
    """A backend that counts compiles and keeps each forward graph's ATen ops."""

    def __init__(self) -> None:
        self.graphs: list[set[str]] = []
        self.backend = aot_autograd(fw_compiler=self.keep)

    def keep(self, gm: torch.fx.GraphModule, example_inputs: list) -> object:
        self.graphs.append({str(n.target).split(".")[1] for n in gm.graph.nodes if str(n.target).startswith("aten")})
        return make_boxed_func(gm.forward)


def test_decode_and_fold_steps_trace_fullgraph_once_with_static_shapes_and_no_host_read():
    """Three successive decode steps, then two folds a chunk apart, each step function compiled with
    ``fullgraph=True, dynamic=False``: one graph each (the counts live on the device, so no value specialises
    the trace), no host synchronisation op in it, a second layer's module takes the same graph, and the compiled
    steps give the eager ones' outputs."""
    layers = [dga(selection="causal", chunk_size=8, **SMALL) for _ in range(2)]
    q, k, v, hidden = inputs(t=40)
    kx, vx = ref.expand_kv(k, 4), ref.expand_kv(v, 4)
    cache = KVCache(2, 2, 8, 40, dtype=torch.float64, device="cpu")
    feed(layers[0], q, k, v, hidden, cache, [16])  # prefill: chunk 0 not yet folded (position 16 folds it)
    st = cache.extra["dga"]
    twin = {name: (x.clone() if torch.is_tensor(x) else x) for name, x in st.items()}
    traced = {name: Traced() for name in ("decode", "fold")}
    torch._dynamo.reset()
    compiled = {
        "decode": torch.compile(decode_step, backend=traced["decode"].backend, fullgraph=True, dynamic=False),
        "fold": torch.compile(fold_step, backend=traced["fold"].backend, fullgraph=True, dynamic=False),
    }
    eager = {"decode": decode_step, "fold": fold_step}
    for p in range(16, 33):
        kind = "fold" if p % 8 == 0 else "decode"  # positions 16, 24, 32 fold chunks 0, 1, 2
        sl = slice(p, p + 1)
        for fns, state, layer in ((compiled, st, layers[p % 2]), (eager, twin, layers[0])):
            args = (q[:, :, sl], kx[:, :, sl], vx[:, :, sl], state["k"], state["v"], state["q"], state["counts"])
            state["out"] = fns[kind](layer, *args)
        torch.testing.assert_close(st["out"], twin["out"], atol=1e-12, rtol=1e-10)
    torch._dynamo.reset()
    for name, t in traced.items():
        assert len(t.graphs) == 1, f"{name}: {len(t.graphs)} compiles"
        assert not t.graphs[0] & SYNC_OPS, f"{name}: host reads {sorted(t.graphs[0] & SYNC_OPS)}"
