"""Attention variants. Importing this package registers every built-in variant."""

from model.attention.base import (  # noqa: F401
    Attention,
    AttnOut,
    KVCache,
    LayerSpec,
    SuiteCase,
    build_attention,
    register_attention,
    registry,
)
from model.attention import full  # noqa: F401  (registers "full")
