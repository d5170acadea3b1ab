"""Model configuration, presets, and analytic counts (parameters, FLOPs, memory).

Presets are partial dicts: a run config names one with ``model.preset`` and any
field it also sets wins over the preset, so ``--set model.n_layers=2`` shrinks
a preset without copying it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from core import configlib
from core.errors import ConfigError, check_choice, check_min, check_range

FAMILIES = ("gpt2", "llama")
SCALING_TYPES = ("none", "linear", "ntk", "dynamic_ntk", "yarn", "llama3")  # model.rope implements each


@dataclass
class RopeConfig:
    """Rotary embedding settings (``model.rope.*``); see model/rope.py for each scaling type."""

    theta: float = 10000.0  # rotary base frequency
    scaling: str = "none"  # none | linear | ntk | dynamic_ntk | yarn | llama3
    factor: float = 0.0  # context extension factor; 0 = the type's default (llama3: 8, others: 1)
    original_max_seq_len: int = 0  # pretraining length; 0 = llama3: 8192, others: max_seq_len / factor
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float = 0.0  # yarn; 0 = 0.1 ln(factor) + 1
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3

    def validate(self) -> None:
        check_min("model.rope.theta", self.theta, 0, strict=True)
        check_choice("model.rope.scaling", self.scaling, SCALING_TYPES)
        if self.factor and self.factor < 1.0:
            raise ConfigError(f"model.rope.factor: must be >= 1 (or 0 for the type's default), got {self.factor}")
        check_min("model.rope.original_max_seq_len", self.original_max_seq_len, 0)
        check_min("model.rope.attention_factor", self.attention_factor, 0)
        if self.high_freq_factor <= self.low_freq_factor:
            raise ConfigError(
                f"model.rope.high_freq_factor: {self.high_freq_factor} must exceed "
                f"low_freq_factor={self.low_freq_factor}"
            )


@dataclass
class AttentionConfig:
    """``model.attention.*``: which variant, and each variant's own typed options.

    ``options`` maps a registered variant name to its config dataclass; in TOML
    those appear as ``[model.attention.<kind>]`` tables. It is filled from the
    registry, so a new variant needs no edit here.
    """

    kind: str = "full"  # the attention variant: a name of the registry (full, focus, lazy ...)
    # auto: the variant picks its fastest exact path for the device; reference: the dense T x T path
    impl: str = "auto"
    options: dict[str, Any] = field(default_factory=dict, metadata={"config": False})

    def __post_init__(self) -> None:
        from model.attention import registry

        for name, entry in registry.items():
            self.options.setdefault(name, entry.config_cls())

    def config_sections(self) -> dict[str, Any]:
        return self.options

    @property
    def variant(self) -> Any:
        """The active variant's config dataclass."""
        return self.options[self.kind]

    def validate(self) -> None:
        from model.attention import registry

        check_choice("model.attention.kind", self.kind, sorted(registry))
        check_choice("model.attention.impl", self.impl, ("auto", "reference"))
        self.variant.validate(f"model.attention.{self.kind}.")


@dataclass
class ModelConfig:
    family: str = "llama"  # gpt2 (LayerNorm, GELU, learned positions) | llama (RMSNorm, SwiGLU, RoPE)
    vocab_size: int = 32000  # embedding rows (>= the tokenizer's size; may be padded)
    max_seq_len: int = 2048  # longest context (positions, caches)
    d_model: int = 768  # hidden size
    n_layers: int = 12  # transformer blocks
    n_heads: int = 12  # query heads
    n_kv_heads: int = 0  # 0 = n_heads (no GQA)
    d_ff: int = 0  # 0 = the family's rule (4d for gpt2, 2/3*4d rounded up to 256 for llama)
    norm_eps: float = 1e-5  # LayerNorm / RMSNorm epsilon
    qk_norm: bool = False  # RMSNorm on queries and keys per head
    tie_embeddings: bool = False  # the LM head shares the token embedding
    bias: bool = False  # biases on every linear layer (GPT-2)
    qkv_bias: bool = False  # biases on q, k and v only (Qwen2); model.bias puts them on every linear layer
    dropout: float = 0.0  # dropout on attention output, MLP and embeddings (0 = none)
    init_std: float = 0.02  # standard deviation of the normal weight init
    preset: str = ""  # a named shape (tiny, gpt2-124m ... llama-7b); other model.* keys override it
    rope: RopeConfig = field(default_factory=RopeConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)

    # ---- derived -----------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def ffn_dim(self) -> int:
        if self.d_ff:
            return self.d_ff
        if self.family == "gpt2":
            return 4 * self.d_model
        hidden = int(2 * 4 * self.d_model / 3)
        return 256 * math.ceil(hidden / 256)

    @property
    def uses_rope(self) -> bool:
        return self.family == "llama"

    def parameter_floor(self) -> int:
        """A lower bound of the parameter count in closed form (no model built): the embedding (and an untied
        head) and each layer's attention and MLP matrices; norms, biases and a variant's own parameters left out."""
        d, hd = self.d_model, self.head_dim
        attention = d * self.n_heads * hd * 2 + d * self.kv_heads * hd * 2  # q, o; k, v
        mlp = (3 if self.family == "llama" else 2) * d * self.ffn_dim
        embedding = self.vocab_size * d * (1 if self.tie_embeddings else 2)
        positions = 0 if self.uses_rope else self.max_seq_len * d
        return embedding + positions + self.n_layers * (attention + mlp)

    def validate(self) -> None:
        check_choice("model.family", self.family, FAMILIES)
        for name in ("vocab_size", "max_seq_len", "d_model", "n_layers", "n_heads"):
            check_min(f"model.{name}", getattr(self, name), 1)
        for name, (limit, why) in SIZE_LIMITS.items():
            if getattr(self, name) > limit:
                raise ConfigError(f"model.{name}: {getattr(self, name):,} is beyond {limit:,} ({why})")
        if self.d_model % self.n_heads:
            divisors = [h for h in range(1, min(self.d_model, 128) + 1) if self.d_model % h == 0]
            raise ConfigError(
                f"model.n_heads: {self.n_heads} does not divide model.d_model={self.d_model}; "
                f"allowed values include {', '.join(map(str, divisors[-8:]))}"
            )
        if self.n_kv_heads < 0 or self.n_heads % self.kv_heads:
            raise ConfigError(
                f"model.n_kv_heads: {self.n_kv_heads} must divide model.n_heads={self.n_heads} (0 = same as n_heads)"
            )
        if self.uses_rope and self.head_dim % 2:
            raise ConfigError(f"model.n_heads: RoPE needs an even head dimension, got {self.head_dim}")
        self._check_max_seq_len()
        check_range("model.dropout", self.dropout, 0.0, 1.0, open_high=True)
        check_range("model.init_std", self.init_std, 0.0, 1.0, open_low=True)  # torch refuses std < 0 mid-build
        check_min("model.norm_eps", self.norm_eps, 0.0)
        check_min("model.d_ff", self.d_ff, 0, note=" (0 = the family's default)")
        self.rope.validate()
        self.attention.validate()

    def _check_max_seq_len(self) -> None:
        """Learned positions (GPT-2) are a [max_seq_len, d_model] table: refuse one larger than the rest of
        the model, which is a typo or a misplaced context length rather than a design. RoPE positions are
        float32 angles, exact for integer positions up to 2^24 only."""
        if self.max_seq_len > MAX_ROPE_POSITIONS:
            raise ConfigError(
                f"model.max_seq_len: {self.max_seq_len:,} is beyond {MAX_ROPE_POSITIONS:,} positions (2^24: float32 "
                "positions and RoPE angles stop being exact there)"
            )
        if self.uses_rope:
            return
        table = self.max_seq_len * self.d_model
        rest = self.n_layers * (4 * self.d_model**2 + 3 * self.d_model * self.ffn_dim) + self.vocab_size * self.d_model
        if table > rest:
            raise ConfigError(
                f"model.max_seq_len: a learned position table of {self.max_seq_len:,} x {self.d_model} "
                f"({table * 4 / 2**30:.2f} GiB in float32) would outweigh the rest of the model "
                f"({rest * 4 / 2**30:.2f} GiB); learned positions (model.family = gpt2) are for short contexts: lower "
                "it or use a RoPE family (llama)"
            )


MAX_ROPE_POSITIONS = 2**24
# the integer sizes' upper bounds, checked before anything is built (a model's layers are Python modules built one by
# one, its matrices are allocated whole): what the formats allow, or far past any model trained
SIZE_LIMITS: dict[str, tuple[int, str]] = {
    "vocab_size": (2**32, "2^32: token ids are stored as uint32 in prepared shards"),
    "n_layers": (2**12, "2^12: a sane upper bound, 30x the deepest published LLM"),
    "d_model": (2**17, "2^17: a sane upper bound, 5x the widest published LLM"),
    "d_ff": (2**19, "2^19: a sane upper bound, 4x model.d_model's"),
    "n_heads": (2**14, "2^14: a sane upper bound, a head of 8 dimensions at the widest model.d_model"),
}


# ---- presets ------------------------------------------------------------------------

_GPT2 = dict(family="gpt2", vocab_size=50257, max_seq_len=1024, tie_embeddings=True, bias=True)
_LLAMA = dict(family="llama", vocab_size=32000, max_seq_len=2048, tie_embeddings=False, bias=False)

PRESETS: dict[str, dict[str, Any]] = {
    # CPU demo and tests: trains to well below unigram entropy in minutes on 2 cores.
    "tiny": dict(_LLAMA, vocab_size=4096, max_seq_len=256, d_model=256, n_layers=4, n_heads=4, d_ff=688),
    "gpt2-124m": dict(_GPT2, d_model=768, n_layers=12, n_heads=12),
    "gpt2-350m": dict(_GPT2, d_model=1024, n_layers=24, n_heads=16),
    "gpt2-774m": dict(_GPT2, d_model=1280, n_layers=36, n_heads=20),
    "gpt2-1.5b": dict(_GPT2, d_model=1600, n_layers=48, n_heads=25),
    "llama-124m": dict(_LLAMA, d_model=768, n_layers=12, n_heads=12, d_ff=2048),
    "llama-350m": dict(_LLAMA, d_model=1024, n_layers=24, n_heads=16, d_ff=2816),
    "llama-760m": dict(_LLAMA, d_model=1536, n_layers=24, n_heads=16, d_ff=4096),
    "llama-1.3b": dict(_LLAMA, d_model=2048, n_layers=24, n_heads=16, d_ff=5504),
    "llama-2.7b": dict(_LLAMA, d_model=2560, n_layers=32, n_heads=20, d_ff=6912),
    "llama-7b": dict(_LLAMA, d_model=4096, n_layers=32, n_heads=32, d_ff=11008),
}


def preset_dict(name: str) -> dict[str, Any]:
    if name not in PRESETS:
        raise ConfigError(f"model.preset: {name!r} is not one of {', '.join(PRESETS)}")
    return dict(PRESETS[name], preset=name)


# ---- analytic counts ------------------------------------------------------------------


def model_config_from_dict(data: dict[str, Any]) -> ModelConfig:
    """``model`` table -> ModelConfig: the preset (if any) first, then every key the table sets."""
    configlib.require_table(data, "model.")  # `model = 5`: one line, not an AttributeError
    base = ModelConfig()
    if data.get("preset", "") != "":  # "" (what a run without a preset resolves to) = no preset
        if not isinstance(data["preset"], str):
            raise ConfigError(f"model.preset: expected a string, got {data['preset']!r}")
        for key, value in preset_dict(data["preset"]).items():
            setattr(base, key, value)
    return configlib.from_dict(ModelConfig, data, "model.", base=base)
