"""Document-aware attention (data.document_masking): in a packed sequence each document is
computed exactly as if it were alone, on the reference, SDPA and FlexAttention paths."""

from __future__ import annotations

import pytest
import torch

from model.config import ModelConfig
from model.documents import document_ids, document_mask, document_positions
from model.transformer import Transformer

EOS = 0


def test_documents_positions_and_mask_on_a_hand_built_case():
    tokens = torch.tensor([[5, 6, EOS, 7, EOS, 8, 9]])
    docs = document_ids(tokens, EOS)
    assert docs.tolist() == [[0, 0, 0, 1, 1, 2, 2]]
    assert document_positions(docs).tolist() == [[0, 1, 2, 0, 1, 0, 1]]
    mask = document_mask(docs)[0].int().tolist()
    assert mask[4] == [0, 0, 0, 1, 1, 0, 0] and mask[6] == [0, 0, 0, 0, 0, 1, 1] and mask[2] == [1, 1, 1, 0, 0, 0, 0]


def _model(family: str, impl: str = "auto") -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig(family=family, vocab_size=50, d_model=32, n_layers=2, n_heads=4, max_seq_len=32)
    cfg.attention.impl = impl
    return Transformer(cfg).double()


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("impl", ["auto", "reference"])
def test_each_document_of_a_packed_row_is_computed_as_if_alone(family, impl):
    model = _model(family, impl).eval()
    a, b = torch.randint(1, 50, (6,)), torch.randint(1, 50, (9,))
    packed = torch.cat([a, torch.tensor([EOS]), b])[None]
    model.document_eos_id = EOS
    logits = model(packed).logits
    model.document_eos_id = None
    alone_a = model(torch.cat([a, torch.tensor([EOS])])[None]).logits
    alone_b = model(b[None]).logits
    torch.testing.assert_close(logits[:, :7], alone_a, rtol=0, atol=1e-10)
    torch.testing.assert_close(logits[:, 7:], alone_b, rtol=0, atol=1e-10)
    assert not torch.allclose(model(packed).logits[:, 7:], alone_b), (
        "without masking the second document sees the first"
    )


def test_fast_path_matches_the_reference_in_values_and_gradients():
    tokens = torch.randint(1, 50, (3, 20), generator=torch.Generator().manual_seed(4))
    tokens[0, 5] = tokens[1, 12] = tokens[1, 3] = EOS
    grads = {}
    for impl in ("reference", "auto"):
        model = _model("llama", impl)
        model.document_eos_id = EOS
        out = model(tokens[:, :-1], targets=tokens[:, 1:])
        out.loss_sum.backward()
        grads[impl] = (out.loss_sum.detach(), [p.grad for p in model.parameters()])
    torch.testing.assert_close(grads["auto"][0], grads["reference"][0], rtol=0, atol=1e-10)
    for g_fast, g_ref in zip(grads["auto"][1], grads["reference"][1]):
        torch.testing.assert_close(g_fast, g_ref, rtol=1e-9, atol=1e-10)


def test_flex_document_attention_forward_matches_sdpa():
    from model.attention.common.flex import flex_available
    from model.attention.full import flex_document_attention

    if not flex_available():
        pytest.skip("FlexAttention is not in this torch build")
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 4, 16, 8, generator=g) for _ in range(3))
    docs = document_ids(torch.tensor([[1, 1, 0, 1, 1, 1, 0, 1, 1, 1, 1, 1, 0, 1, 1, 1]] * 2), 0)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(docs)[:, None], scale=0.25)
    got = flex_document_attention(q, k, v, docs, scale=0.25, compiled=False)  # forward only: no flex backward on CPU
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_variants_without_document_masking_refuse():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=50, d_model=32, n_layers=1, n_heads=4, max_seq_len=32)
    cfg.attention.kind = "focal"
    model = Transformer(cfg)
    model.document_eos_id = EOS
    with pytest.raises(ValueError, match="has no document-aware masking"):
        model(torch.randint(0, 50, (1, 8)))
