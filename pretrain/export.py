"""``python -m pretrain.export --checkpoint DIR | --run DIR --out OUT [--format safetensors|hf] [--dtype fp32|bf16]``

``--format safetensors`` (default): consolidates a checkpoint of any engine into one safetensors file:
the full weights (fp32 unless ``--dtype``), with the run's resolved config (TOML), step and tokens in the
file's metadata. The weights come from the checkpoint's ``model.safetensors`` when present (every engine
writes one), else from the DCP shards (``dcp/``, ddp / fsdp2) or DeepSpeed's ZeRO files (``ds/``), read
offline without a process group. The output is written under a temporary name and renamed.

``--format hf``: a Hugging Face model directory that ``AutoModelForCausalLM`` and ``AutoTokenizer`` load
offline: ``config.json`` (GPT-2, LLaMA, Qwen2 or Qwen3, whichever computes what the model does; see
model/hf.py), ``model.safetensors`` (sharded past ``--max-shard-size``), ``generation_config.json`` and the
tokenizer (data/hf_tokenizer.py). A model whose attention variant is not ``full`` is refused (transformers
runs full attention only) unless ``--allow-variant``: then it is exported with custom code (model/hf/custom_code.py):
``modeling_focused.py`` runs the project's own Transformer, copied into the folder, and config.json's ``auto_map``
names it, so ``AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)`` runs the real attention and
refuses without ``trust_remote_code``; the weights are ``focused_model.safetensors`` so that a stock class
(``LlamaForCausalLM``) finds none and fails; ``python -m pretrain.hf_import`` reads it back.

``--only PATTERN`` (repeatable, safetensors): only the matching tensors, e.g. ``'*.core.*'``: a centroid file
(an attention variant's own parameters, for swapping domains; ``pretrain/adapters.py``, docs/retrofit.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from core.configlib import tomllib  # tomli on Python 3.10
from core.errors import ConfigError, cli_errors, require
from core.files import atomic_directory, plain_mode
from pretrain import checkpoint as ckpt
from run.checkpoint import verify_checkpoint

if TYPE_CHECKING:
    from data.tokenizer import Tokenizer


def consolidated_weights(path: Path, *, key: str = "--checkpoint") -> dict[str, torch.Tensor]:
    """Full fp32 state dict of checkpoint directory ``path``, whatever engine wrote it, once the files it reads
    match their checksums (``verify_checkpoint``: a file checked earlier in this process is not read twice)."""
    from safetensors.torch import load_file

    verify_checkpoint(path, key=key)
    if (path / ckpt.MODEL_FILE).is_file():
        return load_file(str(path / ckpt.MODEL_FILE))
    # torch's dcp_to_torch_save and DeepSpeed's zero_to_fp32 unpickle unchecked; run.safe_load reads through allow-lists
    if (path / "dcp").is_dir():
        from run.safe_load import dcp_model_state

        return {k: v.float().contiguous() for k, v in dcp_model_state(path / "dcp").items()}
    if (path / "ds").is_dir():
        from run.safe_load import zero_state_dict

        return {k: v.float().contiguous() for k, v in zero_state_dict(path, "ds").items()}
    raise FileNotFoundError(f"{path}: no {ckpt.MODEL_FILE}, dcp/ or ds/ (not a checkpoint directory)")


def export(path: Path, out: Path, *, dtype: str = "fp32") -> Path:
    from safetensors.torch import save_file

    from model.hf import DTYPES, cast

    state = ckpt.load_trainer_state(path)
    weights = cast(ckpt.untie(consolidated_weights(path)), DTYPES[dtype])
    metadata = {
        "config": state["config"],
        "step": str(state["step"]),
        "tokens": str(state["tokens"]),
        "source": str(path),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    save_file(weights, str(tmp), metadata=metadata)
    plain_mode(tmp)
    os.replace(tmp, out)
    return out


def _checkpoint_tokenizer(path: Path) -> Tokenizer | None:
    from data.tokenizer import load_tokenizer

    for name in ("tokenizer.model", "tokenizer.json", *sorted(p.name for p in path.glob("*.tiktoken"))):
        if (path / name).is_file():
            return load_tokenizer(path / name)
    return None


def export_hf(
    path: Path,
    out: Path,
    *,
    dtype: str = "fp32",
    max_shard_size: str = "5GB",
    allow_variant: bool = False,
    log: Callable[[str], None] = print,
) -> Path:
    """Checkpoint directory ``path`` -> Hugging Face model directory ``out`` (written beside it under a
    temporary name, then renamed; ``out`` must not exist or be empty)."""
    from data.hf_tokenizer import check_hf_tokenizer, write_hf_tokenizer
    from model import hf
    from run.config import run_config_from_dict

    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out: {out} exists and is not an empty directory")
    state = ckpt.load_trainer_state(path)
    cfg = run_config_from_dict(tomllib.loads(state["config"])).model
    tok = _checkpoint_tokenizer(path)
    # the project separates documents with EOS and scores a text from EOS (eval/harness.py's prefix token): the
    # export names EOS as its BOS too, so lm_eval --model hf and generate start a text where training did
    eos, bos = (tok.eos_id, tok.eos_id) if tok is not None else (None, None)
    config = hf.hf_config_from_model(
        cfg, eos_id=eos, bos_id=bos, dtype=hf.DTYPE_NAMES[hf.DTYPES[dtype]], allow_variant=allow_variant
    )
    weights = hf.cast(hf.to_hf_state_dict(consolidated_weights(path), cfg), hf.DTYPES[dtype])
    custom = cfg.attention.kind != "full"
    with atomic_directory(out) as tmp:
        stem = hf.CUSTOM_WEIGHTS if custom else "model"
        files = hf.save_hf_weights(weights, tmp, max_shard_size=max_shard_size, stem=stem)
        if not custom:  # a custom-code config.json comes last: AutoTokenizer would ask to trust its auto_map
            (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (tmp / "generation_config.json").write_text(json.dumps(hf.generation_config(eos, bos), indent=2) + "\n")
        if tok is None:
            log(f"warning: {path} holds no tokenizer; {out} has none")
        else:
            try:
                files += write_hf_tokenizer(tok, tmp, model_max_length=cfg.max_seq_len)
            except ConfigError as exc:
                log(f"warning: {exc}; {out} has no tokenizer")
            else:
                problem = check_hf_tokenizer(tok, tmp)
                if problem:
                    hint = (
                        "; transformers 5 gives model_type qwen2 its own Qwen2Tokenizer pipeline, while "
                        "PreTrainedTokenizerFast.from_pretrained reads tokenizer.json as written"
                        if config["model_type"] == "qwen2"
                        else ""
                    )
                    log(f"warning: tokenizer: AutoTokenizer encodes differently from {tok.file_name} ({problem}){hint}")
        if custom:
            from model.hf.custom_code import write_custom_code

            files += write_custom_code(tmp, config)[:2]  # the two named files; the copied fp_*.py follow them
            (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    arch = config["architectures"][0]
    log(f"exported {path} -> {out} ({arch}, {config['dtype']}; {', '.join(files)})")
    if custom:
        log(
            f"load it with AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True): its "
            f"{cfg.attention.kind!r} attention runs from the modeling code in the folder; its tokenizer needs no "
            f"custom code: AutoTokenizer.from_pretrained({str(out)!r}, trust_remote_code=False) (transformers 5 reads "
            "config.json first and would ask about the model's code)"
        )
    return out


@cli_errors
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pretrain.export", description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="checkpoint directory (checkpoints/step_NNNNNNNN)")
    src.add_argument("--run", help="run directory (its latest complete checkpoint)")
    p.add_argument("--out", required=True, help="output .safetensors file (--format safetensors) or directory (hf)")
    p.add_argument("--format", default="safetensors", choices=("safetensors", "hf"), help="default: safetensors")
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"), help="weights' dtype (default: fp32)")
    p.add_argument("--max-shard-size", default="5GB", help="hf: shard model.safetensors past this size (e.g. 2GB)")
    p.add_argument(
        "--allow-variant",
        action="store_true",
        help="hf: export a variant transformers lacks, with its modeling code (trust_remote_code)",
    )
    p.add_argument(
        "--only",
        action="append",
        metavar="PATTERN",
        help="safetensors: only the tensors whose names match (fnmatch, repeatable); '*.core.*' writes a centroid "
        "file (pretrain/adapters.py, docs/retrofit.md)",
    )
    args = p.parse_args(argv)
    if args.format == "hf":  # first: a missing extra is known before any checkpoint is read
        require("transformers", "--format hf")
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
    try:  # a damaged file is one line naming it, before anything is read in earnest
        verify_checkpoint(path, key="--run" if args.run else "--checkpoint")
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.only:
        from pretrain.adapters import export_adapter

        if args.format != "safetensors":
            print("error: --only: writes a centroid file (--format safetensors), not --format hf", file=sys.stderr)
            return 2
        try:
            out, n, numel = export_adapter(
                path, Path(args.out), args.only, weights=consolidated_weights(path), dtype=args.dtype
            )
        except ConfigError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print(f"exported {n} tensors ({numel:,} parameters) matching {', '.join(args.only)} of {path} -> {out}")
        return 0
    if args.format == "hf":
        try:
            export_hf(
                path,
                Path(args.out),
                dtype=args.dtype,
                max_shard_size=args.max_shard_size,
                allow_variant=args.allow_variant,
                log=lambda line: print(line, file=sys.stderr if line.startswith("warning") else sys.stdout),
            )
        except ConfigError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        return 0
    try:
        out = export(path, Path(args.out), dtype=args.dtype)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"exported {path} -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
