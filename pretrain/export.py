"""``python -m pretrain.export --checkpoint DIR | --run DIR --out FILE.safetensors``

Consolidates a checkpoint of any engine into one safetensors file: the full fp32 weights, with
the run's resolved config (TOML), step and tokens in the file's metadata. The weights come from
the checkpoint's ``model.safetensors`` when present (every engine writes one), else from the
DCP shards (``dcp/``, ddp / fsdp2) or DeepSpeed's ZeRO files (``ds/``), read offline without a
process group. The output is written under a temporary name and renamed.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch

from pretrain import checkpoint as ckpt


def consolidated_weights(path: Path) -> dict[str, torch.Tensor]:
    """Full fp32 state dict of checkpoint directory ``path``, whatever engine wrote it."""
    from safetensors.torch import load_file

    if (path / ckpt.MODEL_FILE).is_file():
        return load_file(str(path / ckpt.MODEL_FILE))
    if (path / "dcp").is_dir():
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        with tempfile.TemporaryDirectory() as tmp:
            dcp_to_torch_save(str(path / "dcp"), f"{tmp}/full.pt")
            state = torch.load(f"{tmp}/full.pt", map_location="cpu", weights_only=True)
        return {k: v.float().contiguous() for k, v in state["model"].items()}
    if (path / "ds").is_dir():
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        return {
            k: v.float().contiguous() for k, v in get_fp32_state_dict_from_zero_checkpoint(str(path), tag="ds").items()
        }
    raise FileNotFoundError(f"{path}: no {ckpt.MODEL_FILE}, dcp/ or ds/ (not a checkpoint directory)")


def export(path: Path, out: Path) -> Path:
    from safetensors.torch import save_file

    state = ckpt.load_trainer_state(path)
    weights = ckpt.untie(consolidated_weights(path))
    metadata = {
        "config": state["config"],
        "step": str(state["step"]),
        "tokens": str(state["tokens"]),
        "source": str(path),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    save_file(weights, str(tmp), metadata=metadata)
    os.replace(tmp, out)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pretrain.export", description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="checkpoint directory (checkpoints/step_NNNNNNNN)")
    src.add_argument("--run", help="run directory (its latest complete checkpoint)")
    p.add_argument("--out", required=True, help="output .safetensors file")
    args = p.parse_args(argv)
    if args.run:
        path = ckpt.latest_checkpoint(Path(args.run))
        if path is None:
            print(f"error: --run: {args.run} has no complete checkpoint", file=sys.stderr)
            return 2
    else:
        path = Path(args.checkpoint)
        if not (path / ckpt.TRAINER_STATE).is_file():
            print(
                f"error: --checkpoint: {path} is not a complete checkpoint directory (no {ckpt.TRAINER_STATE})",
                file=sys.stderr,
            )
            return 2
    out = export(path, Path(args.out))
    print(f"exported {path} -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
