"""Dynamic Group Attention's FlexAttention path (``flex.py``): the mask_mod composition against the reference
forward, the causal form's block lists against the pairwise rule, and its trace without a graph break."""

from __future__ import annotations

import warnings

import pytest
import torch

from model.attention.common import reference as ref
from model.attention.dga import causal_flex_blocks, flex
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
        explained = torch._dynamo.explain(flex.causal_attention)(
            q,
            kx,
            vx,
            ck,
            cv,
            torch.arange(37),
            chunk_size=8,
            entries_per_chunk=module._entries_per_chunk(),
            scale=module.scale,
        )
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1
