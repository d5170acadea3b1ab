"""Dynamic Group Attention's FlexAttention path (``flex.py``): the mask_mod composition against the reference
forward, the causal form's block lists against the pairwise rule, and its trace without a graph break."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.attention.flex_attention as flex_module

from model.attention import LayerSpec, build_attention
from model.attention.common import reference as ref
from model.attention.common.flex import gpu_paths_forced
from model.attention.dga import causal_flex_blocks, flex
from model.attention.dga.config import DGAConfig
from tests.attention.dga.helpers import SMALL, dga, inputs, run


@pytest.mark.parametrize("selection", ["causal", "sequence"])
def test_flex_mask_mod_equals_the_reference_forward(selection):
    """CPU FlexAttention has no backward: the mask_mod composition is checked forward-only here
    (eager flex); on CUDA it is the fast path and the shared suite compares values and gradients."""
    module = dga(selection=selection, chunk_size=8, **SMALL)
    q, k, v, hidden = inputs(t=37)
    kx, vx = ref.expand_kv(k, 4), ref.expand_kv(v, 4)
    pos = torch.arange(37)
    comp, (ck, cv, avail) = module._compress_uncached(q, kx, vx, 36)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = flex.attention(
            q,
            kx,
            vx,
            comp.focal_pos,
            comp.members,
            ck,
            cv,
            avail,
            pos,
            selection=selection,
            chunk_size=8,
            entries_per_chunk=module._entries_per_chunk(),
            scale=module.scale,
        )
    torch.testing.assert_close(out, run(module, q, k, v, hidden, "reference").output, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("t,c,e,n", [(37, 8, 5, 15), (64, 8, 3, 18), (50, 7, 4, 0), (29, 16, 6, 6)])
def test_causal_flex_block_lists_cover_every_visible_pair(t, c, e, n):
    """The CUDA causal form's block mask comes from block arithmetic: every visible pair lies in a listed block,
    and a block marked full holds no invisible pair (checked against the pairwise rule, block size 4)."""
    block = 4
    n_pad = -(-n // block) * block
    listed, full = causal_flex_blocks(t, n, n_pad, c, e, torch.device("cpu"), block=block)
    p = torch.arange(t)[:, None]
    kv = torch.arange(n_pad + t)[None, :]
    r = kv - n_pad
    visible = torch.where(kv < n_pad, (kv < n) & ((kv // e + 2) * c <= p), (r >= 0) & (r <= p) & (r // c >= p // c - 1))
    q_blk, k_blk = p // block, kv // block
    for i in range(listed.shape[0]):
        for j in range(listed.shape[1]):
            pairs = visible[(q_blk[:, 0] == i)][:, k_blk[0] == j]
            if pairs.any():
                assert listed[i, j], (i, j)
            if full[i, j]:
                assert pairs.all() and pairs.shape[1] == block, (i, j)  # a last, partial query block may be full
    assert full.sum() > 0 and (listed & ~full).sum() > 0 and not listed.all()


@pytest.mark.slow
def test_causal_flex_form_traces_without_a_graph_break():
    """The CUDA causal form (block mask from arithmetic, FlexAttention) as dynamo sees it, traced on CPU without
    gradients (FlexAttention has no CPU backward under dynamo): one graph, no break (about 7 s of CPU)."""
    module = dga(selection="causal", chunk_size=8, **SMALL).float()
    q, k, v, _ = (x.float() for x in inputs(t=37))
    kx, vx = ref.expand_kv(k, 4), ref.expand_kv(v, 4)
    _, (ck, cv, _) = module._compress_uncached(q, kx, vx, 36)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        masks = flex.causal_masks(37, ck.shape[2], 8, module._entries_per_chunk(), "cpu")
        explained = torch._dynamo.explain(flex.causal_attention)(q, kx, vx, ck, cv, masks, module.scale)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1


SPEC16 = LayerSpec(d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, max_seq_len=1024, layer_idx=0, n_layers=1)


@pytest.mark.parametrize("t", [pytest.param(400, marks=pytest.mark.slow), 40])  # 400: about 8 s
def test_causal_flex_form_equals_the_dense_reference_values_and_gradients(t, monkeypatch):
    """The GPU causal form (raw-window call + entries call merged by logsumexp, the shared ``prepare_step`` state)
    against the dense float64 reference, values and gradients of q, k, v. FlexAttention's math backward runs on any
    device; only its device check refuses CPU tensors, so the check is lifted here. t = 40: fewer than three
    chunks of 16 at the end see entries; t = 400: several entry blocks and raw blocks, a partial last block."""
    monkeypatch.setattr(flex_module, "_validate_device", lambda *args: None)
    module = build_attention("dga", DGAConfig(chunk_size=16, group_size=4, gamma=0.2), SPEC16).double()
    g = torch.Generator().manual_seed(t)
    q = torch.randn(2, 4, t, 16, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 2, t, 16, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    hidden, pos = torch.zeros(2, t, 64, dtype=torch.float64), torch.arange(t)
    w = torch.randn(2, 4, t, 16, generator=g, dtype=torch.float64)
    with gpu_paths_forced(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step = module.prepare_step(t, torch.device("cpu"))
        assert step is not None and step.masks is not None
        out = module(q, k, v, hidden=hidden, positions=pos, step=step).output
        grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    module.impl = "reference"
    want = module(q, k, v, hidden=hidden, positions=pos).output
    want_grads = torch.autograd.grad((want * w).sum(), (q, k, v))
    torch.testing.assert_close(out, want, atol=1e-12, rtol=1e-10)
    for got, exp in zip(grads, want_grads):
        torch.testing.assert_close(got, exp, atol=1e-11, rtol=1e-9)


@pytest.mark.parametrize("t,c,e", [(700, 64, 9), (1100, 128, 20), (200, 128, 20)])
def test_causal_masks_list_every_visible_pair_and_mark_only_whole_blocks_full(t, c, e):
    """The two BlockMasks the step shares (entries, raw keys), read back from their kv-side block lists: every
    visible pair lies in a listed block, a full block holds only visible pairs, and a listed block is never listed
    twice (eager FlexAttention on CPU evaluates the mask_mod on every pair, so only this checks the lists the GPU
    kernel reads). t = 200, C = 128: no entries yet; t = 1100: two entry blocks, full blocks in both masks."""
    block = flex.FLEX_BLOCK
    n = max(0, (t - 1) // c - 1) * e
    masks = flex.causal_masks(t, n, c, e, "cpu")
    p = torch.arange(t)[:, None]
    kv_e, kv_r = torch.arange(n)[None, :], torch.arange(t)[None, :]
    cases = [(masks.raw, (kv_r <= p) & (kv_r // c >= p // c - 1), t)]
    if n:
        cases.append((masks.entries, (kv_e // e + 2) * c <= p, n))
    else:
        assert masks.entries is None
    n_full = 0
    for mask, visible, tk in cases:
        nk = -(-tk // block)

        def blocks(num, idx, nk=nk):
            out = torch.zeros(-(-t // block), nk, dtype=torch.int64)
            for i in range(out.shape[0]):
                for j in idx[0, 0, i, : num[0, 0, i]].tolist():
                    out[i, j] += 1
            return out

        partial = blocks(mask.kv_num_blocks, mask.kv_indices)
        full = blocks(mask.full_kv_num_blocks, mask.full_kv_indices)
        assert (partial + full).max() <= 1, "a block listed twice"
        for i in range(partial.shape[0]):
            for j in range(nk):
                pairs = visible[i * block : (i + 1) * block, j * block : (j + 1) * block]
                if pairs.any():
                    assert partial[i, j] or full[i, j], (i, j)
                if full[i, j]:
                    assert pairs.all() and pairs.shape[1] == block, (i, j)
        n_full += int(full.sum())
    assert n_full > 0 or t < 1100
