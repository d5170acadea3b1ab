"""Tensor names between our checkpoints and transformers', and the HF weight files (safetensors, .bin)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from core.errors import ConfigError
from core.files import plain_mode
from model.config import ModelConfig
from model.hf.configs import (
    CUSTOM_WEIGHTS,
    GPT2,
    QWEN3,
    WEIGHT_FILES,
    _refuse,
    hf_architecture,
)

# ---- tensor names --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rule:
    """HF tensor ``hf`` <-> our tensors ``ours`` (several: concatenated along dim 0, GPT-2's fused q/k/v).

    ``transpose``: HF stores it [in, out] (GPT-2's Conv1D). ``zeros``: when our model has no such tensor
    (a bias the HF architecture always has), the export writes zeros of shape ``shape``, which computes the same.
    """

    hf: str
    ours: tuple[str, ...]
    transpose: bool = False
    zeros: bool = False
    shape: tuple[int, ...] = ()


def _rules(cfg: ModelConfig, arch: str) -> list[Rule]:
    d, hd = cfg.d_model, cfg.head_dim
    q_dim, kv_dim = cfg.n_heads * hd, cfg.kv_heads * hd
    has_qkv_bias = cfg.bias or cfg.qkv_bias
    rules: list[Rule] = []
    if arch == GPT2:
        rules += [
            Rule("transformer.wte.weight", ("tok_emb.weight",)),
            Rule("transformer.wpe.weight", ("pos_emb.weight",)),
        ]
        for i in range(cfg.n_layers):
            p, o = f"transformer.h.{i}.", f"blocks.{i}."
            rules += [
                Rule(p + "ln_1.weight", (o + "norm1.weight",)),
                Rule(p + "ln_1.bias", (o + "norm1.bias",)),
                Rule(p + "attn.c_attn.weight", tuple(o + f"attn.w{x}.weight" for x in "qkv"), transpose=True),
                Rule(
                    p + "attn.c_attn.bias",
                    tuple(o + f"attn.w{x}.bias" for x in "qkv") if has_qkv_bias else (),
                    zeros=not has_qkv_bias,
                    shape=(q_dim + 2 * kv_dim,),
                ),
                Rule(p + "attn.c_proj.weight", (o + "attn.wo.weight",), transpose=True),
                Rule(p + "ln_2.weight", (o + "norm2.weight",)),
                Rule(p + "ln_2.bias", (o + "norm2.bias",)),
                Rule(p + "mlp.c_fc.weight", (o + "mlp.up.weight",), transpose=True),
                Rule(p + "mlp.c_proj.weight", (o + "mlp.down.weight",), transpose=True),
            ]
            for hf_name, ours, size in (
                ("attn.c_proj.bias", "attn.wo.bias", d),
                ("mlp.c_fc.bias", "mlp.up.bias", cfg.ffn_dim),
                ("mlp.c_proj.bias", "mlp.down.bias", d),
            ):
                rules.append(Rule(p + hf_name, (o + ours,) if cfg.bias else (), zeros=not cfg.bias, shape=(size,)))
        rules += [Rule("transformer.ln_f.weight", ("norm_f.weight",)), Rule("transformer.ln_f.bias", ("norm_f.bias",))]
    else:
        rules.append(Rule("model.embed_tokens.weight", ("tok_emb.weight",)))
        o_bias = cfg.bias or (arch == QWEN3 and cfg.qkv_bias)  # Qwen3's attention_bias covers o_proj too
        for i in range(cfg.n_layers):
            p, o = f"model.layers.{i}.", f"blocks.{i}."
            rules += [
                Rule(p + "input_layernorm.weight", (o + "norm1.weight",)),
                Rule(p + "post_attention_layernorm.weight", (o + "norm2.weight",)),
            ]
            for x in "qkvo":
                rules.append(Rule(p + f"self_attn.{x}_proj.weight", (o + f"attn.w{x}.weight",)))
            for x in "qkv":
                if has_qkv_bias:
                    rules.append(Rule(p + f"self_attn.{x}_proj.bias", (o + f"attn.w{x}.bias",)))
            if o_bias:
                rules.append(
                    Rule(
                        p + "self_attn.o_proj.bias",
                        (o + "attn.wo.bias",) if cfg.bias else (),
                        zeros=not cfg.bias,
                        shape=(d,),
                    )
                )
            if cfg.qk_norm:
                rules += [
                    Rule(p + "self_attn.q_norm.weight", (o + "attn.q_norm.weight",)),
                    Rule(p + "self_attn.k_norm.weight", (o + "attn.k_norm.weight",)),
                ]
            for hf_name, ours in (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down")):
                rules.append(Rule(p + f"mlp.{hf_name}.weight", (o + f"mlp.{ours}.weight",)))
                if cfg.bias:
                    rules.append(Rule(p + f"mlp.{hf_name}.bias", (o + f"mlp.{ours}.bias",)))
        rules.append(Rule("model.norm.weight", ("norm_f.weight",)))
    if not cfg.tie_embeddings:
        rules.append(Rule("lm_head.weight", ("lm_head.weight",)))
    return rules


def _core_prefixes(arch: str, layer: int) -> tuple[str, str]:
    """(HF, ours) name prefix of a layer's attention-variant tensors."""
    hf = f"transformer.h.{layer}.attn.core." if arch == GPT2 else f"model.layers.{layer}.self_attn.core."
    return hf, f"blocks.{layer}.attn.core."


def _split_sizes(cfg: ModelConfig, rule: Rule) -> list[int]:
    if len(rule.ours) == 1:
        return [-1]
    q_dim, kv_dim = cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    return [q_dim, kv_dim, kv_dim]


def to_hf_state_dict(state: dict[str, Tensor], cfg: ModelConfig, arch: str | None = None) -> dict[str, Tensor]:
    """Our state dict (tied head present or not) -> HF names and layouts. Everything must be used."""
    arch = arch or hf_architecture(cfg)
    used: set[str] = set()
    if cfg.tie_embeddings:  # one tensor under either name (safetensors' save_model keeps one of them)
        state = dict(state)
        if "lm_head.weight" in state:
            state.setdefault("tok_emb.weight", state["lm_head.weight"])
        state.pop("lm_head.weight", None)
    out: dict[str, Tensor] = {}
    for rule in _rules(cfg, arch):
        if not rule.ours:
            like = state["tok_emb.weight"]
            out[rule.hf] = torch.zeros(rule.shape, dtype=like.dtype)
            continue
        missing = [name for name in rule.ours if name not in state]
        if missing:
            raise ConfigError(f"--format hf: the checkpoint lacks {missing[0]} (expected for {rule.hf})")
        parts = [state[name] for name in rule.ours]
        used.update(rule.ours)
        tensor = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        out[rule.hf] = (tensor.t() if rule.transpose else tensor).contiguous()
    for i in range(cfg.n_layers):
        hf_prefix, ours_prefix = _core_prefixes(arch, i)
        for name in [n for n in state if n.startswith(ours_prefix)]:
            out[hf_prefix + name[len(ours_prefix) :]] = state[name].contiguous()
            used.add(name)
    extra = sorted(set(state) - used)
    if extra:
        raise ConfigError(f"--format hf: no {arch} tensor for {', '.join(extra[:3])}")
    return out


# tensors HF checkpoints may carry that hold nothing we use (causal-mask buffers, cached RoPE frequencies)
_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")


def from_hf_state_dict(state: dict[str, Tensor], cfg: ModelConfig, arch: str) -> dict[str, Tensor]:
    """HF names and layouts -> our state dict (tied head included, as ``Transformer.state_dict()`` has it).
    Every HF tensor must be used and every one of ours produced, with the shapes ``cfg`` implies."""
    if arch == GPT2 and not any(k.startswith("transformer.") for k in state):
        state = {("" if k.startswith("lm_head.") else "transformer.") + k: v for k, v in state.items()}  # GPT2Model
    if arch == GPT2:
        state = {k: v for k, v in state.items() if not (k.endswith(_IGNORED_SUFFIXES[:2]) and v.dim() != 1)}
    state = {k: v for k, v in state.items() if not k.endswith(_IGNORED_SUFFIXES[2])}
    used: set[str] = set()
    out: dict[str, Tensor] = {}
    for rule in _rules(cfg, arch):
        if not rule.ours:
            if rule.hf in state:
                raise ConfigError(f"hf: unexpected tensor {rule.hf} for this configuration")
            continue
        if rule.hf not in state:
            raise ConfigError(f"hf: the checkpoint lacks {rule.hf}")
        used.add(rule.hf)
        tensor = state[rule.hf]
        tensor = tensor.t() if rule.transpose else tensor
        for name, part in zip(
            rule.ours, tensor.split(_split_sizes(cfg, rule), dim=0) if len(rule.ours) > 1 else [tensor]
        ):
            out[name] = part.contiguous()
    if cfg.tie_embeddings:
        head = state.get("lm_head.weight")
        if head is not None:
            if not torch.equal(head, state[_rules(cfg, arch)[0].hf]):
                raise _refuse(arch, "tie_word_embeddings=true but an lm_head.weight that differs from the embedding")
            used.add("lm_head.weight")
        out["lm_head.weight"] = out["tok_emb.weight"]
    for i in range(cfg.n_layers):
        hf_prefix, ours_prefix = _core_prefixes(arch, i)
        for name in [n for n in state if n.startswith(hf_prefix)]:
            out[ours_prefix + name[len(hf_prefix) :]] = state[name]
            used.add(name)
    extra = sorted(set(state) - used)
    if extra:
        raise ConfigError(f"hf: tensors this {arch} mapping does not know: {', '.join(extra[:3])}")
    return out


# ---- weight files --------------------------------------------------------------------------------


def _index_files(index: Path) -> list[str]:
    """The weight files a ``*.index.json`` names (its ``weight_map`` values), or one ConfigError line naming the
    file and the field: not JSON, no ``weight_map`` object, or a value that is not a file name in the folder."""
    try:
        data = json.loads(index.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"hf: {index} is not valid JSON ({type(exc).__name__}: {str(exc)[:120]})") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ConfigError(f"hf: {index}: weight_map: missing or not an object of tensor name -> file")
    files = set(weight_map.values())
    for name in files:
        if not isinstance(name, str) or not name or Path(name).name != name or name in (".", ".."):
            raise ConfigError(f"hf: {index}: weight_map: {name!r} is not a file name in the model folder")
    return sorted(files)


def check_hf_indexes(path: str | Path) -> None:
    """Every weight index the folder holds parses (``_index_files``): what ``load_hf_weights`` will read, checked
    when the config is (``--dry-run`` included), without reading a tensor."""
    for name in WEIGHT_FILES:
        if name.endswith(".index.json") and (Path(path) / name).is_file():
            _index_files(Path(path) / name)


def load_hf_weights(path: str | Path) -> dict[str, Tensor]:
    """Every tensor of a HF model directory: model.safetensors (or its shards), else pytorch_model.bin
    (or its shards) read with ``torch.load(weights_only=True)``."""
    from safetensors.torch import load_file

    path = Path(path)
    loaders: list[tuple[str, Callable[[str], dict[str, Tensor]]]] = [
        ("safetensors", load_file),
        ("bin", lambda f: torch.load(f, map_location="cpu", weights_only=True)),
    ]
    stems = {"safetensors": ("model", CUSTOM_WEIGHTS), "bin": ("pytorch_model",)}
    for (ext, load), stem in [(loader, stem) for loader in loaders for stem in stems[loader[0]]]:
        single = path / f"{stem}.{ext}"
        index = single.with_name(single.name + ".index.json")
        if single.is_file():
            files = [single]
        elif index.is_file():
            files = [path / f for f in _index_files(index)]
        else:
            continue
        state: dict[str, Tensor] = {}
        for file in files:
            try:
                state.update(load(str(file)))
            except Exception as exc:  # a truncated or foreign file: say which
                raise ConfigError(
                    f"hf: cannot read {file} ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})"
                ) from None
        return state
    raise ConfigError(f"--hf: {path} has none of {', '.join(WEIGHT_FILES)}")


def save_hf_weights(
    state: dict[str, Tensor], out: str | Path, *, max_shard_size: int | str = "5GB", stem: str = "model"
) -> list[str]:
    """Write ``state`` as ``<stem>.safetensors``, or shards plus ``<stem>.safetensors.index.json`` past
    ``max_shard_size`` (huggingface_hub's own splitting); returns the files written."""
    from huggingface_hub import save_torch_state_dict, split_torch_state_dict_into_shards

    pattern = stem + "{suffix}.safetensors"
    save_torch_state_dict(
        state, str(out), filename_pattern=pattern, max_shard_size=max_shard_size, metadata={"format": "pt"}
    )
    split = split_torch_state_dict_into_shards(state, filename_pattern=pattern, max_shard_size=max_shard_size)
    files = sorted(split.filename_to_tensors)
    plain_mode(*(Path(out) / f for f in files))
    if split.is_sharded:
        files.append(f"{stem}.safetensors.index.json")
    return files


def cast(state: dict[str, Tensor], dtype: torch.dtype) -> dict[str, Tensor]:
    """Floating tensors to ``dtype`` (integer buffers unchanged)."""
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
