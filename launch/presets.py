"""``python -m launch.presets [--check]``: the run configs in ``launch/configs/``, one per model
preset x attention variant (``<preset>_<variant>.toml``), written from the table below so the
engine settings of every size live in one place. ``--check`` exits 1 when a file differs from
what would be written (CI runs it through the tests).

Settings target one node of 8 x 80 GB GPUs (H100): FSDP2 with bf16 parameters and fp32
reduction, torch.compile per block, activation checkpointing as the size needs, about 1M tokens
per optimizer step, streaming FineWeb-Edu (sample-10BT) with a tokenizer trained on its first
documents. On more nodes only ``launch.submit --nodes`` changes: the global batch stays the same.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import tomli_w

from core.files import atomic_write_text
from model.attention import registry
from model.config import PRESETS

CONFIG_DIR = Path(__file__).resolve().parent / "configs"


@dataclass(frozen=True)
class Size:
    lr: float
    max_steps: int  # ~1M tokens each: about 20-40 tokens per parameter
    micro_batch_size: int  # sequences per GPU per forward at the preset's length
    activation_checkpointing: str
    fsdp_replicate: int = 1


SIZES: dict[str, Size] = {
    "gpt2-124m": Size(6e-4, 5_000, 32, "none"),
    "llama-124m": Size(6e-4, 5_000, 16, "none"),
    "gpt2-350m": Size(3e-4, 10_000, 16, "none"),
    "llama-350m": Size(3e-4, 10_000, 8, "none"),
    "llama-760m": Size(2.5e-4, 15_000, 8, "selective"),
    "gpt2-774m": Size(2.5e-4, 15_000, 16, "selective"),
    "llama-1.3b": Size(2e-4, 25_000, 4, "selective"),
    "gpt2-1.5b": Size(2e-4, 30_000, 8, "selective"),
    "llama-2.7b": Size(1.6e-4, 50_000, 4, "full"),
    "llama-7b": Size(1.2e-4, 100_000, 2, "full"),
}

# Per-variant settings that differ from the variant's defaults at these sizes.
VARIANT_NOTES = {
    "full": "standard causal attention (SDPA / flash-attn)",
    "focus": "Focus: Sinkhorn-balanced centroids, causal prefix scope (docs/focus.md)",
    "lazy": "Lazy attention: distance bias + Elastic-Softmax; a large RoPE base, as the paper trains with",
    "focal": "Focal temperature attention",
    "dga": "Dynamic Group Attention, causal chunked selection (docs/dga.md)",
    "prescored_hyper": (
        "pre-scored HyperAttention: an approximation for long inputs; train with *_full.toml and evaluate "
        "with this config's attention (docs/prescored_hyper.md)"
    ),
}
GLOBAL_TOKENS = 1 << 20  # sequences per step = this / the preset's length


def config_for(preset: str, variant: str) -> dict:
    size, shape = SIZES[preset], PRESETS[preset]
    seq_len = shape["max_seq_len"]
    model: dict = {"preset": preset, "attention": {"kind": variant}}
    if variant == "lazy" and shape["family"] == "llama":
        model["rope"] = {"theta": 500000.0}
    return {
        "run": {"dir": f"runs/{preset}_{variant}"},
        "model": model,
        "data": {
            "source": "fineweb-edu",
            "name": "sample-10BT",
            "seq_len": seq_len,
            "tokenizer": "train",
            "tokenizer_sample_docs": 100_000,
            "shuffle_window": 10_000,
            "num_workers": 4,
        },
        "train": {
            "engine": "fsdp2",
            "precision": "bf16",
            "compile": True,
            "activation_checkpointing": size.activation_checkpointing,
            "fsdp_replicate": size.fsdp_replicate,
            "max_steps": size.max_steps,
            "batch_size": GLOBAL_TOKENS // seq_len,
            "micro_batch_size": size.micro_batch_size,
            "lr": size.lr,
            "schedule": "cosine",
            "warmup_steps": max(500, size.max_steps // 50),
            "min_lr_ratio": 0.1,
            "weight_decay": 0.1,
            "grad_clip": 1.0,
            "seed": 0,
            "log_every": 10,
        },
        "checkpoint": {"every": 1000, "keep": 3},
        "eval": {"every": 1000, "batches": 20, "sample_tokens": 64},
        "log": {"tensorboard": True, "wandb": "offline"},
    }


def render(preset: str, variant: str) -> str:
    size = SIZES[preset]
    header = [
        f"# {preset} with {VARIANT_NOTES[variant]}.",
        f"# One node of 8 GPUs: fsdp2, bf16, compile, activation checkpointing {size.activation_checkpointing};",
        f"# {GLOBAL_TOKENS // PRESETS[preset]['max_seq_len']} sequences x {PRESETS[preset]['max_seq_len']} tokens per "
        "step. Written by python -m launch.presets.",
        "#   python -m launch.submit --config launch/configs/" + f"{preset}_{variant}.toml --nodes 1 --gpus-per-node 8",
        "# Validation loss needs held-out local files: --set data.val_path=DIR.",
        "",
    ]
    return "\n".join(header) + tomli_w.dumps(config_for(preset, variant))


def files() -> dict[Path, str]:
    return {CONFIG_DIR / f"{p}_{v}.toml": render(p, v) for p in SIZES for v in sorted(registry)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m launch.presets", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--check", action="store_true", help="compare instead of writing; exit 1 on any difference")
    args = p.parse_args(argv)
    stale = [path for path, text in files().items() if not path.is_file() or path.read_text() != text]
    if args.check:
        for path in stale:
            print(f"stale: {path.name} (run python -m launch.presets)", file=sys.stderr)
        return 1 if stale else 0
    for path in stale:
        atomic_write_text(path, files()[path])
    print(f"{len(files())} configs in {CONFIG_DIR} ({len(stale)} written)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
