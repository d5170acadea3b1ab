"""Focus hard mode's fast paths against the dense masked reference (model/attention/focus/hard/cpu.py).

- CPU: the sorted-group decomposition on the fused CPU flash kernel, values and gradients, every top_k, balanced /
  skewed / collapsed groups, batch > 1, lengths that are multiples of nothing (37, 300, 700), prefill, chunked prefill
  and decode onto a cache.
- Decode from the per-group index lists of the KV cache, and the module end to end (prefill, then token by token).
- GPU form (two FlexAttention calls) through FlexAttention's eager math implementation on CPU, values and gradients,
  and its block masks checked against the token-level mask (the eager path ignores block sparsity, so coverage is
  tested directly).
- The causal block mask (shared with the soft mode's FlexAttention path) is built once per shape and shared.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from model.attention import KVCache, LayerSpec, build_attention
from model.attention.common import flex as flex_mod
from model.attention.focus import FocusConfig, naive
from model.attention.focus.hard import cpu as focus_hard
from model.attention.focus.hard import decode as focus_hard_decode
from model.attention.focus.hard import decode_host as focus_decode_host
from model.attention.focus.hard.cpu import cpu_hard_attention
from model.attention.focus.hard.decode import GroupLists, cpu_decode_hard_attention, decode_hard_attention
from model.attention.focus.hard.flex import (
    FLEX_BLOCK,
    _group_layout,
    band_block_mask_tensors,
    flex_hard_attention,
    group_block_mask_tensors,
)
from model.attention.focus.naive import membership_bits
from tests.attention.test_suite import cache_chunk, random_inputs

SPEC = LayerSpec(d_model=32, n_heads=4, n_kv_heads=2, head_dim=8, max_seq_len=1024, layer_idx=0, n_layers=1)
SCALE = 1 / math.sqrt(8)


def memberships(kind: str, b: int, t: int, n_groups: int, top_k: int, seed: int) -> torch.Tensor:
    """[B, T] bitmasks: balanced (round-robin groups, shuffled), skewed (group 0 largest) or collapsed (~all in 0)."""
    g = torch.Generator().manual_seed(seed)
    noise = torch.rand(b, t, n_groups, generator=g, dtype=torch.float64)
    if kind == "balanced":
        base = torch.arange(t) % n_groups
        groups = torch.stack([base[torch.randperm(t, generator=g)] for _ in range(b)])
        scores = F.one_hot(groups, n_groups).double() * 10 + noise
    elif kind == "skewed":
        scores = torch.linspace(3.0, -3.0, n_groups, dtype=torch.float64) + 2 * noise
    else:  # collapsed: group 0 holds (almost) every token's first choice
        scores = noise
        scores[..., 0] += 5.0
    return membership_bits(scores, top_k)


def dense(q, k, v, bits_q, bits_k, window, q_pos=None):
    """The dense masked reference (rows of queries at q_pos over keys 0..Tk-1)."""
    tk = k.shape[2]
    k_pos = torch.arange(tk)
    q_pos = torch.arange(tk - q.shape[2], tk) if q_pos is None else q_pos
    return naive.hard_attention(q, k, v, bits_q, bits_k, q_pos=q_pos, k_pos=k_pos, window=window, scale=SCALE)


def dense_fn(bits, window):
    return lambda q, k, v: dense(q, k, v, bits, bits, window)


def cpu_fn(bits, window, n_groups, top_k, split="auto"):
    return lambda q, k, v: cpu_hard_attention(
        q, k, v, bits_q=bits, bits_k=bits, window=window, scale=SCALE, n_groups=n_groups, top_k=top_k, split=split
    )


def inputs(b, t, dtype, seed):
    q, k, v, _ = random_inputs(SPEC, b, t, dtype, seed)
    return q * 2.0, k, v  # sharper patterns


def values_and_grads(fn, q, k, v, seed=0):
    q, k, v = (x.clone().requires_grad_(True) for x in (q, k, v))
    out = fn(q, k, v)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    (out * weights).sum().backward()
    return out.detach(), [x.grad for x in (q, k, v)]


def assert_exact32(fast, dense_out, what):
    err = (fast - dense_out).abs().max().item()
    cos = F.cosine_similarity(fast.double().flatten(), dense_out.double().flatten(), dim=0).item()
    assert err <= 1e-5 and f"{cos:.4f}" == "1.0000", f"{what}: max error {err:.3g}, cosine {cos:.6f}"


# ---- CPU kernel path ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n_groups", [3, 4])
@pytest.mark.parametrize("kind", ["balanced", "skewed", "collapsed"])
def test_cpu_path_equals_dense_reference_float32(n_groups, kind):
    shapes = [(2, 37, 8), (3, 300, 16)] + ([(2, 700, 128)] if n_groups == 4 and kind != "skewed" else [])
    for b, t, window in shapes:
        q, k, v = inputs(b, t, torch.float32, seed=t)
        for top_k in range(1, n_groups + 1 if t < 700 else 3):
            bits = memberships(kind, b, t, n_groups, top_k, seed=top_k)
            ref_out, ref_grads = values_and_grads(dense_fn(bits, window), q, k, v)
            fast_out, fast_grads = values_and_grads(cpu_fn(bits, window, n_groups, top_k), q, k, v)
            what = f"K={n_groups} {kind} k={top_k} B={b} T={t} w={window}"
            assert_exact32(fast_out, ref_out, what)
            for name, a, r in zip("qkv", fast_grads, ref_grads):
                scale = r.abs().max().item()
                err = (a - r).abs().max().item()
                assert err <= 1e-5 * max(1.0, scale), f"{what}: d{name} max error {err:.3g} (max |grad| {scale:.3g})"


@pytest.fixture(params=["one-key-block", "key-blocks-of-16"])
def class_keys(request, monkeypatch):
    """The class split's key blocks: one block per read (as at short lengths), or blocks of 16 keys (reads that
    span several blocks, as at long ones)."""
    if request.param == "key-blocks-of-16":
        monkeypatch.setattr(focus_hard, "KEY_BLOCK_MIN", 16)
        monkeypatch.setattr(focus_hard, "KEY_BLOCK_SHARE", 10**6)
    return request.param


@pytest.mark.parametrize("split", ["class", "group"])
@pytest.mark.parametrize("kind", ["balanced", "collapsed"])
def test_cpu_path_gradients_float64(kind, split, class_keys):
    """Both ways of making the group parts disjoint: per query class, and each pair in its lowest shared group."""
    b, t, window, n_groups = 2, 300, 16, 4
    q, k, v = inputs(b, t, torch.float64, seed=5)
    for top_k in range(1, n_groups + 1):
        bits = memberships(kind, b, t, n_groups, top_k, seed=10 + top_k)
        ref_out, ref_grads = values_and_grads(dense_fn(bits, window), q, k, v)
        fast_out, fast_grads = values_and_grads(cpu_fn(bits, window, n_groups, top_k, split), q, k, v)
        torch.testing.assert_close(fast_out, ref_out, atol=1e-12, rtol=0)
        for a, r in zip(fast_grads, ref_grads):
            torch.testing.assert_close(a, r, atol=1e-11, rtol=0)


@pytest.mark.parametrize("split", ["class", "group"])
@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_cpu_path_chunked_prefill_and_decode(top_k, split, class_keys):
    """Queries are the last Tq of the keys (a cache): decode, short chunks, chunks longer than the window."""
    b, t, n_groups = 2, 300, 4
    q, k, v = inputs(b, t, torch.float64, seed=7)
    for kind in ("skewed", "collapsed"):
        bits = memberships(kind, b, t, n_groups, top_k, seed=top_k)
        for window in (1, 16, 128):
            full = dense(q, k, v, bits, bits, window)
            for lo, hi in ((299, 300), (120, 121), (250, 300), (100, 300), (3, 170)):
                chunk = cache_chunk(q, k, v, bits, lo, hi)
                part = cpu_hard_attention(
                    **chunk, window=window, scale=SCALE, n_groups=n_groups, top_k=top_k, split=split
                )
                torch.testing.assert_close(part, full[:, :, lo:hi], atol=1e-12, rtol=0, msg=f"{kind} w={window} {lo}")


# ---- decode from per-group index lists ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "decode,dense_share",
    [(decode_hard_attention, None), (cpu_decode_hard_attention, 2.0), (cpu_decode_hard_attention, 0.0)],
    ids=["gather", "cpu-rows", "cpu-masked-cache"],
)
@pytest.mark.parametrize("top_k", [1, 2, 3])
@pytest.mark.parametrize("kind", ["balanced", "collapsed"])
def test_decode_from_group_lists_equals_dense(top_k, kind, decode, dense_share, monkeypatch):
    """Every decode path against the dense mask; the CPU path both ways: per-group rows (window copy included) and
    one masked call over the cache (taken when the token's groups hold most keys, forced here)."""
    if dense_share is not None:
        monkeypatch.setattr(focus_hard_decode, "DENSE_SHARE", dense_share)
    b, t, n_groups = 2, 200, 4
    q, k, v = inputs(b, t, torch.float64, seed=3)
    bits = memberships(kind, b, t, n_groups, top_k, seed=top_k + 20)
    for window in (1, 16, 400):
        full = dense(q, k, v, bits, bits, window)
        lists = GroupLists(b, n_groups, "cpu", capacity=4)  # small: exercises growth
        lists.append(bits[:, :180])
        for p in range(180, t):
            lists.append(bits[:, p : p + 1])
            out = decode(
                q[:, :, p : p + 1],
                k[:, :, : p + 1],
                v[:, :, : p + 1],
                bits_q=bits[:, p : p + 1],
                bits_k=bits[:, : p + 1],
                lists=lists,
                window=window,
                scale=SCALE,
            )
            torch.testing.assert_close(out, full[:, :, p : p + 1], atol=1e-12, rtol=0, msg=f"w={window} p={p}")
        for bb in range(b):  # the lists hold exactly each group's members in order
            for c in range(n_groups):
                members = torch.nonzero((bits[bb] >> c) & 1).squeeze(1)
                assert lists.members(bb, c, int(lists.count[bb, c])).equal(members)


def run_on_cache(module, q, k, v, hidden, spans, cache) -> torch.Tensor:
    """The module over the token spans [lo, hi) in turn onto ``cache`` (no autograd): outputs joined along T."""
    pos = torch.arange(q.shape[2])
    pieces = []
    with torch.no_grad():
        for lo, hi in spans:
            chunk = dict(hidden=hidden[:, lo:hi], positions=pos[lo:hi], cache=cache)
            pieces.append(module(q[:, :, lo:hi], k[:, :, lo:hi], v[:, :, lo:hi], **chunk).output)
    return torch.cat(pieces, 2)


@pytest.mark.parametrize("top_k", [1, 2])
def test_module_prefill_chunks_and_decode_equal_full_forward(top_k):
    """FocusAttention in hard mode: one forward over T = 260 (fast == reference), then the same tokens as a chunked
    prefill onto a KV cache followed by token-by-token decoding (the group-list path)."""
    cfg = FocusConfig(n_groups=4, window=32, mode="hard", top_k=top_k)
    module = build_attention("focus", cfg, SPEC).eval()
    with torch.no_grad():
        module.centroids.mul_(3.0)
    b, t = 2, 260
    q, k, v, hidden = random_inputs(SPEC, b, t, torch.float32, seed=11)
    pos = torch.arange(t)
    with torch.no_grad():
        module.impl = "reference"
        reference = module(q, k, v, hidden=hidden, positions=pos).output
        module.impl = "auto"
        assert_exact32(module(q, k, v, hidden=hidden, positions=pos).output, reference, "forward")
    cache = KVCache(b, SPEC.n_kv_heads, SPEC.head_dim, t, dtype=torch.float32, device="cpu")
    spans = ((0, 100), (100, 180), *((p, p + 1) for p in range(180, t)))
    cached = run_on_cache(module, q, k, v, hidden, spans, cache)
    assert cache.extra["focus_lists"].length == t
    assert_exact32(cached, reference, "chunked prefill + decode")


@pytest.mark.parametrize("top_k", [1, 2])
def test_host_decode_step_equals_the_tensor_decode_step(top_k, monkeypatch):
    """A CPU hard-mode decode step computes scores -> Sinkhorn -> memberships on host floats
    (``FocusAttention._hard_decode_host``). Against the same module with that path switched off: equal outputs, and
    equal cache contents (Sinkhorn state, assignments, membership words, per-group lists), token after token."""
    cfg = FocusConfig(n_groups=4, window=16, mode="hard", top_k=top_k)
    module = build_attention("focus", cfg, SPEC).eval()
    with torch.no_grad():
        module.centroids.mul_(3.0)
    b, t = 2, 120
    q, k, v, hidden = random_inputs(SPEC, b, t, torch.float32, seed=5)
    host_calls = []
    original = type(module)._hard_decode_host

    def spy(self, *args, **kwargs):
        host_calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(type(module), "_hard_decode_host", spy)
    caches, outs = [], []
    for host in (True, False):
        if not host:
            monkeypatch.setattr(type(module), "_host_decodes", lambda self, *args: False)
        cache = KVCache(b, SPEC.n_kv_heads, SPEC.head_dim, t, dtype=torch.float32, device="cpu")
        outs.append(run_on_cache(module, q, k, v, hidden, ((0, 64), *((p, p + 1) for p in range(64, t))), cache))
        caches.append(cache)
    assert len(host_calls) == t - 64, "every decode step after the prefill takes the host path"
    assert_exact32(outs[0], outs[1], "host decode")
    host, tensor = caches
    assert "focus_host" in host.extra and "focus_sinkhorn" not in host.extra  # the state lives on the host
    focus_decode_host.flush(host)  # what any tensor path does first
    torch.testing.assert_close(host.extra["focus_sinkhorn"], tensor.extra["focus_sinkhorn"], atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(host.extra["focus_g"], tensor.extra["focus_g"], atol=1e-5, rtol=0)  # float32 path
    assert host.extra["focus_bits"].equal(tensor.extra["focus_bits"])
    assert host.extra["focus_lists"].pos == tensor.extra["focus_lists"].pos


# ---- GPU form through FlexAttention's eager implementation -------------------------------------------------------
@pytest.mark.parametrize(
    "kind,top_ks",
    [
        ("balanced", (1, 2)),
        ("collapsed", (1, 2)),
        pytest.param("balanced", (3, 4), marks=pytest.mark.slow),  # eager math over k * T slots: ~10 s
    ],
)
def test_flex_form_equals_dense_reference(kind, top_ks, eager_flex_backward):
    b, t, n_groups = 2, 200, 4  # two FlexAttention blocks, the second partial
    for dtype in (torch.float64, torch.float32):
        q, k, v = inputs(b, t, dtype, seed=1)
        for top_k in top_ks if dtype == torch.float64 else top_ks[:1]:
            bits = memberships(kind, b, t, n_groups, top_k, seed=30 + top_k)
            window = 16

            def flex(q, k, v, bits=bits, top_k=top_k, window=window):
                return flex_hard_attention(
                    q,
                    k,
                    v,
                    bits_q=bits[:, -q.shape[2] :],
                    bits_k=bits[:, : k.shape[2]],
                    window=window,
                    scale=SCALE,
                    n_groups=n_groups,
                    top_k=top_k,
                    compiled=False,
                )

            ref_out, ref_grads = values_and_grads(dense_fn(bits, window), q, k, v)
            fast_out, fast_grads = values_and_grads(flex, q, k, v)
            if dtype == torch.float32:
                assert_exact32(fast_out, ref_out, f"{kind} k={top_k}")
                continue
            torch.testing.assert_close(fast_out, ref_out, atol=1e-12, rtol=0)
            for a, r in zip(fast_grads, ref_grads):
                torch.testing.assert_close(a, r, atol=1e-11, rtol=0)
            with torch.no_grad():  # a chunk onto a cache: queries are the last 70 tokens
                torch.testing.assert_close(flex(q[:, :, 130:], k, v), ref_out[:, :, 130:], atol=1e-12, rtol=0)


def _block_sets(kv_num, kv_idx, nq, nk):
    dense_blocks = torch.zeros(kv_num.shape[0], nq, nk, dtype=torch.bool)
    for bb in range(kv_num.shape[0]):
        for i in range(nq):
            dense_blocks[bb, i, kv_idx[bb, 0, i, : kv_num[bb, 0, i]].long()] = True
    return dense_blocks


def _token_blocks(allowed, block):
    """[B, Nq, Nk] token mask -> [B, nq, nk]: (any allowed pair, every pair allowed) per block."""
    b, nq_tok, nk_tok = allowed.shape
    nq, nk = -(-nq_tok // block), -(-nk_tok // block)
    padded = torch.zeros(b, nq * block, nk * block, dtype=torch.bool)
    valid = torch.zeros_like(padded)
    padded[:, :nq_tok, :nk_tok] = allowed
    valid[:, :nq_tok, :nk_tok] = True
    blocks = padded.view(b, nq, block, nk, block)
    any_allowed = blocks.any(4).any(2)
    all_allowed = (blocks | ~valid.view(b, nq, block, nk, block)).all(4).all(2)
    return any_allowed, all_allowed


@pytest.mark.parametrize("n_groups,top_k", [(8, 1), (4, 2), (5, 3)])
def test_group_layout_lists_the_members_in_group_then_position_order(n_groups, top_k):
    """The sort-based layout (no ``nonzero``: its size is read on the host) equals ``nonzero``'s."""
    bits = memberships("skewed", 2, 300, n_groups, top_k, seed=5)
    member = ((bits[:, None, :] >> torch.arange(n_groups)[None, :, None]) & 1).bool()
    nz = member.nonzero().view(2, -1, 3)
    tok, grp = _group_layout(bits, n_groups, top_k)
    assert torch.equal(tok, nz[..., 2]) and torch.equal(grp, nz[..., 1])


@pytest.mark.parametrize("n_groups,top_k,kind", [(8, 1, "balanced"), (4, 2, "skewed"), (4, 1, "collapsed")])
def test_flex_block_masks_cover_the_allowed_pairs_and_skip_the_rest(n_groups, top_k, kind):
    b, t, window = 2, 2000, 128
    bits = memberships(kind, b, t, n_groups, top_k, seed=4)
    for start in (0, 1873):  # a whole sequence, and a chunk onto a cache
        bits_q = bits[:, start:]
        tok_q, grp_q = _group_layout(bits_q, n_groups, top_k)
        tok_k, grp_k = _group_layout(bits, n_groups, top_k)
        pos_q, pos_k = tok_q + start, tok_k
        kvn, kvi, fkvn, fkvi = group_block_mask_tensors(
            grp_q, pos_q, grp_k, pos_k, n_groups=n_groups, n_positions=t, full_ok=top_k == 1
        )
        sq, sk = bits_q.gather(1, tok_q), bits.gather(1, tok_k)
        lower = (torch.ones_like(grp_q) << grp_q) - 1
        allowed = (grp_q[:, :, None] == grp_k[:, None, :]) & (pos_k[:, None, :] <= pos_q[:, :, None])
        allowed &= (sq[:, :, None] & sk[:, None, :] & lower[:, :, None]) == 0
        nq, nk = -(-tok_q.shape[1] // FLEX_BLOCK), -(-tok_k.shape[1] // FLEX_BLOCK)
        partial, full = _block_sets(kvn, kvi, nq, nk), _block_sets(fkvn, fkvi, nq, nk)
        any_allowed, all_allowed = _token_blocks(allowed, FLEX_BLOCK)
        assert not (partial & full).any(), "a block is both partial and full"
        assert not (any_allowed & ~(partial | full)).any(), "an allowed pair lies in a skipped block"
        assert not (full & ~all_allowed).any(), "a full block holds a masked pair"
        if start == 0 and kind == "balanced":  # about 1/K of the causal blocks, not all of them
            causal_blocks = nq * (nq + 1) / 2
            assert (partial | full).sum() / b < 2.5 * causal_blocks / n_groups, (partial | full).sum() / b
            assert full.any(), "blocks inside a group and below the diagonal are full"
        # the band: causal, within the window (the group test is the mask_mod's)
        n, idx = band_block_mask_tensors(t - start, t, window)
        q_p, k_p = torch.arange(start, t), torch.arange(t)
        near = ((q_p[:, None] - k_p[None, :]) >= 0) & ((q_p[:, None] - k_p[None, :]) < window)
        band_any, _ = _token_blocks(near[None], FLEX_BLOCK)
        band = _block_sets(n, idx, -(-(t - start) // FLEX_BLOCK), -(-t // FLEX_BLOCK))
        assert band.equal(band_any), "the band visits exactly the blocks that hold window pairs"


def test_causal_block_mask_is_cached_and_exact():
    for tq, tk in ((300, 300), (1, 300), (77, 700), (128, 256)):
        mask = flex_mod.causal_block_mask(tq, tk, "cpu")
        assert flex_mod.causal_block_mask(tq, tk, "cpu") is mask, "built once per shape"
        nq, nk = -(-tq // 128), -(-tk // 128)
        partial = _block_sets(mask.kv_num_blocks, mask.kv_indices, nq, nk)
        full = _block_sets(mask.full_kv_num_blocks, mask.full_kv_indices, nq, nk)
        q_p, k_p = torch.arange(tk - tq, tk), torch.arange(tk)
        any_allowed, all_allowed = _token_blocks((k_p[None, :] <= q_p[:, None])[None], 128)
        assert not (partial & full).any() and (partial | full).equal(any_allowed) and not (full & ~all_allowed).any()


def test_cpu_path_big_groups_run_in_query_chunks(monkeypatch):
    """A group with more than GROUP_CHUNK members runs as query chunks (diagonal block causal, earlier members
    unmasked), to bound the peak memory: same values and gradients."""
    monkeypatch.setattr(focus_hard, "GROUP_CHUNK", 48)
    b, t, window, n_groups = 2, 300, 16, 4
    q, k, v = inputs(b, t, torch.float64, seed=9)
    bits = memberships("skewed", b, t, n_groups, 1, seed=9)
    ref_out, ref_grads = values_and_grads(dense_fn(bits, window), q, k, v)
    fast_out, fast_grads = values_and_grads(cpu_fn(bits, window, n_groups, 1), q, k, v)
    torch.testing.assert_close(fast_out, ref_out, atol=1e-12, rtol=0)
    for a, r in zip(fast_grads, ref_grads):
        torch.testing.assert_close(a, r, atol=1e-11, rtol=0)


def test_flex_hard_path_computes_about_one_in_k_causal_blocks_at_16k(monkeypatch):
    """Issue 37, item 6: the block sparsity of the GPU hard path, read off the BlockMasks its two FlexAttention calls
    receive (partial + full key blocks per query block), at T = 16384, K = 8, w = 128, groups planted balanced
    (token i in group i % K). Bound: (1/K + 2w/T) of the causal blocks, plus one block row per segment: each of the
    K group segments of the sorted layout and the band's one (the original order) rounds its causal staircase up by
    at most one key block per query block (for w = 128 = the block, a query block's window spans two key blocks)."""
    from model.attention.focus.hard import flex as focus_flex

    t, n_groups, window = 16384, 8, 128
    seen: dict[str, tuple[int, int]] = {}

    def recording(compiled, site):
        def call(q, k, v, *, block_mask, scale, enable_gqa, return_aux):
            full = block_mask.full_kv_num_blocks
            seen[site] = (int(block_mask.kv_num_blocks.sum()), 0 if full is None else int(full.sum()))
            aux = type("Aux", (), {"lse": torch.zeros(q.shape[:3], dtype=torch.float32)})()
            return torch.zeros_like(q), aux  # no attention computed: only the block structure is read

        return call

    monkeypatch.setattr(focus_flex, "flex_attention_fn", recording)
    bits = torch.ones(1, t, dtype=torch.long) << (torch.arange(t) % n_groups)
    q = torch.zeros(1, 1, t, 16)
    flex_hard_attention(
        q, q, q, bits_q=bits, bits_k=bits, window=window, scale=1.0, n_groups=n_groups, top_k=1, compiled=False
    )
    rows = t // FLEX_BLOCK
    causal = rows * (rows + 1) // 2
    group, band = sum(seen["focus_group"]), sum(seen["focus_band"])
    segment_rows = rows  # the K group segments' block rows together (T / K tokens each)
    assert group <= causal / n_groups + segment_rows, (group, causal)
    assert band <= 2 * window / t * causal + rows, (band, causal)
    bound = (1 / n_groups + 2 * window / t) * causal + segment_rows + rows
    assert group + band <= bound, f"{group} + {band} blocks of {causal} causal ones, bound {bound:.0f}"
    assert seen["focus_group"][1] > seen["focus_group"][0], "blocks inside a group below its diagonal are full"


@pytest.mark.parametrize("top_k", [1, pytest.param(2, marks=pytest.mark.slow)])  # a dynamo + AOT trace: ~40 s each
def test_hard_forward_is_one_compiled_graph_without_host_sync(top_k, monkeypatch):
    """Issue 37, items 3 and 6: on CUDA a whole-sequence hard forward of plain inference (eval, no grad) runs as one
    compiled graph (``hard_inference_fn``: scores, Sinkhorn, memberships, both FlexAttention calls, the merge). Here
    the module takes that route on CPU (``gpu_paths_forced``, the device check patched) with the compile made
    ``fullgraph=True`` (any graph break fails) under an ``aot_autograd`` backend that keeps the graph's ATen ops,
    searched for ops that read a device value on the host (a stream synchronisation on CUDA). Two lengths (not
    multiples of the block) share one dynamic-shape graph; values equal the dense reference."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    from model.attention.focus import module as focus_module
    from tests.attention.test_compiled_block import SYNC_OPS

    graphs: list[set[str]] = []

    def record(gm, example_inputs):
        graphs.append({str(node.target).split(".default")[0] for node in gm.graph.nodes if node.op == "call_function"})
        return make_boxed_func(gm.forward)

    backend = aot_autograd(fw_compiler=record)
    compiled = torch.compile(focus_module.hard_inference, backend=backend, fullgraph=True, dynamic=True)
    monkeypatch.setattr(focus_module, "_HARD_INFERENCE", [compiled])
    monkeypatch.setattr(focus_module, "_compiles_whole", lambda q: True)
    spec = LayerSpec(d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, max_seq_len=512, layer_idx=0, n_layers=1)
    torch.manual_seed(0)
    module = build_attention("focus", FocusConfig(mode="hard", top_k=top_k, n_groups=4, window=16), spec).eval()
    reference = build_attention("focus", module.cfg, spec, impl="reference").eval()
    reference.load_state_dict(module.state_dict())
    torch._dynamo.reset()
    with flex_mod.gpu_paths_forced(), torch.no_grad():
        for t in (150, 300):
            g = torch.Generator().manual_seed(t)
            q = torch.randn(2, 4, t, 16, generator=g)
            k, v = (torch.randn(2, 2, t, 16, generator=g) for _ in range(2))
            hidden = torch.randn(2, t, 64, generator=g)
            got = module(q, k, v, hidden=hidden, positions=torch.arange(t)).output
            want = reference(q, k, v, hidden=hidden, positions=torch.arange(t)).output
            assert_exact32(got, want, f"T={t} k={top_k}")
    torch._dynamo.reset()
    assert len(graphs) == 1, f"{len(graphs)} graphs for two lengths (one dynamic-shape graph expected)"
    assert str(torch.ops.higher_order.flex_attention) in graphs[0], "FlexAttention is not in the graph"
    synced = graphs[0] & SYNC_OPS
    assert not synced, f"host synchronisations in the compiled hard forward: {sorted(synced)}"
