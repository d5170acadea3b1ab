"""Context parallelism (model/attention/common/context_parallel.py).

Fast: the load-balanced layout (shard / restore, positions, equal causal work), the layout checks, and the
per-chunk driver at cp=1 (two chunks on one rank, no collective) against the plain forward for every trainable
variant. Slow: one launch of 2 gloo processes (tests/model/cp_worker.py) runs every case from the registry at
cp=2 against the single-process computation: outputs, aux losses and the gradients of q, k, v, the routing
input and every variant parameter (float64 reference paths within 1e-10, float32 fast paths within 1e-5), with
document masking, and a 2-layer model's loss and gradients (its cross-entropy is float32: 1e-5).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from core.errors import ConfigError
from model.attention import registry
from model.attention.common import reference as ref
from model.attention.common.context_parallel import (
    ContextParallel,
    check_context_parallel,
    restore_sequence,
    shard_batch,
    shard_sequence,
)
from model.attention.common.sdpa import prefix_causal_attention
from model.config import ModelConfig
from model.transformer import Transformer
from tests.conftest import REPO
from tests.model import cp_worker

CASES = cp_worker.cases()


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_shard_and_restore_are_inverse_and_balanced(cp):
    t = 8 * cp
    x = torch.arange(2 * 3 * t).view(2, 3, t)
    parts = [shard_sequence(x, cp, r, dim=2) for r in range(cp)]
    c = t // (2 * cp)
    for r, part in enumerate(parts):
        pos = torch.arange(t)
        expect = torch.cat([pos[r * c : (r + 1) * c], pos[(2 * cp - 1 - r) * c : (2 * cp - r) * c]])
        assert torch.equal(part[0, 0], expect)  # chunks r and 2cp-1-r, in that order
        assert torch.equal(ContextParallel(None, cp, r).positions(t // cp, "cpu"), expect)
        assert int((expect + 1).sum()) == t * (t + 1) // (2 * cp)  # the same causal work on every rank
    assert torch.equal(restore_sequence(parts, dim=2), x)


def test_shard_batch_and_uneven_lengths():
    cp = ContextParallel(None, 2, 1)
    inputs, targets = torch.arange(16).view(2, 8), torch.arange(16).view(2, 8) + 100
    a, b = shard_batch(cp, inputs, targets)
    assert a.tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]] and torch.equal(b, a + 100)
    with pytest.raises(ValueError, match="2 x cp = 4"):
        shard_sequence(torch.zeros(1, 10), 2, 0)


def test_layout_checks_name_the_field():
    full, dga = registry["full"].config_cls(), registry["dga"].config_cls(chunk_size=16, group_size=4)
    check_context_parallel("full", full, 66, 1)
    check_context_parallel("full", full, 64, 2)
    with pytest.raises(ConfigError, match=r"^data\.seq_len: 66 is not divisible by 2 x train\.parallel\.cp = 4$"):
        check_context_parallel("full", full, 66, 2)
    check_context_parallel("dga", dga, 128, 2)
    with pytest.raises(ConfigError, match=r"^data\.seq_len: 96 is not divisible by 64 .*dga's 16\)$"):
        check_context_parallel("dga", dga, 96, 2)
    with pytest.raises(ConfigError, match=r"^model\.attention\.dga: .*selection = 'sequence'"):
        check_context_parallel("dga", registry["dga"].config_cls(selection="sequence"), 256, 2)


@pytest.mark.parametrize("tq", [16, 7, 1])
def test_prefix_causal_kernel_equals_the_dense_reference(tq):
    """Queries at the end of a longer key sequence on the CPU kernel (two parts merged by logsumexp), float64."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, n, 8, generator=gen, dtype=torch.float64, requires_grad=True) for n in (tq, 16, 16))
    out = prefix_causal_attention(q, k, v, scale=0.3)
    mask = torch.arange(16)[None, :] <= torch.arange(16 - tq, 16)[:, None]
    expect = ref.weighted_values(ref.masked_softmax(ref.scores(q, k, 0.3), mask), v, q.dtype)
    w = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    expect_grads = torch.autograd.grad((expect * w).sum(), (q, k, v))
    torch.testing.assert_close(out, expect, rtol=0, atol=1e-12)
    for g, e in zip(grads, expect_grads, strict=True):
        torch.testing.assert_close(g, e, rtol=0, atol=1e-12)


@pytest.mark.parametrize("kind", sorted(k for k, e in registry.items() if e.cls.trainable))
def test_one_rank_in_two_chunks_equals_the_plain_forward(kind):
    """cp=1 runs the CP driver (two query chunks, each against its key prefix) with no collective."""
    case = next(c for c in CASES if c.kind == kind and c.model)
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=256)
    cfg.attention.kind = kind
    cfg.attention.options[kind] = registry[kind].config_cls(**case.options)
    torch.manual_seed(0)
    model = Transformer(cfg).double()
    idx = torch.randint(0, 64, (2, cp_worker.seq_len(case)), generator=torch.Generator().manual_seed(0))
    ref = model(idx, targets=idx).loss_sum
    cp = ContextParallel(None, 1, 0)
    for block in model.blocks:
        block.attn.context_parallel = cp
    model.context_parallel = cp
    assert ref is not None
    torch.testing.assert_close(model(idx, targets=idx).loss_sum, ref, rtol=1e-6, atol=0)
    with model.whole_sequences():
        assert model.context_parallel is None and all(b.attn.context_parallel is None for b in model.blocks)
    assert model.context_parallel is cp and all(b.attn.context_parallel is cp for b in model.blocks)


@pytest.fixture(scope="module")
def cp2_results(tmp_path_factory) -> dict[str, dict[str, float]]:
    tmp = tmp_path_factory.mktemp("cp2")
    out, init = tmp / "results.json", f"file://{tmp / 'init'}"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    worker = str(Path(cp_worker.__file__))
    procs = [
        subprocess.Popen([sys.executable, worker, str(r), init, str(out)], cwd=REPO, env=env, stderr=subprocess.PIPE)
        for r in range(cp_worker.CP)
    ]
    errors = [p.communicate(timeout=300)[1].decode()[-3000:] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(errors)
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_cp2_equals_one_process(case, cp2_results):
    errs = cp2_results[case.name]
    tol = 1e-10 if case.dtype == "float64" and not case.model else 1e-5
    expected = {"loss"} if case.model else {"output", "grad_q", "grad_k", "grad_v", "grad_hidden"}
    assert expected <= set(errs)
    bad = {name: err for name, err in errs.items() if not err <= tol}
    assert not bad, f"{case.name}: relative differences above {tol}: {bad}"
