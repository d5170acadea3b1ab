"""What Focus's routing costs in a compiled graph, and its numerics under autocast (issue 48, items 1 and 2).

Counted as ``../shared/measurements/gpu-costs-2026-11-28.md`` counts (its section 0): the CUDA paths taken on CPU
(``gpu_paths_forced``, FlexAttention's device check lifted), ``torch.compile(fullgraph=True)`` under an
``aot_autograd`` backend that records each graph handed to inductor, bf16 autocast; an op is a ``call_function`` node
that is a torch operator and not a view (``getitem``, views, ``detach`` and the host's size arithmetic are no
kernels). Measured when written (2026-11-28, the cost report's baseline -> this change):

- Focus hard inference, one compiled graph (k = 1, K = 8): 254 -> 62 ops; k = 2: 68.
- Focus soft training block with selective checkpointing, FlexAttention path: forward 176 -> 123, backward
  549 -> 226 (the Triton path, under the interpreter: 119 -> 66 and 491 -> 168). The prefix Sinkhorn went from 10
  logcumsumexp + 10 logsumexp + ~30 pointwise ops forward and 30 scans + ~170 ops backward (recompute included) to one
  op each way.

Also here: the counting sort against a stable argsort, and the whole-sequence block mask against the token mask.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch.nn.attention.flex_attention as flex_module
from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
from torch._dynamo.backends.common import aot_autograd
from torch.utils._python_dispatch import TorchDispatchMode

from model.attention import LayerSpec, build_attention
from model.attention.common.flex import gpu_paths_forced
from model.attention.focus import FocusConfig
from model.attention.focus import module as focus_module
from model.attention.focus.hard.flex import (
    FLEX_BLOCK,
    group_layout,
    self_block_mask_tensors,
    whole_band_block_mask_tensors,
)
from model.attention.focus.sinkhorn_op import PREFIX_OP
from tests.attention.focus.test_hard import _block_sets, _token_blocks, memberships

HARD_OPS_BUDGET = 80  # the goal per layer (from 256)
SOFT_FORWARD_OPS = 123  # with this change (FlexAttention path, 2026-11-28); 176 before
SOFT_BACKWARD_OPS = 226  # 549 before
SCANS = ("aten.logcumsumexp", "aten.logsumexp", "aten.cumsum", "aten._logcumsumexp", "aten.log_softmax")


def kernel_ops(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The graph's operator nodes that launch work: no views, getitem, detach or size arithmetic."""
    out = []
    for node in gm.graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(
            target, (torch._ops.OpOverload, torch._ops.HigherOrderOperator)
        ):
            continue
        if isinstance(target, torch._ops.OpOverload) and (
            target.is_view
            or str(target).startswith("aten.sym_")
            or target in (torch.ops.aten.detach.default, torch.ops.aten._unsafe_view.default)
        ):
            continue
        out.append(node)
    return out


def float_inputs(node: torch.fx.Node) -> list[torch.dtype]:
    vals = [a.meta.get("val") for a in node.args if isinstance(a, torch.fx.Node)]
    return [v.dtype for v in vals if isinstance(v, torch.Tensor) and v.dtype.is_floating_point]


def assert_sinkhorn_float32(graphs: list[list[torch.fx.Node]]) -> None:
    """No scan or logsumexp below float32 anywhere; the Sinkhorn op's scores are float32."""
    for nodes in graphs:
        for node in nodes:
            name = str(node.target)
            if name.startswith(SCANS) or "focus_sinkhorn" in name:
                low = [d for d in float_inputs(node) if torch.finfo(d).bits < 32]
                assert not low, f"{name} on {low} (autocast reached the Sinkhorn)"


@pytest.mark.parametrize("top_k", [1, pytest.param(2, marks=pytest.mark.slow)])  # a dynamo + AOT trace: ~8 s each
def test_compiled_hard_inference_is_at_most_80_ops_in_float32_routing(top_k):
    """``hard_inference`` as ``hard_inference_fn`` compiles it (dynamic shapes) under bf16 autocast with bf16 q, k, v:
    one graph for two lengths (so the count holds at any T), at most 80 ops, the Sinkhorn one op on float32 scores,
    no comparison sort for k = 1 (the counting sort; no query-side block transposes)."""
    graphs: list[list[torch.fx.Node]] = []

    def record(gm, example_inputs):
        graphs.append(kernel_ops(gm))
        return make_boxed_func(gm.forward)

    backend = aot_autograd(fw_compiler=record, inference_compiler=record)
    spec = LayerSpec(d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, max_seq_len=4096, layer_idx=0, n_layers=1)
    cfg = FocusConfig(mode="hard", top_k=top_k, n_groups=8, window=16)
    torch.manual_seed(0)
    module = build_attention("focus", cfg, spec).eval()
    torch._dynamo.reset()
    compiled = torch.compile(focus_module.hard_inference, backend=backend, fullgraph=True, dynamic=True)
    with gpu_paths_forced(), torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        for t in (300, 607):
            g = torch.Generator().manual_seed(t)
            q = torch.randn(1, 4, t, 16, generator=g).bfloat16()
            k, v = (torch.randn(1, 2, t, 16, generator=g).bfloat16() for _ in range(2))
            hidden = torch.randn(1, t, 64, generator=g)
            band = focus_module.hard_band(t, cfg.window, q.device)  # as run_hard_inference passes it
            compiled(q, k, v, hidden, module.w_g.weight, module.centroids, cfg, module._scale(), band)
    torch._dynamo.reset()
    assert len(graphs) == 1, f"{len(graphs)} graphs for two lengths"
    names = [str(n.target) for n in graphs[0]]
    assert len(names) <= HARD_OPS_BUDGET, f"{len(names)} ops (budget {HARD_OPS_BUDGET}): {sorted(names)}"
    assert names.count(str(PREFIX_OP)) == 1 and names.count(str(torch.ops.higher_order.flex_attention)) == 2
    if top_k == 1:
        assert not [n for n in names if "sort" in n], "a comparison sort in the k = 1 graph"
    assert_sinkhorn_float32(graphs)


def test_soft_training_block_sinkhorn_is_one_float32_op_each_way(monkeypatch):
    """A Focus soft block (FlexAttention path) compiled forward and backward under bf16 autocast with selective
    checkpointing: the Sinkhorn is ``focus_sinkhorn::prefix`` on float32 scores in the forward and its backward op in
    the backward (its saved state kept: the forward op is not re-run), no scan or logsumexp left, and the op counts
    at most the ones pinned above."""
    from model.config import ModelConfig
    from model.transformer import Transformer
    from tests.attention.test_compiled_block import GraphOps

    monkeypatch.setattr(flex_module, "_validate_device", lambda *args: None)
    cfg = ModelConfig(vocab_size=64, max_seq_len=512, d_model=64, n_layers=1, n_heads=4, n_kv_heads=2)
    cfg.attention.kind = "focus"
    cfg.attention.options["focus"] = FocusConfig(window=8)
    torch.manual_seed(0)
    model = Transformer(cfg).train()
    block = model.blocks[0]
    block.checkpointing = "selective"
    for m in model.modules():
        if isinstance(m, focus_module.FocusAttention):
            m.soft_kernel = "flex"
    graphs: list[list[torch.fx.Node]] = []
    recorder = GraphOps()  # its backward graph is inspected, not run (FlexAttention's CPU math backward)
    recorder.record = lambda gm: graphs.append(kernel_ops(gm))  # type: ignore[method-assign]
    backend = aot_autograd(
        fw_compiler=recorder.forward, bw_compiler=recorder.backward, partition_fn=min_cut_rematerialization_partition
    )  # inductor's partitioner (the default one saves and recomputes differently)
    positions = torch.arange(150)
    x = torch.randn(2, 150, 64, requires_grad=True)
    assert model.rope is not None
    rope = model.rope.cos_sin(positions, x.dtype)
    torch._dynamo.reset()
    compiled = torch.compile(block, backend=backend, fullgraph=True)
    with gpu_paths_forced(), torch.autocast("cpu", dtype=torch.bfloat16):
        out, attn = compiled(x, positions=positions, rope=rope, cache=None)
        loss = out.float().square().mean() + attn.aux_loss
    loss.backward()
    torch._dynamo.reset()
    assert len(graphs) == 2
    forward, backward = ([str(n.target) for n in g] for g in graphs)
    assert forward.count(str(PREFIX_OP)) == 1 and str(PREFIX_OP) not in backward
    assert backward.count("focus_sinkhorn.prefix_backward.default") == 1
    assert not [n for n in forward + backward if n.startswith(("aten.logcumsumexp", "aten.logsumexp"))]
    assert_sinkhorn_float32(graphs)
    assert len(forward) <= SOFT_FORWARD_OPS, f"forward {len(forward)} ops: {sorted(forward)}"
    assert len(backward) <= SOFT_BACKWARD_OPS, f"backward {len(backward)} ops: {sorted(backward)}"


class DtypeRecorder(TorchDispatchMode):
    """(op name, floating input dtypes) of every ATen op run eagerly under it."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, list[torch.dtype]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        dts = [a.dtype for a in args if isinstance(a, torch.Tensor) and a.dtype.is_floating_point]
        self.seen.append((str(func), dts))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("mode,forced", [("soft", False), ("soft", True), ("hard", False), ("hard", True)])
def test_group_scores_and_sinkhorn_stay_float32_under_bf16_autocast(mode, forced, monkeypatch):
    """Eager, every path (CPU, and the GPU paths forced): under bf16 autocast the scores that reach the Sinkhorn,
    every scan and logsumexp of it and the Sinkhorn op are float32 (autocast ran the centroid product in bf16: scores
    off by up to 0.05 at a scale of 11, issue 48); the assignments equal those computed without autocast from the
    same projection to float32 rounding."""
    spec = LayerSpec(d_model=32, n_heads=4, n_kv_heads=2, head_dim=16, max_seq_len=256, layer_idx=0, n_layers=1)
    torch.manual_seed(0)
    module = build_attention("focus", FocusConfig(mode=mode, window=8), spec).eval()
    hidden = torch.randn(2, 40, 32)
    recorder = DtypeRecorder()
    context = gpu_paths_forced() if forced else torch.no_grad()
    with context, torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        with recorder:
            scores = module.group_scores(hidden)
            g = module.assign_whole(scores)
    assert scores.dtype == torch.float32 and g.dtype == torch.float32
    for name, dts in recorder.seen:
        if name.startswith(SCANS) or "focus_sinkhorn" in name:
            assert all(d in (torch.float32, torch.float64) for d in dts), (name, dts)
    assert any(name.startswith(SCANS) or "focus_sinkhorn" in name for name, _ in recorder.seen)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        projected = module.w_g(hidden).float()  # autocast's projection; the rest in float32 without autocast
    with gpu_paths_forced() if forced else torch.no_grad(), torch.no_grad():
        want = module.assign_whole(focus_module.centroid_scores(projected, module.centroids, module.cfg.tau))
    torch.testing.assert_close(g, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("n_groups,top_k", [(8, 1), (5, 2), (4, 3), (62, 1)])
def test_counting_sort_equals_a_stable_argsort(n_groups, top_k):
    """The counting sort's slots (token, group), group starts and each member's destination equal a stable argsort
    of (group, position) over the memberships, on random memberships (batch 3, a length not a multiple of any
    block)."""
    g = torch.Generator().manual_seed(n_groups * 10 + top_k)
    b, t = 3, 301
    scores = torch.rand(b, t, n_groups, generator=g)
    top = torch.topk(scores, top_k, dim=-1).indices
    bits = (torch.ones_like(top) << top).sum(-1)
    lay = group_layout(bits, n_groups, top_k)
    member = ((bits[:, None, :] >> torch.arange(n_groups)[None, :, None]) & 1).bool()  # [B, K, T]
    order = torch.argsort((~member).flatten(1).to(torch.uint8), dim=1, stable=True)[:, : top_k * t]  # K * T + t
    assert torch.equal(lay.tok, order % t) and torch.equal(lay.grp, order // t)
    counts = member.sum(-1)
    assert torch.equal(lay.starts, torch.cumsum(counts, 1) - counts)
    slot_of = torch.full((b, n_groups * t), top_k * t)
    slot_of.scatter_(1, order, torch.arange(top_k * t).expand(b, -1))
    assert torch.equal(lay.dest.flatten(1), slot_of)


@pytest.mark.parametrize("n_groups,top_k,kind", [(8, 1, "balanced"), (4, 2, "skewed"), (4, 1, "collapsed")])
def test_whole_sequence_block_masks_cover_the_allowed_pairs_and_skip_the_rest(n_groups, top_k, kind):
    """The whole-sequence group block mask (packed causal segments) and band structure: no allowed pair in a skipped
    block, no masked pair in a full block, no block visited that holds no allowed pair (before the lowest-shared-group
    rule, which the mask_mod applies), and the band equal to the shape-only reference's."""
    from model.attention.focus.hard.flex import band_block_mask_tensors

    b, t, window = 2, 2000, 128
    bits = memberships(kind, b, t, n_groups, top_k, seed=4)
    lay = group_layout(bits, n_groups, top_k)
    kvn, kvi, fkvn, fkvi = self_block_mask_tensors(lay, full_ok=top_k == 1)
    n = top_k * t
    nb = -(-n // FLEX_BLOCK)
    grp, pos = lay.grp, lay.tok
    same = (grp[:, :, None] == grp[:, None, :]) & (pos[:, None, :] <= pos[:, :, None])
    partial = _block_sets(kvn, kvi, nb, nb)
    full = _block_sets(fkvn, fkvi, nb, nb) if fkvn is not None else torch.zeros_like(partial)
    any_allowed, all_allowed = _token_blocks(same, FLEX_BLOCK)
    assert not (partial & full).any(), "a block is both partial and full"
    assert torch.equal(partial | full, any_allowed), "the visited blocks are exactly those with allowed pairs"
    assert not (full & ~all_allowed).any(), "a full block holds a masked pair"
    if top_k == 1 and kind == "balanced":
        assert full.any()
    n_ref, idx_ref = band_block_mask_tensors(t, t, window)
    n_got, idx_got = whole_band_block_mask_tensors(t, window, device=torch.device("cpu"))
    nbt = -(-t // FLEX_BLOCK)
    assert torch.equal(_block_sets(n_got, idx_got, nbt, nbt), _block_sets(n_ref, idx_ref, nbt, nbt))
    assert torch.equal(n_got.long(), n_ref.long())


def test_fixed_length_buckets_compile_for_cuda_graphs_on_cuda_only(monkeypatch):
    """``hard_inference_fn``: on CUDA a length in ``CUDA_GRAPH_LENGTHS`` gets its own static compile with
    ``mode="reduce-overhead"`` (CUDA graphs); other lengths, and every CPU call, the one dynamic-shape compile."""
    calls: list[dict] = []

    def fake_compile(fn, **kwargs):
        calls.append({"name": fn.__name__, **kwargs})
        return fn

    monkeypatch.setattr(torch, "compile", fake_compile)
    monkeypatch.setattr(focus_module, "_HARD_INFERENCE", [])
    monkeypatch.setattr(focus_module, "_HARD_INFERENCE_GRAPHED", {})
    graphed = focus_module.hard_inference_fn(4096, cuda=True)
    assert focus_module.hard_inference_fn(4096, cuda=True) is graphed
    focus_module.hard_inference_fn(16384, cuda=True)
    dynamic = focus_module.hard_inference_fn(4096, cuda=False)
    assert focus_module.hard_inference_fn(3000, cuda=True) is dynamic
    assert calls == [
        {"name": "hard_inference_4096", "mode": "reduce-overhead", "dynamic": False},
        {"name": "hard_inference_16384", "mode": "reduce-overhead", "dynamic": False},
        {"name": "hard_inference", "dynamic": True},
    ]
    assert graphed.__code__ is not focus_module.hard_inference.__code__  # its own dynamo recompile budget
