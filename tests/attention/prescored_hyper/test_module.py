"""Pre-scored HyperAttention, the module: convergence to exact attention, the fast path against the dense
reference (``naive``), the fallback, the cached past, and option errors. The key scorers: ``test_scoring.py``."""

from __future__ import annotations

import math

import pytest
import torch

from core.errors import ConfigError
from model.attention import KVCache, LayerSpec, build_attention
from model.attention.common import reference as ref
from model.attention.prescored_hyper import ExactPiece, HyperPiece, PrescoredHyperConfig, hyper, naive
from model.attention.prescored_hyper import scoring as scorers

SPEC = LayerSpec(d_model=32, n_heads=4, n_kv_heads=2, head_dim=8, max_seq_len=256, layer_idx=0, n_layers=1)
SMALL = dict(block_size=8, min_seq_len=16, min_keys=4, lsh_bits=4)
SCORINGS = ["kmeans", "kmedian", "leverage"]


def inputs(t=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, t, 8, generator=g, dtype=torch.float64) * 1.5
    k = torch.randn(2, 2, t, 8, generator=g, dtype=torch.float64) * 1.5
    v = torch.randn(2, 2, t, 8, generator=g, dtype=torch.float64)
    return q, k, v


def module(**options):
    return build_attention("prescored_hyper", PrescoredHyperConfig(**{**SMALL, **options}), SPEC).double()


def exact_attention(q, k, v, q_pos=None):
    k_pos = torch.arange(k.shape[2])
    q_pos = k_pos[-q.shape[2] :] if q_pos is None else q_pos
    return ref.weighted_values(
        ref.masked_softmax(ref.scores(q, k, 1 / math.sqrt(8)), ref.causal_mask(q_pos, k_pos)), v, q.dtype
    )


def rel_error(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("scoring", SCORINGS)
def test_error_falls_to_float_tolerance_as_kept_keys_and_samples_reach_all_keys(scoring):
    q, k, v = inputs()
    exact = exact_attention(q, k, v)
    errors = []
    for top_k, samples in [(16, 4), (32, 8), (64, 16), (96, 32), (128, 128)]:
        out = module(scoring=scoring, top_k=top_k, sample_size=samples)(
            q, k, v, hidden=None, positions=torch.arange(128)
        ).output
        errors.append(rel_error(out, exact))
    assert errors[0] > 0.1, "the coarsest setting should be visibly approximate"
    assert all(b < a for a, b in zip(errors, errors[1:])), errors
    assert errors[-1] < 1e-13, errors


@pytest.mark.parametrize("impl", ["reference", "auto"])
def test_exact_settings_give_exact_values_and_gradients(impl):
    q, k, v = (x.clone().requires_grad_(True) for x in inputs(t=70, seed=1))
    m = module(top_k=10**6, sample_size=10**6)
    m.impl = impl
    w = torch.randn(2, 4, 70, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    grads = torch.autograd.grad((m(q, k, v, hidden=None, positions=torch.arange(70)).output * w).sum(), (q, k, v))
    expected = torch.autograd.grad((exact_attention(q, k, v) * w).sum(), (q, k, v))
    for a, b in zip(grads, expected):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)


def test_fast_path_equals_the_dense_weighted_softmax_for_a_cached_past():
    """A chunk of queries on top of a cache: the past is one non-causal block (LSH + samples)."""
    q, k, v = (x.clone().requires_grad_(True) for x in inputs(t=100, seed=3))
    m = module(top_k=40, sample_size=6)
    qc, q_pos = q[:, :, 60:], torch.arange(60, 100)
    pieces = m.plan(qc.detach(), k.detach(), q_pos)
    assert isinstance(pieces[0], HyperPiece) and pieces[0].qs == 0 and pieces[0].qe == 40
    assert any(isinstance(p, ExactPiece) for p in pieces)
    outs = []
    for impl in ("reference", "auto"):
        m.impl = impl
        out = (
            m.fast(qc, k, v, hidden=None, q_pos=q_pos, k_pos=torch.arange(100), cache=None)
            if impl == "auto"
            else m.reference(qc, k, v, hidden=None, q_pos=q_pos, k_pos=torch.arange(100), cache=None)
        )
        outs.append((out.output, torch.autograd.grad(out.output.square().sum(), (q, k, v))))
    torch.testing.assert_close(outs[1][0], outs[0][0], atol=1e-12, rtol=1e-10)
    for a, b in zip(outs[1][1], outs[0][1]):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("scoring", SCORINGS)
@pytest.mark.parametrize("positions", [(0, 96), (40, 96)], ids=["whole", "cached-past"])
def test_fast_path_equals_the_naive_weighted_softmax_of_the_same_plan(scoring, positions):
    """``hyper.attention`` on a plan against ``naive.attention`` over ``naive.log_weights`` of that plan: values
    and gradients, for a whole sequence and for a chunk of queries on top of a cached past."""
    lo, hi = positions
    q, k, v = (x.clone().requires_grad_(True) for x in inputs(t=hi, seed=13))
    m = module(scoring=scoring, top_k=40, sample_size=6, min_seq_len=20)
    qc, q_pos = q[:, :, lo:], torch.arange(lo, hi)
    pieces = m.plan(qc.detach(), k.detach(), q_pos)
    assert any(isinstance(p, HyperPiece) for p in pieces) and any(isinstance(p, ExactPiece) for p in pieces)
    fast = hyper.attention(qc, k, v, q_pos, pieces, m.scale, m.cfg.block_size)
    lw = naive.log_weights(pieces, 2, 4, hi - lo, hi, q_pos, q.device)
    dense = naive.attention(qc, k, v, lw, m.scale)
    torch.testing.assert_close(fast, dense, atol=1e-12, rtol=1e-10)
    w = torch.randn(dense.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(14))
    for a, b in zip(
        torch.autograd.grad((fast * w).sum(), (q, k, v)), torch.autograd.grad((dense * w).sum(), (q, k, v))
    ):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)


def test_single_query_decode_is_exact_attention_over_the_kept_keys():
    q, k, v = inputs(t=80, seed=4)
    m = module(top_k=30, sample_size=4)
    cache = KVCache(2, 2, 8, 80, dtype=torch.float64, device="cpu")
    m(q[:, :, :79], k[:, :, :79], v[:, :, :79], hidden=None, positions=torch.arange(79), cache=cache)
    out = m(q[:, :, 79:], k[:, :, 79:], v[:, :, 79:], hidden=None, positions=torch.arange(79, 80), cache=cache).output
    kept = m.kept_keys(k)  # scored over the whole cache, as the decode step does
    past = kept[kept < 79].reshape(2, 2, -1) if (kept < 79).all() else None
    mask = torch.zeros(2, 2, 80, dtype=torch.bool).scatter_(-1, kept, True)
    mask[..., 79] = True  # the query's own key: the exact diagonal block
    mask = mask.repeat_interleave(2, dim=1)[:, :, None, :]
    expected = ref.weighted_values(ref.masked_softmax(ref.scores(q[:, :, 79:], k, 1 / math.sqrt(8)), mask), v, q.dtype)
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=1e-10)
    assert past is None or past.shape[-1] < 79


@pytest.mark.parametrize("scoring", SCORINGS)
def test_chunked_pieces_and_the_in_place_merge_equal_the_reference(scoring, monkeypatch):
    """Long pieces in row chunks, and the no-grad forward merging pieces in place, against the dense path."""
    monkeypatch.setattr(scorers, "_CHUNK_ELEMS", 64)  # the key scoring's chunks
    monkeypatch.setattr(hyper, "_CHUNK_ELEMS", 64)  # the pieces' row chunks
    q, k, v = inputs(t=96, seed=12)
    m = module(scoring=scoring, top_k=40, sample_size=6, min_seq_len=20)
    m.impl = "reference"
    expected = m(q, k, v, hidden=None, positions=torch.arange(96)).output
    m.impl = "auto"
    with torch.no_grad():
        torch.testing.assert_close(m(q, k, v, hidden=None, positions=torch.arange(96)).output, expected)
    qg = q.clone().requires_grad_(True)
    torch.testing.assert_close(m(qg, k, v, hidden=None, positions=torch.arange(96)).output, expected)


def test_too_few_survivors_fall_back_to_plain_hyperattention():
    q, k, v = inputs(t=96, seed=7)
    plain = module(top_k=10**6, sample_size=6)(q, k, v, hidden=None, positions=torch.arange(96)).output
    for top_k, min_keys in [(0, 0), (0, 4), (10, 16)]:
        m = module(top_k=top_k, min_keys=min_keys, sample_size=6)
        assert m.kept_keys(k).shape[-1] == 96
        torch.testing.assert_close(m(q, k, v, hidden=None, positions=torch.arange(96)).output, plain, atol=0, rtol=0)
    assert module(top_k=20, min_keys=16).kept_keys(k).shape[-1] == 20


def test_kept_keys_are_gathered_so_the_work_drops():
    q, k, _ = inputs(t=128, seed=8)
    pairs = []
    for top_k in (128, 64, 32):
        m = module(top_k=top_k, sample_size=4)
        pieces = m.plan(q, k, torch.arange(128))
        kept = set(m.kept_keys(k)[0, 0].tolist())
        for p in pieces:
            if isinstance(p, HyperPiece):
                assert set(p.kidx[0, 0][p.kvalid[0, 0]].tolist()) <= kept
                assert p.kidx.shape[-1] <= top_k
        lw = naive.log_weights(pieces, 2, 4, 128, 128, torch.arange(128), torch.device("cpu"))
        pairs.append(int(torch.isfinite(lw).sum()))
    assert pairs[0] > pairs[1] > pairs[2], pairs
    assert pairs[0] < 2 * 4 * 128 * 129 // 2, "even with every key kept, LSH blocks + samples skip pairs"


@pytest.mark.parametrize(
    "options,key",
    [
        (dict(scoring="pca"), "scoring"),
        (dict(top_k=-1), "top_k"),
        (dict(n_clusters=0), "n_clusters"),
        (dict(leverage_eps=0.0), "leverage_eps"),
        (dict(block_size=0), "block_size"),
        (dict(sample_size=-2), "sample_size"),
        (dict(min_seq_len=0), "min_seq_len"),
        (dict(lsh_bits=40), "lsh_bits"),
    ],
)
def test_bad_options_are_one_line_config_errors(options, key):
    with pytest.raises(ConfigError, match=f"model.attention.prescored_hyper.{key}") as err:
        PrescoredHyperConfig(**options).validate("model.attention.prescored_hyper.")
    assert "\n" not in str(err.value)
