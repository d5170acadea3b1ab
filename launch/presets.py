"""``python -m launch.presets [--check]``: the run configs in ``launch/configs/``, one per model
preset (``<preset>.toml``, full attention), written from the table below so the engine settings of
every size live in one place. Every attention variant of the registry is then a derived config:
``launch/configs/<preset>_<variant>.toml`` loads as ``<preset>.toml`` with
``model.attention.kind = <variant>`` and the variant's own launch overrides
(``run.config.derived_config``), so a new variant needs no file here. ``--check`` exits 1 when a
file differs from what would be written (CI runs it through the tests).

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

from core.errors import cli_errors
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

GLOBAL_TOKENS = 1 << 20  # sequences per step = this / the preset's length


def config_for(preset: str) -> dict:
    size, shape = SIZES[preset], PRESETS[preset]
    seq_len = shape["max_seq_len"]
    return {
        "run": {"dir": f"runs/{preset}"},
        "model": {"preset": preset, "attention": {"kind": "full"}},
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
            "fsdp2": {"replicate": size.fsdp_replicate},
        },
        "checkpoint": {"every": 1000, "keep": 3},
        "eval": {"every": 1000, "batches": 20, "sample_tokens": 64},
        "log": {"tensorboard": True, "wandb": "offline"},
    }


def render(preset: str) -> str:
    size = SIZES[preset]
    header = [
        f"# {preset} with full attention. One node of 8 GPUs: fsdp2, bf16, compile, activation checkpointing "
        f"{size.activation_checkpointing};",
        f"# {GLOBAL_TOKENS // PRESETS[preset]['max_seq_len']} sequences x {PRESETS[preset]['max_seq_len']} tokens per "
        "step. Written by python -m launch.presets.",
        f"#   python -m launch.submit --config launch/configs/{preset}.toml --nodes 1 --gpus-per-node 8",
        "# Another attention variant (any name in the registry): the derived config",
        f"# launch/configs/{preset}_<variant>.toml, e.g. {preset}_focus.toml: this file with",
        "# model.attention.kind = <variant> and the variant's launch settings (or --set model.attention.kind=...).",
        "# Validation loss needs held-out local files: --set data.val_path=DIR.",
        "",
    ]
    return "\n".join(header) + tomli_w.dumps(config_for(preset))


def files() -> dict[Path, str]:
    return {CONFIG_DIR / f"{p}.toml": render(p) for p in SIZES}


def derived_names() -> list[str]:
    """Every ``<preset>_<variant>.toml`` the registry derives (no file on disk)."""
    return [f"{p}_{v}.toml" for p in SIZES for v in sorted(registry)]


@cli_errors
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
