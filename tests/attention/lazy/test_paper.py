"""Paper pins for ``lazy`` (papers/lazy-attention-elastic-softmax.md, section 4, eq. 3-5; SPEC 3.3).

- Eq. 3: logits ``s_ij = q_i . k_j / sqrt(d) - b_h[i - j]``, a per-head learnable bias over
  distances, clamped to the table's last entry past ``max_distance``.
- Eq. 5 (Elastic-Softmax): ``a_ij = relu(softmax_j(s_ij) - tau_h / n_i)``, n_i = i + 1 keys, output
  ``sum_j a_ij v_j`` (rows need not sum to 1).
- ``bias_init = "alibi"``: b_h[d] = m_h d with ALiBi's slopes m_h = 2^(-8 (h + 1) / H), so before the
  threshold Lazy is ALiBi attention (closed form).

Each formula runs on the dense reference, the default path for the device (``auto``) and the module's
fast path called directly (``fast``: the two-pass FlexAttention composition, eager on CPU; on a
device with a CPU fast path of its own, that path).
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from model.attention import LayerSpec, build_attention
from model.attention.lazy import LazyConfig
from tests.attention.pins import IMPLS, assert_matches, causal, expected, projection, qkv, randn, repeat_kv

H, D, T = 4, 8, 12
SPEC = LayerSpec(d_model=32, n_heads=H, n_kv_heads=2, head_dim=D, max_seq_len=16, layer_idx=0, n_layers=1)
PATHS = (*IMPLS, "fast")


@pytest.fixture(autouse=True)
def _flex_backward_on_cpu(monkeypatch):
    """Eager FlexAttention computes values and gradients on CPU; only its device check refuses grads there."""
    import torch.nn.attention.flex_attention as flex

    monkeypatch.setattr(flex, "_validate_device", lambda *tensors: None)


def run(module, q, k, v, path):
    module.zero_grad(set_to_none=True)
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    pos = torch.arange(q.shape[2])
    hidden = torch.zeros(q.shape[0], q.shape[2], SPEC.d_model, dtype=q.dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if path == "fast":
            out = module.fast(*leaves, hidden=hidden, q_pos=pos, k_pos=pos, cache=None).output
        else:
            module.impl = path
            out = module(*leaves, hidden=hidden, positions=pos).output
    (out * projection(out.shape)).sum().backward()
    return out.detach(), [x.grad for x in leaves] + [module.distance_bias.grad, module.tau.grad]


def elastic(q, k, v, table, tau):
    """Eq. 3 and 5 written out: s = q.k / sqrt(d) - table[h, min(i - j, len - 1)], relu(softmax - tau / n)."""
    t = q.shape[2]
    dist = (torch.arange(t)[:, None] - torch.arange(t)[None, :]).clamp(0, table.shape[1] - 1)
    s = q @ repeat_kv(k, H).transpose(-1, -2) / math.sqrt(D) - table[:, dist]
    mask = causal(t)
    s = s.masked_fill(~mask, -math.inf)
    p = torch.exp(s - torch.logsumexp(s, -1, keepdim=True))
    n = torch.arange(1, t + 1, dtype=q.dtype)[:, None]
    a = torch.relu(p - tau[:, None, None] / n) * mask
    return a @ repeat_kv(v, H)


def lazy(table=None, tau=None, **options):
    module = build_attention("lazy", LazyConfig(**options), SPEC).double()
    with torch.no_grad():
        if table is not None:
            module.distance_bias.copy_(table)
        if tau is not None:
            module.tau.copy_(tau)
    return module


def check(module, q, k, v, path, what):
    table, tau = module.distance_bias.detach().clone(), module.tau.detach().clone()
    want = expected(elastic, q, k, v, [table, tau])
    assert_matches(run(module, q, k, v, path), want, f"{what}/{path}")
    return want


@pytest.mark.parametrize("path", PATHS)
def test_default_config_is_elastic_softmax_with_tau_over_n_eq5(path):
    """Default config: zero bias table, tau_h = 1 (the paper's init): a_ij = relu(softmax_j(q.k/sqrt d) - 1/n_i).
    Sharp scores so that some weights clear the threshold and some do not."""
    q, k, v = qkv(2, H, 2, T, D, seed=1, scale=3.0)
    module = lazy()
    assert torch.equal(module.tau.detach(), torch.ones(H, dtype=torch.float64))
    want = check(module, q, k, v, path, "default")
    assert want[0].abs().max() > 0.1


@pytest.mark.parametrize("path", PATHS)
def test_learned_bias_is_subtracted_and_tau_is_per_head_eq3_eq5(path):
    """Eq. 3 with a random per-head table and eq. 5 with per-head tau of both signs (the paper reports learned
    negative offsets, which lift every visible weight by |tau| / n)."""
    q, k, v = qkv(1, H, 2, T, D, seed=2, scale=2.0)
    table = randn(H, 16, seed=3, scale=1.5)
    check(lazy(table, torch.tensor([1.0, 0.5, -0.7, 2.0], dtype=torch.float64)), q, k, v, path, "learned")


@pytest.mark.parametrize("path", PATHS)
def test_distances_past_the_table_read_its_last_entry(path):
    """Section 4 / SPEC 3.3: ``max_distance = 4``: distances 4..11 all use b_h[3]."""
    q, k, v = qkv(1, H, 2, T, D, seed=4, scale=2.0)
    table = randn(H, 4, seed=5, scale=2.0)
    module = lazy(table, torch.full((H,), 0.3, dtype=torch.float64), max_distance=4)
    assert module.distance_bias.shape == (H, 4)
    check(module, q, k, v, path, "clamped")


def alibi_slopes(h: int) -> torch.Tensor:
    """ALiBi (Press et al. 2022): the geometric sequence 2^(-8/H), 2^(-16/H), ..., 2^(-8)."""
    return torch.tensor([2.0 ** (-8.0 * (i + 1) / h) for i in range(h)], dtype=torch.float64)


@pytest.mark.parametrize("path", PATHS)
def test_alibi_init_is_alibi_attention_before_the_threshold(path):
    """``bias_init = "alibi"``: b_h[d] = m_h d, so with tau = 0 Lazy attention is exactly ALiBi attention,
    softmax(q.k / sqrt d - m_h (i - j)); with the init tau = 1 it is that softmax thresholded at 1/n_i."""
    q, k, v = qkv(2, H, 2, T, D, seed=6, scale=2.0)
    module = lazy(bias_init="alibi")
    slopes = alibi_slopes(H)
    dist = torch.arange(16, dtype=torch.float64)
    torch.testing.assert_close(module.distance_bias.detach(), slopes[:, None] * dist, atol=1e-7, rtol=1e-7)

    def alibi(q, k, v):
        i = torch.arange(T, dtype=torch.float64)
        s = q @ repeat_kv(k, H).transpose(-1, -2) / math.sqrt(D) - slopes[:, None, None] * (i[:, None] - i[None, :])
        s = s.masked_fill(~causal(T), -math.inf)
        return torch.softmax(s, -1) @ repeat_kv(v, H)

    def thresholded(q, k, v):
        i = torch.arange(T, dtype=torch.float64)
        s = q @ repeat_kv(k, H).transpose(-1, -2) / math.sqrt(D) - slopes[:, None, None] * (i[:, None] - i[None, :])
        p = torch.softmax(s.masked_fill(~causal(T), -math.inf), -1)
        return torch.relu(p - 1.0 / (i[:, None] + 1)) @ repeat_kv(v, H)

    with torch.no_grad():  # the table in float64 exactly as ALiBi's, so the comparison is at float64 tolerance
        module.distance_bias.copy_(slopes[:, None] * dist)
    assert_matches(run(module, q, k, v, path)[:1] + ([],), (expected(thresholded, q, k, v)[0], []), f"alibi/{path}")
    with torch.no_grad():
        module.tau.zero_()
    got = run(module, q, k, v, path)
    assert_matches((got[0], got[1][:3]), expected(alibi, q, k, v), f"alibi tau=0/{path}")
