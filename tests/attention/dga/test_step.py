"""Dynamic Group Attention's per-step work on the GPU path (issue 48, item 3): the block masks and sampled query
offsets are built once per step and shape, outside the blocks, and shared by every layer
(``DynamicGroupAttention.prepare_step``); the compiled block saves the integer focal selection for the backward (no
top-k or sort there) and concatenates no ``[entries; K]`` key list (the raw keys and the entries are two
FlexAttention calls merged by logsumexp). Traced on CPU inside ``gpu_paths_forced`` (FlexAttention's CPU device check
lifted, so its math backward runs)."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch
import torch._dynamo
import torch.nn.attention.flex_attention as flex_module
from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
from torch._dynamo.backends.common import aot_autograd

from model.attention.common import flex as flex_common
from model.attention.common.flex import gpu_paths_forced
from model.attention.dga import flex
from model.attention.dga import module as dga_module
from model.attention.dga.config import DGAConfig
from model.config import ModelConfig
from model.transformer import Transformer

# views, and what only renames a tensor: left out of the op counts
VIEWS = frozenset(
    {"view", "_unsafe_view", "expand", "permute", "transpose", "slice", "select", "unsqueeze", "squeeze", "t"}
    | {"alias", "detach", "reshape", "as_strided", "split", "unbind", "getitem"}
)


def model(n_layers: int = 3) -> Transformer:
    cfg = ModelConfig(vocab_size=64, max_seq_len=512, d_model=64, n_layers=n_layers, n_heads=4, n_kv_heads=4)
    cfg.attention.kind = "dga"
    cfg.attention.options["dga"] = DGAConfig(chunk_size=32, group_size=4, sample_recent=4, sample_random=4)
    torch.manual_seed(0)
    return Transformer(cfg).train()


def test_block_masks_are_built_once_per_step_and_shape_not_per_layer(monkeypatch):
    """Three layers, three training steps at two lengths (forward and backward, selective checkpointing, so every
    block's attention also runs in its recompute): the masks are built once for the shape, ``prepare_step`` is asked
    once per forward, and no layer builds its own; a new length builds once more. FlexAttention itself is stood in
    for (eager on CPU it evaluates the mask_mod densely, seconds per call); its values are test_flex.py's."""

    def stand_in(compiled, site):
        def call(q, k, v, *, block_mask, scale, return_aux):
            assert block_mask is not None
            return q * scale + 0 * (k.sum() + v.sum()), SimpleNamespace(lse=q.new_zeros(q.shape[:-1]))

        return call

    monkeypatch.setattr(flex, "flex_attention_fn", stand_in)
    monkeypatch.setattr(flex_common, "_CACHE", {})
    builds, prepared = [], []
    real_build, real_prepare = flex.causal_masks, dga_module.DynamicGroupAttention.prepare_step
    monkeypatch.setattr(flex, "causal_masks", lambda *a, **kw: builds.append(a[0]) or real_build(*a, **kw))

    def prepare(self, seq_len, device):
        prepared.append(seq_len)
        return real_prepare(self, seq_len, device)

    monkeypatch.setattr(dga_module.DynamicGroupAttention, "prepare_step", prepare)
    net = model()
    net.activation_checkpointing = "selective"
    with gpu_paths_forced(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for t in (70, 70, 40):
            idx = torch.randint(0, 64, (2, t))
            net(idx, targets=idx, return_logits=False).loss_sum.backward()
    assert prepared == [70, 70, 40], "prepare_step: once per forward"
    assert builds == [70, 40], "block masks: once per shape, never per layer or per recompute"


class Graphs:
    """An ``aot_autograd`` backend keeping every forward and backward graph (min-cut partitioner, as inductor)."""

    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []
        self.backend = aot_autograd(
            fw_compiler=self.keep, bw_compiler=self.keep, partition_fn=min_cut_rematerialization_partition
        )

    def keep(self, gm: torch.fx.GraphModule, example_inputs: list) -> object:
        self.graphs.append(gm)
        return make_boxed_func(gm.forward)


def op_name(node: torch.fx.Node) -> str:
    parts = str(node.target).split(".")
    return parts[1] if parts[0] == "aten" else str(node.target).split(" ")[-1].strip("<>")


def ops(gm: torch.fx.GraphModule) -> list[str]:
    return [op_name(n) for n in gm.graph.nodes if n.op == "call_function" and op_name(n) not in VIEWS]


@pytest.mark.slow  # a dynamo + AOT trace of a block with its backward: about 10 s on 2 cores
def test_compiled_block_saves_the_selection_and_copies_no_key_list(monkeypatch):
    """One layer of a two-layer model compiled as the engines compile it (per block, selective checkpointing
    inside), the shared step passed in: the forward graph builds no block mask and draws no sample (no sort, no
    top-k of its own: the selection is the one ``dga::focal_order``); the backward recomputes no selection (no
    top-k, sort or ``focal_order``: its output is saved) and re-runs no FlexAttention forward; no graph
    concatenates keys along the sequence (a ``[entries; K]`` list would be longer than T)."""
    monkeypatch.setattr(flex_module, "_validate_device", lambda *args: None)
    t = 200
    net = model(n_layers=2)
    net.activation_checkpointing = "selective"
    graphs = Graphs()
    torch._dynamo.reset()
    for block in net.blocks:
        block.compile(backend=graphs.backend, fullgraph=True)
    idx = torch.randint(0, 64, (2, t))
    with gpu_paths_forced(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        net(idx, targets=idx, return_logits=False).loss_sum.backward()
    torch._dynamo.reset()
    assert len(graphs.graphs) == 2, "one forward and one backward graph, shared by both blocks"
    forward, backward = (ops(gm) for gm in graphs.graphs)
    assert forward.count("dga.focal_order.default") == 1 and forward.count("flex_attention") == 2
    for name in ("sort", "topk", "argsort"):
        assert name not in forward and name not in backward, name
    assert "dga.focal_order.default" not in backward and "flex_attention" not in backward
    assert backward.count("flex_attention_backward") == 2
    for gm in graphs.graphs:
        for node in gm.graph.nodes:
            if node.op == "call_function" and op_name(node) == "cat":
                shape = node.meta["val"].shape
                assert len(shape) < 3 or shape[2] <= t, f"a key list of {shape[2]} rows is built"
