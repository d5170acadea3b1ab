"""Hugging Face ``transformers`` checkpoints <-> this project's ``Transformer``: one key and config mapping,
used by the export (``python -m pretrain.export --format hf``) and the import (``python -m pretrain.hf_import``).

Architectures (``config.json``'s ``architectures[0]``, else its ``model_type``):

- ``GPT2LMHeadModel`` <-> family ``gpt2``: learned positions, LayerNorm, GELU (tanh), biases; HF keeps
  q/k/v fused in one ``Conv1D`` (``c_attn``, weights stored [in, out]), split and transposed here.
- ``LlamaForCausalLM`` / ``MistralForCausalLM`` / ``Qwen2ForCausalLM`` / ``Qwen3ForCausalLM`` <-> family ``llama``:
  RMSNorm, SwiGLU, RoPE (and its scaling), GQA. Qwen2 has biases on q/k/v only (``model.qkv_bias``),
  Qwen3 RMS-normalises q and k per head (``model.qk_norm``). Mistral's and Qwen2's sliding window is mapped,
  not emulated: the imported model's ``max_seq_len`` is capped at the window, below which sliding-window
  and full causal attention compute the same thing.

The export picks the architecture from the model: GPT-2 for family ``gpt2``; Qwen3 with ``qk_norm``, Qwen2
with ``qkv_bias`` alone, else LLaMA. RoPE scaling maps onto ``rope_parameters`` (transformers 5) and
``rope_scaling`` + ``rope_theta`` (transformers 4); static NTK has no HF type and is written as the plain
RoPE base it amounts to, theta * factor^(d / (d - 2)).

``transformers`` runs full attention only. A model with another attention variant is refused unless the
caller allows it; then config.json says so twice: ``model_type`` becomes ``focused_<type>`` (so
``AutoModelForCausalLM`` refuses it instead of silently running full attention) and ``focused_attention``
holds the variant's settings; the variant's own tensors keep their names under the layer
(``...self_attn.core.*``). The import reads both back.

Every unsupported option is one ``ConfigError`` line naming it.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from core.errors import ConfigError
from model.config import ModelConfig, RopeConfig

GPT2 = "GPT2LMHeadModel"
LLAMA = "LlamaForCausalLM"
MISTRAL = "MistralForCausalLM"
QWEN2 = "Qwen2ForCausalLM"
QWEN3 = "Qwen3ForCausalLM"
ARCHITECTURES = {GPT2: "gpt2", LLAMA: "llama", MISTRAL: "mistral", QWEN2: "qwen2", QWEN3: "qwen3"}  # -> model_type
VARIANT_KEY = "focused_attention"  # config.json: the attention variant transformers cannot run
VARIANT_TYPE_PREFIX = "focused_"  # config.json model_type of such an export
GPT2_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")  # the tanh approximation our GPT-2 MLP uses
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


@dataclass
class Imported:
    """What ``model_config_from_hf`` makes of a config.json."""

    model: ModelConfig
    architecture: str
    notes: list[str] = field(default_factory=list)  # mappings the user should know about (one line each)


# ---- config.json -> ModelConfig --------------------------------------------------------------------


def load_hf_config(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    file = path / "config.json"
    if not file.is_file():
        raise ConfigError(f"--hf: {path} has no config.json (not a Hugging Face model directory)")
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--hf: {file} is not valid JSON ({exc})") from None


def architecture_of(hf: dict[str, Any]) -> str:
    """The supported architecture a config.json describes (a variant export's ``focused_`` prefix removed)."""
    archs = hf.get("architectures") or []
    model_type = str(hf.get("model_type", "")).removeprefix(VARIANT_TYPE_PREFIX)
    by_type = {t: a for a, t in ARCHITECTURES.items()}
    name = archs[0] if archs else by_type.get(model_type, model_type or "(no architectures or model_type)")
    if name not in ARCHITECTURES:
        raise ConfigError(f"hf: architecture {name} is not supported (supported: {', '.join(ARCHITECTURES)})")
    return name


def _get(hf: dict[str, Any], key: str, default: Any = None) -> Any:
    value = hf.get(key, default)
    return default if value is None else value


def _refuse(arch: str, what: str) -> ConfigError:
    return ConfigError(f"hf: {arch} with {what} is not supported")


def rope_from_hf(hf: dict[str, Any], arch: str, max_pos: int) -> tuple[RopeConfig, int, list[str]]:
    """(RopeConfig, max_seq_len, notes) from ``rope_parameters`` (transformers 5) or ``rope_scaling`` +
    ``rope_theta`` (transformers 4)."""
    params = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
    if any(isinstance(v, dict) for v in params.values()):
        raise _refuse(arch, "per-layer-type RoPE parameters")
    theta = float(params.get("rope_theta") or _get(hf, "rope_theta", 10000.0))
    kind = params.get("rope_type") or params.get("type") or "default"
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    if partial not in (None, 1, 1.0):
        raise _refuse(arch, f"partial_rotary_factor={partial} (RoPE on part of each head)")
    factor = params.get("factor")
    original = params.get("original_max_position_embeddings")
    if kind == "default":
        return RopeConfig(theta=theta), max_pos, []
    if kind == "linear":
        return RopeConfig(theta=theta, scaling="linear", factor=float(factor)), max_pos, []
    if kind == "dynamic":
        # HF's dynamic NTK grows the base past max_position_embeddings, its original length
        rope = RopeConfig(theta=theta, scaling="dynamic_ntk", factor=float(factor), original_max_seq_len=max_pos)
        length = int(max_pos * float(factor))
        return rope, length, [f"rope: dynamic NTK from {max_pos} tokens; max_seq_len set to {length} (x factor)"]
    if kind == "yarn":
        if params.get("mscale") or params.get("mscale_all_dim"):
            raise _refuse(arch, "YaRN mscale / mscale_all_dim (DeepSeek's attention factor)")
        if params.get("truncate") is False:
            raise _refuse(arch, "YaRN truncate=false")
        original = int(original or max_pos)
        rope = RopeConfig(
            theta=theta,
            scaling="yarn",
            factor=float(factor or max_pos / original),
            original_max_seq_len=original,
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            attention_factor=float(params.get("attention_factor") or 0.0),
        )
        return rope, max_pos, []
    if kind == "llama3":
        rope = RopeConfig(
            theta=theta,
            scaling="llama3",
            factor=float(factor),
            original_max_seq_len=int(original),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        )
        return rope, max_pos, []
    raise _refuse(arch, f"RoPE type {kind!r} (supported: default, linear, dynamic, yarn, llama3)")


def model_config_from_hf(hf: dict[str, Any]) -> Imported:
    """A ``config.json`` (as a dict) -> the matching ModelConfig, or one ConfigError line naming what is unsupported."""
    arch = architecture_of(hf)
    notes: list[str] = []
    if arch == GPT2:
        act = hf.get("activation_function", "gelu_new")
        if act not in GPT2_ACTIVATIONS:
            raise _refuse(arch, f"activation_function={act!r} (supported: {', '.join(GPT2_ACTIVATIONS)})")
        for key, ok in (("scale_attn_by_inverse_layer_idx", False), ("scale_attn_weights", True)):
            if bool(hf.get(key, ok)) != ok:
                raise _refuse(arch, f"{key}={hf.get(key)}")
        if hf.get("add_cross_attention"):
            raise _refuse(arch, "add_cross_attention=true")
        d = int(hf["n_embd"])
        cfg = ModelConfig(
            family="gpt2",
            vocab_size=int(hf["vocab_size"]),
            max_seq_len=int(hf.get("n_positions", 1024)),
            d_model=d,
            n_layers=int(hf["n_layer"]),
            n_heads=int(hf["n_head"]),
            d_ff=int(_get(hf, "n_inner", 4 * d)),
            norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
            bias=True,
            init_std=float(hf.get("initializer_range", 0.02)),
        )
    else:
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise _refuse(arch, f"hidden_act={act!r} (SwiGLU needs silu)")
        d, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
        head_dim = hf.get("head_dim")
        if head_dim is not None and int(head_dim) * heads != d:
            raise _refuse(arch, f"head_dim={head_dim} != hidden_size / num_attention_heads = {d // heads}")
        attention_bias = bool(hf.get("attention_bias", False))
        mlp_bias = bool(hf.get("mlp_bias", False))
        bias = qkv_bias = False
        if arch == QWEN2:
            qkv_bias = True  # Qwen2 always has q/k/v biases and none elsewhere
        elif attention_bias or mlp_bias:
            if arch != LLAMA or attention_bias != mlp_bias:
                raise _refuse(
                    arch,
                    f"attention_bias={attention_bias}, mlp_bias={mlp_bias} (biases everywhere or nowhere; "
                    "q/k/v-only biases are Qwen2's)",
                )
            bias = True
        max_pos = int(hf.get("max_position_embeddings", 2048))
        rope, max_seq_len, rope_notes = rope_from_hf(hf, arch, max_pos)
        notes += rope_notes
        window = _sliding_window(hf, arch)
        if window is not None and window < max_seq_len:
            notes.append(
                f"sliding window {window}: max_seq_len capped at {window} (from {max_seq_len}); up to that length "
                "sliding-window and full causal attention are the same"
            )
            max_seq_len = window
        kv = int(_get(hf, "num_key_value_heads", heads))
        cfg = ModelConfig(
            family="llama",
            vocab_size=int(hf["vocab_size"]),
            max_seq_len=max_seq_len,
            d_model=d,
            n_layers=int(hf["num_hidden_layers"]),
            n_heads=heads,
            n_kv_heads=0 if kv == heads else kv,
            d_ff=int(hf["intermediate_size"]),
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            qk_norm=arch == QWEN3,
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            bias=bias,
            qkv_bias=qkv_bias,
            init_std=float(hf.get("initializer_range", 0.02)),
            rope=rope,
        )
    variant = hf.get(VARIANT_KEY)
    if variant is not None:
        _set_variant(cfg, variant)
        notes.append(f"attention variant {cfg.attention.kind!r} restored from config.json's {VARIANT_KEY}")
    cfg.validate()
    return Imported(cfg, arch, notes)


def _sliding_window(hf: dict[str, Any], arch: str) -> int | None:
    if arch == MISTRAL:
        window = hf.get("sliding_window")
    elif arch in (QWEN2, QWEN3):
        layers = hf.get("layer_types") or []
        used = hf.get("use_sliding_window") or "sliding_attention" in layers
        window = hf.get("sliding_window") if used else None
    else:
        window = None
    return None if window is None else int(window)


def _set_variant(cfg: ModelConfig, variant: dict[str, Any]) -> None:
    kind = variant.get("kind")
    options = cfg.attention.options
    if kind not in options:
        raise ConfigError(f"hf: {VARIANT_KEY}.kind {kind!r} is not a registered attention variant")
    cfg.attention.kind = kind
    cfg.attention.impl = variant.get("impl", cfg.attention.impl)
    known = {f.name for f in dataclasses.fields(options[kind])}
    for key, value in (variant.get("options") or {}).items():
        if key not in known:
            raise ConfigError(f"hf: {VARIANT_KEY}.options.{key}: unknown option of attention variant {kind!r}")
        setattr(options[kind], key, value)


# ---- ModelConfig -> config.json --------------------------------------------------------------------


def hf_architecture(cfg: ModelConfig) -> str:
    """The HF architecture that computes what ``cfg`` does, or one ConfigError line saying why none does."""
    if cfg.family == "gpt2":
        if cfg.kv_heads != cfg.n_heads:
            raise ConfigError(f"--format hf: {GPT2} has no grouped-query attention (model.n_kv_heads={cfg.n_kv_heads})")
        if cfg.qk_norm:
            raise ConfigError(f"--format hf: {GPT2} has no QK-norm (model.qk_norm=true)")
        return GPT2
    if cfg.qk_norm:
        if cfg.bias:
            raise ConfigError(f"--format hf: {QWEN3} (QK-norm) has no MLP biases (model.bias=true)")
        return QWEN3
    if cfg.qkv_bias and not cfg.bias:
        return QWEN2
    return LLAMA


def rope_to_hf(cfg: ModelConfig) -> tuple[dict[str, Any], int]:
    """(rope_parameters, max_position_embeddings) equal to ``cfg.rope`` in transformers."""
    from model.rope import original_length, resolved_factor

    r, d = cfg.rope, cfg.head_dim
    factor = resolved_factor(r)
    if r.scaling == "none":
        return {"rope_type": "default", "rope_theta": r.theta}, cfg.max_seq_len
    if r.scaling == "ntk":  # static NTK-aware: a larger base, nothing else
        return {"rope_type": "default", "rope_theta": r.theta * factor ** (d / (d - 2))}, cfg.max_seq_len
    if r.scaling == "linear":
        return {"rope_type": "linear", "rope_theta": r.theta, "factor": factor}, cfg.max_seq_len
    original = original_length(r, cfg.max_seq_len)
    if r.scaling == "dynamic_ntk":  # HF's original length is max_position_embeddings
        return {"rope_type": "dynamic", "rope_theta": r.theta, "factor": factor}, original
    if r.scaling == "yarn":
        params = {
            "rope_type": "yarn",
            "rope_theta": r.theta,
            "factor": factor,
            "original_max_position_embeddings": original,
            "beta_fast": r.beta_fast,
            "beta_slow": r.beta_slow,
        }
        if r.attention_factor:
            params["attention_factor"] = r.attention_factor
        return params, cfg.max_seq_len
    if r.scaling == "llama3":
        params = {
            "rope_type": "llama3",
            "rope_theta": r.theta,
            "factor": factor,
            "low_freq_factor": r.low_freq_factor,
            "high_freq_factor": r.high_freq_factor,
            "original_max_position_embeddings": original,
        }
        return params, cfg.max_seq_len
    raise ConfigError(f"--format hf: model.rope.scaling {r.scaling!r} has no transformers equivalent")


def variant_settings(cfg: ModelConfig) -> dict[str, Any]:
    """The attention variant's settings as written under config.json's ``focused_attention``."""
    return {
        "kind": cfg.attention.kind,
        "impl": cfg.attention.impl,
        "options": dataclasses.asdict(cfg.attention.variant),
        "note": (
            f"transformers cannot run the {cfg.attention.kind!r} attention this model was trained with: it "
            "implements full attention only. Run it with the focused-pretrain code (python -m pretrain.hf_import)."
        ),
    }


def hf_config_from_model(
    cfg: ModelConfig,
    *,
    eos_id: int | None,
    bos_id: int | None,
    dtype: str = "float32",
    allow_variant: bool = False,
) -> dict[str, Any]:
    """config.json for ``cfg``. A non-full attention variant is a ConfigError unless ``allow_variant``."""
    arch = hf_architecture(cfg)
    if cfg.attention.kind != "full" and not allow_variant:
        raise ConfigError(
            f"--format hf: model.attention.kind={cfg.attention.kind!r} cannot run in transformers (full attention "
            f"only); pass --allow-variant to export it anyway (config.json then names the variant under "
            f"{VARIANT_KEY!r} and AutoModelForCausalLM refuses it)"
        )
    common = {
        "architectures": [arch],
        "model_type": ARCHITECTURES[arch],
        "vocab_size": cfg.vocab_size,
        "initializer_range": cfg.init_std,
        "tie_word_embeddings": cfg.tie_embeddings,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "use_cache": True,
        "dtype": dtype,
    }
    if arch == GPT2:
        out = common | {
            "n_positions": cfg.max_seq_len,
            "n_embd": cfg.d_model,
            "n_layer": cfg.n_layers,
            "n_head": cfg.n_heads,
            "n_inner": cfg.ffn_dim,
            "activation_function": "gelu_new",
            "layer_norm_epsilon": cfg.norm_eps,
            "resid_pdrop": cfg.dropout,
            "embd_pdrop": cfg.dropout,
            "attn_pdrop": 0.0,
            "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False,
        }
    else:
        rope, max_pos = rope_to_hf(cfg)
        out = common | {
            "hidden_size": cfg.d_model,
            "intermediate_size": cfg.ffn_dim,
            "num_hidden_layers": cfg.n_layers,
            "num_attention_heads": cfg.n_heads,
            "num_key_value_heads": cfg.kv_heads,
            "head_dim": cfg.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": max_pos,
            "rms_norm_eps": cfg.norm_eps,
            "attention_dropout": 0.0,
            "rope_parameters": rope,
            "rope_theta": rope["rope_theta"],  # transformers 4 reads this, and rope_scaling below
        }
        if rope["rope_type"] != "default":
            out["rope_scaling"] = rope
        if arch == LLAMA:
            out |= {"attention_bias": cfg.bias, "mlp_bias": cfg.bias}
        elif arch == QWEN3:
            out |= {"attention_bias": cfg.qkv_bias, "use_sliding_window": False, "sliding_window": None}
        else:
            out |= {"use_sliding_window": False, "sliding_window": None, "max_window_layers": cfg.n_layers}
    if cfg.attention.kind != "full":
        out["model_type"] = VARIANT_TYPE_PREFIX + out["model_type"]
        out[VARIANT_KEY] = variant_settings(cfg)
    return out


def generation_config(eos_id: int | None, bos_id: int | None) -> dict[str, Any]:
    return {"bos_token_id": bos_id, "eos_token_id": eos_id}


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
        state.setdefault("tok_emb.weight", state.get("lm_head.weight"))
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


def load_hf_weights(path: str | Path) -> dict[str, Tensor]:
    """Every tensor of a HF model directory: model.safetensors (or its shards), else pytorch_model.bin
    (or its shards) read with ``torch.load(weights_only=True)``."""
    from safetensors.torch import load_file

    path = Path(path)
    loaders: list[tuple[str, Callable[[str], dict[str, Tensor]]]] = [
        ("safetensors", load_file),
        ("bin", lambda f: torch.load(f, map_location="cpu", weights_only=True)),
    ]
    for ext, load in loaders:
        single, index = path / f"{'model' if ext == 'safetensors' else 'pytorch_model'}.{ext}", None
        index = single.with_name(single.name + ".index.json")
        if single.is_file():
            files = [single]
        elif index.is_file():
            files = [path / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
        else:
            continue
        state: dict[str, Tensor] = {}
        for file in files:
            try:
                state.update(load(str(file)))
            except Exception as exc:  # noqa: BLE001 - a truncated or foreign file: say which
                raise ConfigError(
                    f"hf: cannot read {file} ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})"
                ) from None
        return state
    raise ConfigError(f"--hf: {path} has none of {', '.join(WEIGHT_FILES)}")


def save_hf_weights(state: dict[str, Tensor], out: str | Path, *, max_shard_size: int | str = "5GB") -> list[str]:
    """Write ``state`` as ``model.safetensors``, or shards plus ``model.safetensors.index.json`` past
    ``max_shard_size`` (huggingface_hub's own splitting); returns the files written."""
    from huggingface_hub import save_torch_state_dict, split_torch_state_dict_into_shards

    save_torch_state_dict(state, str(out), max_shard_size=max_shard_size, metadata={"format": "pt"})
    split = split_torch_state_dict_into_shards(state, max_shard_size=max_shard_size)
    files = sorted(split.filename_to_tensors)
    if split.is_sharded:
        files.append("model.safetensors.index.json")
    return files


def cast(state: dict[str, Tensor], dtype: torch.dtype) -> dict[str, Tensor]:
    """Floating tensors to ``dtype`` (integer buffers unchanged)."""
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
