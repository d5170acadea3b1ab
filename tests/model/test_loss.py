"""model/loss.py: the chunked fused head + cross-entropy against ``F.cross_entropy`` on the full logits (values and
gradients in float64, tied weights, ignored rows, ragged chunks; bf16 autocast against float32), its peak memory
against the plain path's, and a tiny model's loss and gradients through the fused and the plain head."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from core.memory import PeakMemory, fix_malloc_for_rss
from model.loss import IGNORE_INDEX, chunked_linear_cross_entropy, default_chunk
from model.transformer import Transformer
from tests.conftest import small_model_config


def inputs(n: int, d: int, v: int, dtype: torch.dtype = torch.float64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=g, dtype=dtype).requires_grad_()
    weight = (torch.randn(v, d, generator=g, dtype=dtype) / d**0.5).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=g)
    targets[::7] = IGNORE_INDEX
    targets[1] = IGNORE_INDEX
    return hidden, weight, targets


def plain(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The model's plain path: full logits, float32-or-wider cross-entropy, summed."""
    logits = F.linear(hidden, weight)
    wide = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(wide, targets, ignore_index=IGNORE_INDEX, reduction="sum")


@pytest.mark.parametrize("chunk", [1, 5, 16, 37, 64])
def test_float64_loss_and_gradients_equal_full_logits(chunk: int) -> None:
    """N = 37 tokens (ragged for every chunk but 1 and 37; 64 is one chunk larger than N), ignored rows included; the
    backward's incoming gradient is not 1 (the trainer scales by 1 / global tokens)."""
    hidden, weight, targets = inputs(37, 8, 50)
    ref = plain(hidden, weight, targets)
    ref_h, ref_w = torch.autograd.grad(ref * 0.37, (hidden, weight))
    out = chunked_linear_cross_entropy(hidden, weight, targets, chunk=chunk)
    got_h, got_w = torch.autograd.grad(out * 0.37, (hidden, weight))
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_h, ref_h, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_w, ref_w, rtol=1e-12, atol=1e-12)
    assert got_h[targets == IGNORE_INDEX].abs().max() == 0  # ignored rows get no gradient


def test_tied_weight_accumulates_both_gradients() -> None:
    """The head's weight is also the embedding: both uses' gradients land in the one parameter's .grad."""
    _, weight, targets = inputs(29, 8, 50)
    idx = torch.randint(0, 50, (29,), generator=torch.Generator().manual_seed(1))
    mix = torch.randn(8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2))

    def grad(fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
        weight.grad = None
        hidden = torch.tanh(F.embedding(idx, weight) @ mix)
        loss = (
            chunked_linear_cross_entropy(hidden, weight, targets, chunk=6) if fused else plain(hidden, weight, targets)
        )
        loss.backward()
        assert weight.grad is not None
        return loss.detach(), weight.grad.clone()

    ref_loss, ref_grad = grad(fused=False)
    loss, got = grad(fused=True)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got, ref_grad, rtol=1e-12, atol=1e-12)


def test_frozen_head_and_no_grad_forward() -> None:
    """A weight that needs no gradient gets none (and costs no weight-gradient matmul); a forward without gradients
    (evaluation) gives the same loss."""
    hidden, weight, targets = inputs(20, 8, 30)
    weight.requires_grad_(False)
    out = chunked_linear_cross_entropy(hidden, weight, targets, chunk=7)
    out.backward()
    ref_h = torch.autograd.grad(plain(hidden, weight, targets), hidden)[0]
    assert hidden.grad is not None and weight.grad is None
    torch.testing.assert_close(hidden.grad, ref_h, rtol=1e-12, atol=1e-12)
    with torch.no_grad():
        torch.testing.assert_close(chunked_linear_cross_entropy(hidden, weight, targets, chunk=7), out.detach())


def test_a_second_backward_through_a_retained_graph_raises() -> None:
    """The gradients computed in the forward are scaled in place by backward: a second backward must not scale them
    again silently."""
    hidden, weight, targets = inputs(10, 4, 12)
    out = chunked_linear_cross_entropy(hidden, weight, targets, chunk=3)
    out.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="inplace"):
        out.backward()


def test_bf16_autocast_against_float32() -> None:
    """Under CPU bf16 autocast the logits and the gradient matmuls run in bf16 (softmax in float32), as the plain path
    under autocast does. Stated tolerance against the float32 reference: loss within 1e-2 relative; gradients within
    3e-2 of the reference's norm (bf16 has 8 bits of mantissa, ~4e-3 per rounding). Against the plain path under the
    same autocast: the same bf16 logits, so the loss agrees within 1e-4 relative (summation order) and the gradients
    within 2e-2 of the norm (the weight gradient's per-chunk bf16 rounding)."""
    hidden, weight, targets = inputs(300, 64, 500, dtype=torch.float32)
    ref = plain(hidden, weight, targets)
    ref_h, ref_w = torch.autograd.grad(ref, (hidden, weight))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = chunked_linear_cross_entropy(hidden, weight, targets, chunk=64)
        same = plain(hidden, weight, targets)
    got_h, got_w = torch.autograd.grad(out, (hidden, weight))
    same_h, same_w = torch.autograd.grad(same, (hidden, weight))
    assert out.dtype == torch.float32 and got_h.dtype == torch.float32 and got_w.dtype == torch.float32

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).detach().norm() / b.detach().norm())

    assert rel(out, ref) < 1e-2 and rel(got_h, ref_h) < 3e-2 and rel(got_w, ref_w) < 3e-2
    assert rel(out, same) < 1e-4 and rel(got_h, same_h) < 2e-2 and rel(got_w, same_w) < 2e-2
    assert rel(got_h, ref_h) > 0  # it did compute in bf16


def test_traceable_by_torch_compile() -> None:
    """Dynamo traces the autograd.Function whole (fullgraph): values and gradients as eager."""
    hidden, weight, targets = inputs(23, 8, 40)
    compiled = torch.compile(
        lambda h, w, t: chunked_linear_cross_entropy(h, w, t, chunk=8), backend="aot_eager", fullgraph=True
    )
    out = compiled(hidden, weight, targets)
    got = torch.autograd.grad(out, (hidden, weight))
    ref = plain(hidden, weight, targets)
    for a, b in zip(got, torch.autograd.grad(ref, (hidden, weight)), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_default_chunk_by_vocabulary() -> None:
    assert default_chunk(100_000, 32_000) == 8192 and default_chunk(100_000, 128_256) == 2048
    assert default_chunk(100, 32_000) == 100 and default_chunk(0, 50) == 1 and default_chunk(10**6, 10**9) == 256


def test_peak_memory_well_below_the_plain_path() -> None:
    """Forward + backward at N = 4096, V = 32000 in float32 on the CPU (resident-set growth): the plain path holds
    [N, V] logits, their log-softmax and gradient (0.5 GB each); the fused one a [512, V] chunk at a time and the
    [V, d] weight gradient. d = 64 (the logits' size does not depend on it) keeps the matmuls to seconds on 2 cores."""
    fix_malloc_for_rss()
    n, d, v = 4096, 64, 32_000
    hidden, weight, targets = inputs(n, d, v, dtype=torch.float32)
    peaks = {}
    for name, loss_fn in (
        ("fused", lambda: chunked_linear_cross_entropy(hidden, weight, targets, chunk=512)),
        ("plain", lambda: plain(hidden, weight, targets)),
    ):
        hidden.grad = weight.grad = None
        with PeakMemory("cpu") as mem:
            loss_fn().backward()
        if mem.peak is None:
            pytest.skip("no /proc/self/clear_refs: the CPU peak is unmeasurable here")
        peaks[name] = mem.peak
    print(
        f"peak RSS growth, fwd+bwd N={n} V={v} d={d} fp32: fused {peaks['fused'] / 2**20:.0f} MiB, "
        f"plain {peaks['plain'] / 2**20:.0f} MiB"
    )
    logits_bytes = n * v * 4
    assert peaks["plain"] > logits_bytes  # the measurement sees the plain path's logits
    assert peaks["fused"] < peaks["plain"] / 8, peaks


@pytest.mark.parametrize("family", ["llama", "gpt2"])  # untied head; tied head (GPT-2 ties it to the embedding)
def test_tiny_model_loss_and_gradients_fused_equal_plain(family: str) -> None:
    """One training forward + backward through the fused head (chunk 7: ragged over 2 x 12 tokens) and through the
    plain one (``fused_cross_entropy = False``): equal loss and every parameter's gradient, within float32 rounding."""
    torch.manual_seed(0)
    model = Transformer(small_model_config(family))
    idx = torch.randint(0, 50, (2, 12))
    targets = torch.randint(0, 50, (2, 12))
    targets[0, :3] = IGNORE_INDEX
    targets[1, -1] = IGNORE_INDEX
    assert model.fused_head_applies()

    def run(fused: bool) -> tuple[torch.Tensor, int, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        model.fused_cross_entropy = fused
        model.loss_chunk = 7
        out = model(idx, targets=targets, return_logits=False)
        assert out.loss_sum is not None and out.logits is None
        (out.loss_sum / out.n_tokens).backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
        return out.loss_sum.detach(), out.n_tokens, grads

    loss, n, grads = run(fused=True)
    ref_loss, ref_n, ref_grads = run(fused=False)
    assert n == ref_n == 20
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-5)
    assert grads.keys() == ref_grads.keys() and "lm_head.weight" in {
        name for name, _ in model.named_parameters(remove_duplicate=False)
    }
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-5, atol=1e-6, msg=name)
    # evaluation and generation keep the logits path: its loss is the same
    with torch.no_grad():
        both = model(idx, targets=targets)
    assert both.logits is not None
    torch.testing.assert_close(both.loss_sum, ref_loss, rtol=1e-6, atol=1e-5)


def test_hooked_head_keeps_the_plain_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """A head whose forward something intercepts (tensor parallelism's styles, DeepSpeed ZeRO-3's gathering) keeps
    ``lm_head(hidden)``: the hook runs and the fused function is not called."""
    import model.transformer as transformer

    model = Transformer(small_model_config())
    calls = []
    monkeypatch.setattr(transformer, "chunked_linear_cross_entropy", lambda *a, **k: calls.append(1) or a[0].sum())
    idx = torch.randint(0, 50, (1, 8))
    model(idx, targets=idx, return_logits=False)
    assert calls == [1]
    seen = []
    model.lm_head.register_forward_hook(lambda *_: seen.append(1))
    assert not model.fused_head_applies()
    out = model(idx, targets=idx, return_logits=False)
    assert calls == [1] and seen == [1] and out.loss_sum is not None
