"""Attention variants. Importing this package registers every built-in variant."""

from model.attention import dga, focal, focus, full, lazy, prescored_hyper  # noqa: F401  (register the built-in variants)
from model.attention.common.base import (  # noqa: F401
    Attention,
    AttnOut,
    KVCache,
    LayerSpec,
    SuiteCase,
    VariantConfig,
    attention_registered,
    build_attention,
    register_attention,
    registry,
)
