"""Shared by the interop tests: a SentencePiece model trained like the demo's, random-weight models and
checkpoints written by the project's own checkpoint code."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

VOCAB = 320  # >= the test tokenizers' vocabularies
SMALL = dict(vocab_size=VOCAB, d_model=64, n_layers=2, n_heads=4, d_ff=96, max_seq_len=64)


@pytest.fixture(scope="session")
def sp_model(tmp_path_factory) -> Path:
    """A SentencePiece model trained like the demo's (data/tokenizer.py settings), small."""
    from data.embedded import iter_embedded
    from data.tokenizer import train_sentencepiece

    docs = [d.text[:60_000] for _, d in zip(range(6), iter_embedded())]
    return train_sentencepiece(docs, vocab_size=VOCAB, out_path=tmp_path_factory.mktemp("sp") / "tokenizer.model")


def randomise(model: torch.nn.Module, seed: int = 0) -> None:
    """Weights far from HF's init (zero biases, unit norms), so every tensor's mapping shows in the logits."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * 0.1
            p.copy_(1.0 + noise if ("norm" in name or ".ln_" in name) and p.dim() == 1 else noise)


def our_checkpoint(root: Path, model: dict, tokenizer: Path, seed: int = 0) -> Path:
    """A checkpoint directory written by the project's own checkpoint code, random weights."""
    from safetensors.torch import save_model

    from data.tokenizer import load_tokenizer
    from model.transformer import build_model
    from pretrain.checkpoint import MODEL_FILE, save_checkpoint
    from run.config import run_config_from_dict

    cfg = run_config_from_dict({"model": {"preset": "", **model}, "data": {"tokenizer": str(tokenizer)}})
    torch.manual_seed(seed)
    net = build_model(cfg.model)
    randomise(net, seed)

    def write(directory: Path) -> None:
        save_model(net, str(directory / MODEL_FILE))
        load_tokenizer(tokenizer).save(directory)

    state = {"step": 1, "tokens": 0, "config": cfg.to_toml()}
    return save_checkpoint(root, 1, write_engine_state=write, trainer_state=state, keep=0)
