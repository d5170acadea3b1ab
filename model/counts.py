"""Parameter counts (on the meta device), training FLOPs per token and a memory estimate for a
model config: what ``python -m model.info`` and the trainer's MFU report."""

from __future__ import annotations

import torch

from model.config import ModelConfig
from model.transformer import Transformer


def count_parameters(cfg: ModelConfig) -> dict[str, int]:
    """Total, non-embedding and matmul parameters, counted on the meta device (no memory).

    Non-embedding excludes the token and learned position embeddings (Kaplan et al.);
    an untied LM head is counted, since it costs matmul FLOPs. ``matmul_parameters`` is what
    torchtitan multiplies by 6 for its FLOPs per token: every parameter except embedding tables,
    a table shared with the LM head (tied) counted once as the head.
    """
    with torch.device("meta"):
        model = Transformer(cfg)
    total = sum(p.numel() for p in model.parameters())
    embedding = model.tok_emb.weight.numel()
    if model.pos_emb is not None:
        embedding += model.pos_emb.weight.numel()
    tied = model.lm_head.weight is model.tok_emb.weight
    matmul = total - embedding + (model.tok_emb.weight.numel() if tied else 0)
    return {"parameters": total, "non_embedding_parameters": total - embedding, "matmul_parameters": matmul}


def flops_per_token(cfg: ModelConfig, seq_len: int | None = None) -> dict[str, float]:
    """Training FLOPs per token as torchtitan counts them (the one count the trainer's MFU and
    ``bench.train_step`` use): ``6 N + 12 L H D T``.

    N is ``count_parameters``' ``matmul_parameters`` (every parameter but the embedding tables; the
    LM head counted tied or not; norms, biases and a variant's own parameters included, as torchtitan
    sums ``model.parameters()``). The attention term counts QK^T and AV of every query against
    every key of a length-T context in forward and backward (2 matmuls x 2 FLOPs x 3), no causal
    discount and no recomputation, whatever the attention variant.
    """
    seq_len = seq_len or cfg.max_seq_len
    attention = 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim * seq_len
    dense = 6 * count_parameters(cfg)["matmul_parameters"]
    return {"flops_per_token": float(dense + attention), "attention_flops_per_token": float(attention)}


def memory_estimate(
    cfg: ModelConfig, *, seq_len: int | None = None, micro_batch: int = 1, mixed_precision: bool = True
) -> dict[str, float]:
    """Training memory estimate in GiB for one unsharded replica with AdamW.

    Weights fp32 (4 B), grads fp32 (4 B), Adam moments (8 B) per parameter; activations
    per Korthikanti et al. (2022) with a fused (flash) attention kernel, i.e.
    s*b*h*34 bytes per layer in 16-bit (doubled for fp32), plus the logits.
    """
    seq_len = seq_len or cfg.max_seq_len
    n = count_parameters(cfg)["parameters"]
    gib = 1024**3
    act_bytes = 34 * seq_len * micro_batch * cfg.d_model * cfg.n_layers * (1 if mixed_precision else 2)
    logits_bytes = seq_len * micro_batch * cfg.vocab_size * (2 + 4)  # 16-bit logits + fp32 loss copy
    weights, grads, optim = 4 * n / gib, 4 * n / gib, 8 * n / gib
    activations = (act_bytes + logits_bytes) / gib
    return {
        "weights_gib": weights,
        "grads_gib": grads,
        "optimizer_gib": optim,
        "activations_gib": activations,
        "total_gib": weights + grads + optim + activations,
        "micro_batch": micro_batch,
        "seq_len": seq_len,
    }
