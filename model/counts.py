"""Parameter counts (on the meta device), training FLOPs per token and a memory estimate for a
model config: what ``python -m model.info`` and the trainer's MFU report."""

from __future__ import annotations

import torch

from model.config import ModelConfig
from model.transformer import Transformer


def count_parameters(cfg: ModelConfig) -> dict[str, int]:
    """Total and non-embedding parameters, counted on the meta device (no memory).

    Non-embedding excludes the token and learned position embeddings (Kaplan et al.);
    an untied LM head is counted, since it costs matmul FLOPs.
    """
    with torch.device("meta"):
        model = Transformer(cfg)
    total = sum(p.numel() for p in model.parameters())
    embedding = model.tok_emb.weight.numel()
    if model.pos_emb is not None:
        embedding += model.pos_emb.weight.numel()
    return {"parameters": total, "non_embedding_parameters": total - embedding}


def flops_per_token(cfg: ModelConfig, seq_len: int | None = None) -> dict[str, float]:
    """Training FLOPs per token: 6 x matmul parameters + attention (PaLM appendix B).

    Attention counts QK^T and AV for every query against every key of a length-T
    context, 12 * L * d_attn * T per token for forward+backward (no causal discount,
    matching how MFU is conventionally reported).
    """
    seq_len = seq_len or cfg.max_seq_len
    d, L = cfg.d_model, cfg.n_layers
    attn_dim = cfg.n_heads * cfg.head_dim
    kv_dim = cfg.kv_heads * cfg.head_dim
    per_layer = d * attn_dim + 2 * d * kv_dim + attn_dim * d  # q, k, v, o
    per_layer += (3 if cfg.family == "llama" else 2) * d * cfg.ffn_dim
    matmul_params = L * per_layer + d * cfg.vocab_size  # LM head always a matmul (tied or not)
    dense = 6 * matmul_params
    attention = 12 * L * attn_dim * seq_len
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
