"""Centroid files: an attention variant's own parameters (Focus: W_g, C, lambda) saved apart from the
backbone they were trained on, and put back onto it, for swapping domains (docs/retrofit.md).

Writing: ``python -m pretrain.export --run DIR --only '*.core.*' --out FILE.safetensors`` (``export_adapter``).
The file holds the matching tensors and, in its metadata, the variant's config table, the backbone's shape,
the tokenizer's fingerprint and a fingerprint of every tensor left out (the backbone's exact values).

Applying: ``python -m pretrain.adapters apply --base RUN|CHECKPOINT --adapter FILE --out DIR`` writes DIR, a
complete checkpoint directory: the base's weights with the file's tensors in place, the base's run config
with the file's attention table, the base's tokenizer. ``python -m eval.run --checkpoint DIR``,
``train.init_from = DIR`` and ``python -m pretrain.export --checkpoint DIR`` read it like any other. A
file that does not fit the base (another shape, tokenizer or backbone, a damaged or foreign file) stops
with one line naming what differs.

Checking: ``python -m pretrain.adapters compare --base RUN --run RUN`` counts the tensors the two share bitwise
(exit 1 when any differ): a centroid-only retrofit against its base changes none.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

import torch

from core.configlib import tomllib  # tomli on Python 3.10
from core.errors import ConfigError, cli_errors
from core.files import atomic_directory, plain_mode
from run import checkpoint as ckpt

FORMAT = "focused-pretrain/variant-parameters/1"
# the model table's keys that change neither a tensor's shape nor what the backbone computes
_NOT_BACKBONE = ("attention", "preset", "dropout", "init_std")
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass
class Adapter:
    """A centroid file read back: its tensors and what they were trained with."""

    path: Path
    tensors: dict[str, torch.Tensor]
    attention: dict[str, Any]  # {"kind": ..., "impl": ..., <kind>: {the variant's options}}
    backbone: dict[str, Any]  # the model table without the attention variant (shapes, norms, RoPE)
    rest_fingerprint: str  # sha256 over every tensor of the source checkpoint not in the file
    tokenizer_fingerprint: str
    patterns: list[str]
    source: str
    step: int


def fingerprint(weights: dict[str, torch.Tensor], *, leave_out: Collection[str] = ()) -> str:
    """sha256 over the names, dtypes, shapes and bytes of ``weights`` (less ``leave_out``), in name order."""
    digest = hashlib.sha256()
    for name in sorted(set(weights) - set(leave_out)):
        t = weights[name].detach().to("cpu").contiguous().reshape(-1)
        digest.update(f"{name}|{t.dtype}|{tuple(weights[name].shape)}|".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _backbone(model_table: dict[str, Any]) -> dict[str, Any]:
    table = {k: v for k, v in model_table.items() if k not in _NOT_BACKBONE}
    if table.get("n_kv_heads") == 0:  # 0 means n_heads (an imported config names the count)
        table["n_kv_heads"] = table.get("n_heads")
    return table


def _variant_table(model_table: dict[str, Any]) -> dict[str, Any]:
    attention = model_table.get("attention", {})
    kind = attention.get("kind", "full")
    table = {"kind": kind, "impl": attention.get("impl", "auto")}
    if isinstance(attention.get(kind), dict):
        table[kind] = attention[kind]
    return table


def export_adapter(
    path: Path, out: Path, patterns: list[str], *, weights: dict[str, torch.Tensor], dtype: str = "fp32"
) -> tuple[Path, int, int]:
    """The tensors of checkpoint ``path`` (its consolidated ``weights``) whose names match ``patterns`` ->
    centroid file ``out`` (written under a temporary name, then renamed). Returns (out, tensors, parameters)."""
    from safetensors.torch import save_file

    state = ckpt.load_trainer_state(path)
    selected = {k: v for k, v in weights.items() if any(fnmatchcase(k, p) for p in patterns)}
    if not selected:
        example = next(iter(sorted(weights)), "")
        raise ConfigError(f"--only: {', '.join(patterns)} matches no tensor of {path} (names look like {example!r})")
    table = tomllib.loads(state["config"]).get("model", {})
    metadata = {
        "format": FORMAT,
        "attention": json.dumps(_variant_table(table), sort_keys=True),
        "backbone": json.dumps(_backbone(table), sort_keys=True),
        "rest_fingerprint": fingerprint(weights, leave_out=set(selected)),
        "tokenizer_fingerprint": str(state.get("tokenizer_fingerprint", "")),
        "patterns": json.dumps(list(patterns)),
        "source": str(path),
        "step": str(state["step"]),
    }
    tensors = {k: v.detach().to(_DTYPES[dtype]).contiguous() for k, v in sorted(selected.items())}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    save_file(tensors, str(tmp), metadata=metadata)
    plain_mode(tmp)
    os.replace(tmp, out)
    return out, len(tensors), sum(t.numel() for t in tensors.values())


def read_adapter(file: str | Path, *, key: str = "--adapter") -> Adapter:
    """Centroid file ``file``; anything else (missing, damaged, another safetensors file) is one ConfigError line."""
    from safetensors import safe_open

    path = Path(file)
    if not path.is_file():
        raise ConfigError(f"{key}: no such file {str(path)!r}")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except Exception as exc:  # SafetensorError: not safetensors, truncated, a bad header
        raise ConfigError(f"{key}: {path} is not a readable safetensors file ({type(exc).__name__})") from None
    if meta.get("format") != FORMAT:
        found = f"format {meta['format']!r}" if "format" in meta else "no centroid-file metadata"
        raise ConfigError(
            f"{key}: {path} is not a centroid file ({found}); write one with "
            "python -m pretrain.export --run DIR --only '*.core.*' --out FILE"
        )
    try:
        return Adapter(
            path=path,
            tensors=tensors,
            attention=json.loads(meta["attention"]),
            backbone=json.loads(meta["backbone"]),
            rest_fingerprint=meta["rest_fingerprint"],
            tokenizer_fingerprint=meta["tokenizer_fingerprint"],
            patterns=json.loads(meta["patterns"]),
            source=meta.get("source", ""),
            step=int(meta.get("step", "0")),
        )
    except (KeyError, ValueError) as exc:
        raise ConfigError(f"{key}: {path} has damaged centroid-file metadata ({type(exc).__name__}: {exc})") from None


def check_fits(adapter: Adapter, model_table: dict[str, Any], weights: dict[str, torch.Tensor], tokenizer: str) -> None:
    """One ConfigError line unless ``adapter`` was trained on this backbone: same shape and settings, same
    tokenizer, and bitwise the same tensors outside the file."""
    name = adapter.path.name
    base = _backbone(model_table)
    differ = [k for k in sorted(set(base) | set(adapter.backbone)) if base.get(k) != adapter.backbone.get(k)]
    if differ:
        shown = ", ".join(f"{k}={adapter.backbone.get(k)!r} (base: {base.get(k)!r})" for k in differ[:3])
        raise ConfigError(f"--adapter: {name} was trained on another model shape: {shown}")
    if adapter.tokenizer_fingerprint and tokenizer and adapter.tokenizer_fingerprint != tokenizer:
        raise ConfigError(f"--adapter: {name} was trained with another tokenizer than --base's (fingerprints differ)")
    rest = fingerprint(weights, leave_out=set(adapter.tensors))
    if rest != adapter.rest_fingerprint:
        raise ConfigError(
            f"--adapter: {name} was trained on other backbone weights than --base's (fingerprint "
            f"{adapter.rest_fingerprint[:12]}, base {rest[:12]}); its centroids route that backbone's hidden states"
        )


def apply_adapter(
    base: str | Path, adapter_file: str | Path, out: str | Path, *, log: Callable[[str], None] = print
) -> Path:
    """Checkpoint (or run) ``base`` + centroid file -> checkpoint directory ``out`` (see the module docstring)."""
    from safetensors.torch import load_file, save_model

    from data.tokenizer import load_tokenizer
    from model.transformer import build_model
    from pretrain.checkpoint import write_manifest
    from run.config import run_config_from_dict

    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out: {out} exists and is not an empty directory")
    adapter = read_adapter(adapter_file)
    path = ckpt.resolve_checkpoint(base, key="--base")
    state = ckpt.verify_checkpoint(path, key="--base")
    if not (path / ckpt.MODEL_FILE).is_file():
        raise ConfigError(
            f"--base: {path} holds no {ckpt.MODEL_FILE}; consolidate it first with python -m pretrain.export"
        )
    weights = load_file(str(path / ckpt.MODEL_FILE))
    data = tomllib.loads(state["config"])
    check_fits(adapter, data.setdefault("model", {}), weights, str(state.get("tokenizer_fingerprint", "")))
    data["model"].setdefault("attention", {}).update(adapter.attention)
    try:
        cfg = run_config_from_dict(data)
        cfg.model.validate()
    except ConfigError as exc:
        raise ConfigError(f"--adapter: {adapter.path.name}: its attention table does not validate ({exc})") from None
    model = build_model(cfg.model)
    merged = {k: v for k, v in weights.items() if k not in adapter.tensors}
    params = dict(model.state_dict())
    for name, t in adapter.tensors.items():
        if name not in params or params[name].shape != t.shape:
            have = "no such tensor" if name not in params else f"shape {list(params[name].shape)}"
            raise ConfigError(f"--adapter: {adapter.path.name}: {name} {list(t.shape)} does not fit the model ({have})")
        merged[name] = t.to(params[name].dtype)
    try:
        model.load_state_dict(merged, strict=True)
    except RuntimeError as exc:
        missing = [k for k in params if k not in merged]
        detail = f"lacks {', '.join(missing[:3])}" if missing else str(exc).splitlines()[-1].strip()[:160]
        raise ConfigError(f"--adapter: {adapter.path.name} does not complete --base's model ({detail})") from None

    with atomic_directory(out) as tmp:
        save_model(model, str(tmp / ckpt.MODEL_FILE))
        plain_mode(tmp / ckpt.MODEL_FILE)
        load_tokenizer(ckpt.tokenizer_file(path)).save(tmp)
        tokenizer = load_tokenizer(ckpt.tokenizer_file(tmp)).fingerprint  # what data.tokenizer = out loads
        trainer_state = {
            "step": int(state["step"]),
            "tokens": int(state.get("tokens", 0)),
            "config": cfg.to_toml(),
            "tokenizer_fingerprint": tokenizer,
            "data_fingerprint": "",
            "code_version": "adapter",
            "source": str(path),
            "adapter": str(adapter.path),
        }
        torch.save(trainer_state, tmp / ckpt.TRAINER_STATE)
        meta = {"step": int(state["step"]), "time": time.time(), "base": str(path), "adapter": str(adapter.path)}
        write_manifest(tmp, meta)  # last: the checksums of every file above
    n = sum(t.numel() for t in adapter.tensors.values())
    log(
        f"applied {adapter.path} ({len(adapter.tensors)} tensors, {n:,} parameters, {adapter.attention['kind']}) "
        f"to {path} -> {out}"
    )
    return out


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)


def compare(base: str | Path, other: str | Path, *, log: Callable[[str], None] = print) -> tuple[int, int]:
    """Which tensors ``other`` (a run or checkpoint) shares bitwise with ``base``. Returns (changed, shared)."""
    from safetensors.torch import load_file

    found = []
    for where, key in ((base, "--base"), (other, "--run")):
        path = ckpt.resolve_checkpoint(where, key=key)
        ckpt.verify_checkpoint(path, key=key)
        if not (path / ckpt.MODEL_FILE).is_file():
            raise ConfigError(
                f"{key}: {path} holds no {ckpt.MODEL_FILE}; consolidate it with python -m pretrain.export"
            )
        found.append((path, load_file(str(path / ckpt.MODEL_FILE))))
    (base_path, a), (other_path, b) = found
    shared = sorted(set(a) & set(b))
    changed = [n for n in shared if a[n].shape != b[n].shape or not torch.equal(_bytes(a[n]), _bytes(b[n]))]
    log(f"{other_path} against {base_path}: {len(shared) - len(changed)} of {len(shared)} shared tensors bitwise equal")
    for label, names in (
        ("changed", changed),
        (f"only in {other_path}", sorted(set(b) - set(a))),
        (f"only in {base_path}", sorted(set(a) - set(b))),
    ):
        if names:
            log(f"{label}: {len(names)} ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})")
    return len(changed), len(shared)


@cli_errors
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pretrain.adapters", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    a = sub.add_parser("apply", help="base checkpoint + centroid file -> a checkpoint directory")
    a.add_argument("--base", required=True, help="run or checkpoint directory the centroid file was trained on")
    a.add_argument("--adapter", required=True, help="centroid file (python -m pretrain.export --only '*.core.*')")
    a.add_argument("--out", required=True, help="checkpoint directory to write (must not exist, or be empty)")
    c = sub.add_parser("compare", help="which tensors of --run are bitwise those of --base (exit 1 if any differ)")
    c.add_argument("--base", required=True, help="run or checkpoint directory")
    c.add_argument("--run", required=True, help="run or checkpoint directory trained from --base")
    args = p.parse_args(argv)
    try:
        if args.command == "apply":
            apply_adapter(args.base, args.adapter, args.out)
            return 0
        changed, _ = compare(args.base, args.run)
        return 1 if changed else 0
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
