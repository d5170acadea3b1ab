"""Strided and non-overlapping perplexity on hand-checkable cases."""

from __future__ import annotations

import math

import pytest
import torch

from eval.perplexity import strided_loss, text_perplexity
from model.config import ModelConfig
from model.transformer import Transformer


def _model():
    torch.manual_seed(0)
    return Transformer(ModelConfig(vocab_size=40, d_model=32, n_layers=2, n_heads=4, max_seq_len=64)).double().eval()


def _per_token_nats(model, tokens, start, end, context):
    """-log p(tokens[t] | tokens[max(0, t-context) : t]) summed over t in [start, end), by hand."""
    total = 0.0
    for t in range(start, end):
        ctx = tokens[max(0, t - context) : t][None]
        logp = torch.log_softmax(model(ctx).logits[0, -1], -1)
        total -= float(logp[tokens[t]])
    return total


def test_non_overlapping_windows_score_every_token_once_with_the_window_context():
    model = _model()
    tokens = torch.randint(0, 40, (23,), generator=torch.Generator().manual_seed(1))
    nats, count = strided_loss(model, tokens, length=8, stride=8, device="cpu")
    assert count == 22
    # windows [0,8) [8,16) [16,22): target t has the tokens of its own window before it
    want = sum(_per_token_nats(model, tokens[b:], 1, min(9, 23 - b), 99) for b in (0, 8, 16))
    assert nats == pytest.approx(want, rel=1e-6)  # the model sums its loss in float32


def test_strided_windows_give_each_later_token_at_least_length_minus_stride_context():
    model = _model()
    tokens = torch.randint(0, 40, (30,), generator=torch.Generator().manual_seed(2))
    nats, count = strided_loss(model, tokens, length=10, stride=4, device="cpu")
    assert count == 29
    # by hand: window begins 0, 4, 8, ...; target t is scored by the first window whose end covers it
    want, scored, begin = 0.0, 1, 0
    while scored < 30:
        end = min(begin + 10, 29)
        for t in range(max(scored, begin + 1), end + 1):
            want += _per_token_nats(model, tokens, t, t + 1, t - begin)
        scored, begin = end + 1, begin + 4
    assert nats == pytest.approx(want, rel=1e-6)  # the model sums its loss in float32
    # more context (stride < length) than non-overlapping windows, on the same targets
    assert strided_loss(model, tokens, length=10, stride=10, device="cpu")[1] == 29


def test_text_perplexity_reports_token_and_byte_figures():
    class Chars:
        def encode(self, text):
            return [ord(c) % 40 for c in text]

    model = _model()
    texts = ["abcdefghij" * 3, "x", "héllo wörld"]
    out = text_perplexity(model, texts, Chars(), length=16, stride=8, device="cpu")
    assert out["documents"] == 2 and out["tokens"] == 29 + 10
    n_bytes = len(texts[0]) + len(texts[2].encode())
    nats = out["loss"] * out["tokens"]
    assert out["bytes"] == n_bytes and out["bits_per_byte"] == pytest.approx(nats / n_bytes / math.log(2))
    assert out["byte_perplexity"] == pytest.approx(math.exp(nats / n_bytes)) and out["perplexity"] == pytest.approx(
        math.exp(out["loss"])
    )
