"""config.json <-> ModelConfig for the families transformers runs natively (GPT-2, LLaMA, Mistral, Qwen2/3)."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
CUSTOM_PREFIX = "Focused"  # its architectures name (FocusedLlamaForCausalLM): its own class, from custom code
# its weights: not model.safetensors, so that a stock class (LlamaForCausalLM.from_pretrained) finds no weights and
# fails instead of loading the tensors it knows and running full attention
CUSTOM_WEIGHTS = "focused_model"
GPT2_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")  # the tanh approximation our GPT-2 MLP uses
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    f"{CUSTOM_WEIGHTS}.safetensors",
    f"{CUSTOM_WEIGHTS}.safetensors.index.json",
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
    """``path/config.json`` as a dict, or one ConfigError line naming the file (missing, not UTF-8 JSON, not an
    object)."""
    path = Path(path)
    file = path / "config.json"
    if not file.is_file():
        raise ConfigError(f"--hf: {path} has no config.json (not a Hugging Face model directory)")
    try:
        data = json.loads(file.read_bytes().decode("utf-8"))
    except UnicodeDecodeError:
        raise ConfigError(f"--hf: {file} is not text (UTF-8 JSON expected)") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--hf: {file} is not valid JSON ({exc})") from None
    except OSError as exc:
        raise ConfigError(f"--hf: cannot read {file} ({exc.strerror or exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--hf: {file} must hold a JSON object, got {type(data).__name__}")
    return data


class _Fields:
    """Typed reads of a config.json's fields: a missing required key, or a value of the wrong type ("two" for a
    number, a float for an integer), is one ConfigError line naming the file and the field."""

    def __init__(self, hf: dict[str, Any], source: str, prefix: str = ""):
        self.hf, self.source, self.prefix = hf, source, prefix

    def _bad(self, key: str, what: str) -> ConfigError:
        return ConfigError(f"hf: {self.source}: {self.prefix}{key}: {what}")

    def raw(self, key: str, default: Any = None, *, required: bool = False) -> Any:
        value = self.hf.get(key)
        if value is None:
            if required:
                raise self._bad(key, "missing (a required field)")
            return default
        return value

    def integer(self, key: str, default: int | None = None, *, required: bool = False) -> int:
        value = self.raw(key, default, required=required)
        number = value if isinstance(value, (int, float)) and not isinstance(value, bool) else None
        if number is None or not math.isfinite(number) or number != int(number):
            raise self._bad(key, f"must be an integer, got {value!r}")
        return int(number)

    def number(self, key: str, default: float | None = None, *, required: bool = False) -> float:
        value = self.raw(key, default, required=required)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise self._bad(key, f"must be a finite number, got {value!r}")
        return float(value)

    def flag(self, key: str, default: bool) -> bool:
        value = self.raw(key, default)
        if not isinstance(value, bool):
            raise self._bad(key, f"must be true or false, got {value!r}")
        return value

    def text(self, key: str, default: str) -> str:
        value = self.raw(key, default)
        if not isinstance(value, str):
            raise self._bad(key, f"must be a string, got {value!r}")
        return value

    def table(self, key: str) -> dict[str, Any]:
        value = self.raw(key, {})
        if not isinstance(value, dict):
            raise self._bad(key, f"must be an object, got {value!r}")
        return value


def architecture_of(hf: dict[str, Any], source: str = "config.json") -> str:
    """The supported architecture a config.json describes (a variant export's ``focused_`` prefix removed)."""
    fields = _Fields(hf, source)
    archs = fields.raw("architectures", [])
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise fields._bad("architectures", f"must be a list of class names, got {archs!r}")
    model_type = fields.text("model_type", "").removeprefix(VARIANT_TYPE_PREFIX)
    by_type = {t: a for a, t in ARCHITECTURES.items()}
    name = archs[0] if archs else by_type.get(model_type, model_type or "(no architectures or model_type)")
    if name.startswith(CUSTOM_PREFIX) and name.removeprefix(CUSTOM_PREFIX) in ARCHITECTURES:
        name = name.removeprefix(CUSTOM_PREFIX)
    if name not in ARCHITECTURES:
        raise ConfigError(f"hf: architecture {name} is not supported (supported: {', '.join(ARCHITECTURES)})")
    return name


def _refuse(arch: str, what: str) -> ConfigError:
    return ConfigError(f"hf: {arch} with {what} is not supported")


def rope_from_hf(
    hf: dict[str, Any], arch: str, max_pos: int, source: str = "config.json"
) -> tuple[RopeConfig, int, list[str]]:
    """(RopeConfig, max_seq_len, notes) from ``rope_parameters`` (transformers 5) or ``rope_scaling`` +
    ``rope_theta`` (transformers 4)."""
    top = _Fields(hf, source)
    key = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    params = dict(top.table(key))
    if any(isinstance(v, dict) for v in params.values()):
        raise _refuse(arch, "per-layer-type RoPE parameters")
    rope = _Fields(params, source, f"{key}.")
    theta = rope.number("rope_theta", 0.0) or top.number("rope_theta", 10000.0)
    kind = rope.text("rope_type", "") or rope.text("type", "") or "default"
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    if partial not in (None, 1, 1.0):
        raise _refuse(arch, f"partial_rotary_factor={partial} (RoPE on part of each head)")
    if kind == "default":
        return RopeConfig(theta=theta), max_pos, []
    if kind == "linear":
        return RopeConfig(theta=theta, scaling="linear", factor=_required(rope, "factor", kind)), max_pos, []
    if kind == "dynamic":
        # HF's dynamic NTK grows the base past max_position_embeddings, its original length
        factor = _required(rope, "factor", kind)
        config = RopeConfig(theta=theta, scaling="dynamic_ntk", factor=factor, original_max_seq_len=max_pos)
        length = int(max_pos * factor)
        return config, length, [f"rope: dynamic NTK from {max_pos} tokens; max_seq_len set to {length} (x factor)"]
    if kind == "yarn":
        if params.get("mscale") or params.get("mscale_all_dim"):
            raise _refuse(arch, "YaRN mscale / mscale_all_dim (DeepSeek's attention factor)")
        if params.get("truncate") is False:
            raise _refuse(arch, "YaRN truncate=false")
        original = rope.integer("original_max_position_embeddings", 0) or max_pos
        config = RopeConfig(
            theta=theta,
            scaling="yarn",
            factor=rope.number("factor", 0.0) or max_pos / original,
            original_max_seq_len=original,
            beta_fast=rope.number("beta_fast", 0.0) or 32.0,
            beta_slow=rope.number("beta_slow", 0.0) or 1.0,
            attention_factor=rope.number("attention_factor", 0.0),
        )
        return config, max_pos, []
    if kind == "llama3":
        config = RopeConfig(
            theta=theta,
            scaling="llama3",
            factor=_required(rope, "factor", kind),
            original_max_seq_len=int(_required(rope, "original_max_position_embeddings", kind, integer=True)),
            low_freq_factor=rope.number("low_freq_factor", 1.0),
            high_freq_factor=rope.number("high_freq_factor", 4.0),
        )
        return config, max_pos, []
    raise _refuse(arch, f"RoPE type {kind!r} (supported: default, linear, dynamic, yarn, llama3)")


def _required(rope: _Fields, key: str, kind: str, *, integer: bool = False) -> float:
    """``rope[key]``, which rope type ``kind`` cannot do without (a one-line error, not float(None)'s TypeError)."""
    if rope.hf.get(key) is None:
        raise ConfigError(f"hf: {rope.prefix}{key}: required by rope type {kind!r}")
    return rope.integer(key) if integer else rope.number(key)


def model_config_from_hf(hf: dict[str, Any], source: str = "config.json") -> Imported:
    """A ``config.json`` (as a dict) -> the matching ModelConfig, or one ConfigError line naming what is
    unsupported or malformed (``source``: the file, for the message)."""
    if not isinstance(hf, dict):
        raise ConfigError(f"hf: {source} must hold a JSON object, got {type(hf).__name__}")
    arch = architecture_of(hf, source)
    f = _Fields(hf, source)
    notes: list[str] = []
    if arch == GPT2:
        act = f.text("activation_function", "gelu_new")
        if act not in GPT2_ACTIVATIONS:
            raise _refuse(arch, f"activation_function={act!r} (supported: {', '.join(GPT2_ACTIVATIONS)})")
        for key, ok in (("scale_attn_by_inverse_layer_idx", False), ("scale_attn_weights", True)):
            if bool(hf.get(key, ok)) != ok:
                raise _refuse(arch, f"{key}={hf.get(key)}")
        if hf.get("add_cross_attention"):
            raise _refuse(arch, "add_cross_attention=true")
        d = f.integer("n_embd", required=True)
        cfg = ModelConfig(
            family="gpt2",
            vocab_size=f.integer("vocab_size", required=True),
            max_seq_len=f.integer("n_positions", 1024),
            d_model=d,
            n_layers=f.integer("n_layer", required=True),
            n_heads=f.integer("n_head", required=True),
            d_ff=f.integer("n_inner", 4 * d),
            norm_eps=f.number("layer_norm_epsilon", 1e-5),
            tie_embeddings=f.flag("tie_word_embeddings", True),
            bias=True,
            init_std=f.number("initializer_range", 0.02),
        )
    else:
        act = f.text("hidden_act", "silu")
        if act != "silu":
            raise _refuse(arch, f"hidden_act={act!r} (SwiGLU needs silu)")
        d, heads = f.integer("hidden_size", required=True), f.integer("num_attention_heads", required=True)
        if heads < 1:
            raise f._bad("num_attention_heads", f"must be >= 1, got {heads}")
        head_dim = f.integer("head_dim", 0) or None
        if head_dim is not None and head_dim * heads != d:
            raise _refuse(arch, f"head_dim={head_dim} != hidden_size / num_attention_heads = {d // heads}")
        attention_bias = f.flag("attention_bias", False)
        mlp_bias = f.flag("mlp_bias", False)
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
        max_pos = f.integer("max_position_embeddings", 2048)
        rope, max_seq_len, rope_notes = rope_from_hf(hf, arch, max_pos, source)
        notes += rope_notes
        window = _sliding_window(f, arch)
        if window is not None and window < max_seq_len:
            notes.append(
                f"sliding window {window}: max_seq_len capped at {window} (from {max_seq_len}); up to that length "
                "sliding-window and full causal attention are the same"
            )
            max_seq_len = window
        kv = f.integer("num_key_value_heads", heads)
        cfg = ModelConfig(
            family="llama",
            vocab_size=f.integer("vocab_size", required=True),
            max_seq_len=max_seq_len,
            d_model=d,
            n_layers=f.integer("num_hidden_layers", required=True),
            n_heads=heads,
            n_kv_heads=0 if kv == heads else kv,
            d_ff=f.integer("intermediate_size", required=True),
            norm_eps=f.number("rms_norm_eps", 1e-6),
            qk_norm=arch == QWEN3,
            tie_embeddings=f.flag("tie_word_embeddings", False),
            bias=bias,
            qkv_bias=qkv_bias,
            init_std=f.number("initializer_range", 0.02),
            rope=rope,
        )
    variant = hf.get(VARIANT_KEY)
    if variant is not None:
        _set_variant(cfg, f.table(VARIANT_KEY))
        notes.append(f"attention variant {cfg.attention.kind!r} restored from config.json's {VARIANT_KEY}")
    try:
        cfg.validate()
    except ConfigError as exc:  # a size the file gives, as this project names it: say which file
        raise ConfigError(f"hf: {source}: {exc}") from None
    return Imported(cfg, arch, notes)


def _sliding_window(f: _Fields, arch: str) -> int | None:
    if arch == MISTRAL:
        window = f.integer("sliding_window", 0)
    elif arch in (QWEN2, QWEN3):
        layers = f.raw("layer_types", [])
        used = f.raw("use_sliding_window", False) or (isinstance(layers, list) and "sliding_attention" in layers)
        window = f.integer("sliding_window", 0) if used else 0
    else:
        window = 0
    return window or None


def _set_variant(cfg: ModelConfig, variant: dict[str, Any]) -> None:
    kind = variant.get("kind")
    options = cfg.attention.options
    if not isinstance(kind, str) or kind not in options:
        raise ConfigError(f"hf: {VARIANT_KEY}.kind {kind!r} is not a registered attention variant")
    cfg.attention.kind = kind
    cfg.attention.impl = variant.get("impl", cfg.attention.impl)
    known = {f.name for f in dataclasses.fields(options[kind])}
    extra = variant.get("options") or {}
    if not isinstance(extra, dict):
        raise ConfigError(f"hf: {VARIANT_KEY}.options: must be an object, got {extra!r}")
    for key, value in extra.items():
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
            f"the {cfg.attention.kind!r} attention this model was trained with is not in transformers: load it "
            "with AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True), which runs the modeling "
            "code in this folder, or with python -m pretrain.hf_import."
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
            f"--format hf: model.attention.kind={cfg.attention.kind!r} is not in transformers (full attention "
            f"only); pass --allow-variant to export it with its own modeling code (loaded with "
            f"trust_remote_code=True; without it AutoModelForCausalLM refuses it)"
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
    if cfg.attention.kind != "full":  # custom code (model/hf/custom_code.py adds auto_map)
        out["architectures"] = [CUSTOM_PREFIX + arch]
        out["model_type"] = VARIANT_TYPE_PREFIX + str(out["model_type"])
        out["use_cache"] = False  # its generate recomputes the prefix
        out[VARIANT_KEY] = variant_settings(cfg)
    return out


def generation_config(eos_id: int | None, bos_id: int | None) -> dict[str, Any]:
    return {"bos_token_id": bos_id, "eos_token_id": eos_id}
