"""The attention protocol, the KV cache, and the one registry of variants.

A variant receives q, k, v after projection and RoPE, plus the layer's input
hidden states (routing input for Focus), and returns an ``AttnOut``. The base
class owns the dispatch every variant shares: appending to the KV cache,
building query/key positions, and choosing the dense reference or the fast
path. Variants implement ``reference`` (always) and ``fast`` (when they have
one); the caller never chooses a kernel.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import torch
from torch import Tensor, nn


@dataclass
class AttnOut:
    output: Tensor  # [B, Hq, T, D]
    aux_loss: Tensor | None = None  # scalar added to the LM loss (already weighted)
    stats: dict[str, Tensor] = field(default_factory=dict)  # detached scalars, logged as attn/<variant>/<name>


@dataclass(frozen=True)
class LayerSpec:
    """Shapes a variant needs to build its parameters."""

    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    max_seq_len: int
    layer_idx: int
    n_layers: int


@dataclass(frozen=True)
class SuiteCase:
    """One configuration of a variant that the shared attention test suite covers.

    ``causal=False`` marks a paper-faithful form that is known to leak the future:
    the suite then asserts that it does leak, rather than skipping it.
    """

    name: str
    options: dict[str, Any] = field(default_factory=dict)
    causal: bool = True


@dataclass
class VariantConfig:
    """Base of a variant's options (``[model.attention.<name>]``)."""

    def validate(self, prefix: str) -> None:
        """One-line ``ConfigError`` naming ``prefix + field`` for a bad value; ``prefix`` is the table's
        dotted path, e.g. ``model.attention.focus.``."""


class KVCache:
    """One layer's keys and values for positions [0, length), preallocated to ``max_len`` and zero-initialised: a
    static-shape step that reads rows past ``length`` (masked slots of a page table, Focus's device decode without
    its kernel) gives them zero weights, which must not meet a NaN left in uninitialised memory.

    ``extra`` is per-variant state that must live with the cache (Focus group
    memberships, DGA aggregated groups, ...).
    """

    def __init__(
        self,
        batch: int,
        n_kv_heads: int,
        head_dim: int,
        max_len: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        shape = (batch, n_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.length = 0
        self.extra: dict[str, Any] = {}
        self._positions: Tensor | None = None  # arange(max_len), built on first use

    def positions(self) -> Tensor:
        """Positions [0, length) of the cached keys (a view: decoding builds no new range per token)."""
        if self._positions is None:
            self._positions = torch.arange(self.max_len, device=self.k.device)
        return self._positions[: self.length]

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        t = k.shape[2]
        if self.length + t > self.max_len:
            raise ValueError(f"KV cache full: {self.length} + {t} tokens exceeds its max_len {self.max_len}")
        self.k[:, :, self.length : self.length + t] = k
        self.v[:, :, self.length : self.length + t] = v
        self.length += t
        return self.k[:, :, : self.length], self.v[:, :, : self.length]


class Attention(nn.Module):
    """Base of every variant: the whole protocol, each optional hook with its default.

    Subclasses set ``name``/``config_cls`` via ``register_attention`` and implement ``reference``;
    everything else here has a default that means "this variant does not use it".
    """

    name: ClassVar[str] = ""
    config_cls: ClassVar[type] = VariantConfig
    # one line for launch configs, presets and docs
    description: ClassVar[str] = ""
    # names of this module's own parameters that AdamW must not decay (bias tables, centroids)
    no_weight_decay: ClassVar[tuple[str, ...]] = ()
    # statistics compared across steps are computed on the trainer's fixed validation batch
    # (Transformer.reference_batch_stats sets ``reference_batch`` for that forward)
    uses_reference_batch: ClassVar[bool] = False
    # document-aware masking (data.document_masking) through ``document_attention``
    supports_documents: ClassVar[bool] = False
    # trains (False: an inference-time approximation; train with full attention, evaluate with it)
    trainable: ClassVar[bool] = True

    def __init__(self, cfg: Any, spec: LayerSpec):
        super().__init__()
        self.cfg = cfg
        self.spec = spec
        self.impl = "auto"  # "auto" | "reference"; tests and debugging force the reference
        self.collect_stats = False  # set by the trainer on logging steps; stats can cost extra work
        self.reference_batch = False  # set for the trainer's fixed-batch forward (uses_reference_batch)

    @classmethod
    def suite_cases(cls) -> list[SuiteCase]:
        return [SuiteCase("default")]

    @classmethod
    def launch_overrides(cls, family: str) -> dict[str, Any]:
        """Dotted config keys a launch config for this variant sets beyond ``model.attention.kind``
        (e.g. Lazy's large RoPE base on LLaMA-family models)."""
        return {}

    def head_sharded_parameters(self) -> dict[str, int]:
        """Tensor parallelism (train.parallel.tp): this module's own parameters that are per head, each with the
        dimension that indexes the (query) heads; they are split with the heads, so a rank holds its local heads'
        rows. Every other parameter of the module is replicated on the TP ranks and its gradient summed over them
        (each rank computes only its heads' part). Default: none per head. Under TP a variant sees ``n_heads / tp``
        local heads in q, k, v (reshape by the tensors' sizes, not ``spec.n_heads``), and its ``aux_loss`` must be
        a function of ``hidden`` and replicated parameters only (each TP rank adds 1 / tp of it)."""
        return {}

    def saved_activation_bytes(
        self, *, q_tokens: int, k_tokens: int, heads: int, kv_heads: int, dtype_bytes: int
    ) -> int:
        """The layout planner's (``launch.plan``) activation model: bytes this core's autograd graph keeps for the
        backward for ONE sequence, its inputs q, k, v included: ``q_tokens`` queries (this rank's) against
        ``k_tokens`` keys (the whole sequence under context parallelism: the gathered K and V), ``heads`` /
        ``kv_heads`` this rank's (tensor parallelism), ``dtype_bytes`` the activations' element size. Default: a
        fused kernel's (SDPA, flash): q, k, v, the output and a float32 logsumexp per query and head. A variant
        that keeps more (scores, routing state, a second pass) declares it here."""
        d = self.spec.head_dim
        return (2 * q_tokens * heads * d + 2 * k_tokens * kv_heads * d) * dtype_bytes + 4 * q_tokens * heads

    def set_train_progress(self, step: int, max_steps: int) -> None:
        """Called before every training step (schedules such as Focus's lambda); values it sets must
        live in persistent buffers so they are checkpointed with the weights."""

    def set_backbone_trains(self, trains: bool) -> None:
        """Called by the trainer whenever it applies the trainable set (every step, and on resume): whether any
        parameter outside the variants' own (``*.core.*``) trains. False is a centroid-only phase (Focus applies
        its entropy penalty only then). Derived from the trainable set, so nothing needs checkpointing."""

    def prepare_step(self, seq_len: int, device: torch.device) -> Any:
        """Per-step state every layer of this variant shares, built once per forward by ``Transformer.forward``
        (from the first layer's core, outside the compiled blocks) and passed to each layer's ``forward`` as
        ``step``: what depends only on the shape and the variant's options, not on a layer's tensors (DGA: its
        FlexAttention block masks and sampled query offsets), so it is not rebuilt in every layer and every
        recompute. Asked only for whole-sequence forwards from position 0 (no cache, no context parallelism, no
        document masking) of ``seq_len`` tokens on ``device``. Default: None (nothing shared). A layer must give the
        same result with ``step=None`` (it then builds what it needs itself)."""
        return None

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        hidden: Tensor,
        positions: Tensor,
        cache: KVCache | None = None,
        documents: Tensor | None = None,
        context_parallel: CPRunner | None = None,
        step: Any = None,
    ) -> AttnOut:
        """q: [B, Hq, T, D]; k, v: [B, Hkv, T, D]; hidden: [B, T, d_model]; positions: [T] absolute
        positions of the T tokens. documents: [B, T] document index per token (document-aware
        masking; model/documents.py). context_parallel: this rank holds its CP chunks of the sequence
        (positions global; documents then the WHOLE sequence's [B, T] ids); run through the module call so that
        hooks on the core (tensor parallelism's local-tensor swap) see the CP path too. step: ``prepare_step``'s
        result for this forward (None: not prepared); the default ignores it."""
        if context_parallel is not None and cache is None:
            return context_parallel.attend(self, q, k, v, hidden=hidden, positions=positions, documents=documents)
        if documents is not None:
            if cache is not None:
                raise ValueError("document masking applies to whole-sequence forwards, not to cached decoding")
            if not self.supports_documents:
                raise ValueError(
                    f"attention variant {self.name!r} has no document-aware masking (data.document_masking needs "
                    "model.attention.kind = full)"
                )
            return self.document_attention(q, k, v, hidden=hidden, documents=documents)
        if cache is not None:
            k, v = cache.append(k, v)
            k_pos = cache.positions()
        else:
            k_pos = positions
        return self.dispatch(q, k, v, hidden=hidden, q_pos=positions, k_pos=k_pos, cache=cache)

    def dispatch(
        self, q: Tensor, k: Tensor, v: Tensor, *, hidden: Tensor, q_pos: Tensor, k_pos: Tensor, cache: KVCache | None
    ) -> AttnOut:
        """``fast`` where the variant has a fast path for this call (and impl is not "reference"), else
        ``reference``."""
        if self.impl != "reference" and self.has_fast_path(q, cache):
            return self.fast(q, k, v, hidden=hidden, q_pos=q_pos, k_pos=k_pos, cache=cache)
        return self.reference(q, k, v, hidden=hidden, q_pos=q_pos, k_pos=k_pos, cache=cache)

    # ---- context parallelism (model/attention/common/context_parallel.py) ---------------------
    # Under CP a rank holds two chunks of the sequence; each chunk's queries (contiguous global positions
    # q_pos) attend the gathered keys [0, q_pos[-1] + 1). The defaults suit a variant whose ``reference`` /
    # ``fast`` already take queries at the end of a longer key sequence with no cache (full, lazy); a
    # variant that reads other tokens' state (routing, statistics, compression) gathers it in ``cp_context``.
    @classmethod
    def cp_chunk_multiple(cls, cfg: Any) -> int:
        """Each CP chunk's length (seq_len / (2 cp)) must be a multiple of this (DGA: its chunk size)."""
        return 1

    @classmethod
    def cp_unsupported(cls, cfg: Any) -> str | None:
        """Why this configuration has no CP form (one line naming the option), or None."""
        return None

    def cp_context(
        self, q: Tensor, k: Tensor, v: Tensor, *, hidden: Tensor, gather: CPGather, positions: Tensor
    ) -> Any:
        """What the queries need beyond K and V from the whole sequence, once per layer: built from this
        rank's tensors and ``gather(x, dim)`` (autograd-aware: this rank's tokens -> the whole sequence in
        global order). ``positions`` [T / cp]: the global positions of this rank's tokens (a variant that
        compresses its own tokens before gathering, as DGA does, reads its chunks off them). Passed to every
        ``cp_attend`` call of the layer. Default: nothing."""
        return None

    def cp_attend(
        self, q: Tensor, k: Tensor, v: Tensor, *, hidden: Tensor, q_pos: Tensor, k_pos: Tensor, context: Any
    ) -> AttnOut:
        """One CP chunk: q [B, Hq, c, D] at global positions q_pos (contiguous), k/v the keys at k_pos = [0,
        q_pos[-1] + 1), hidden the chunk's own [B, c, d_model]. Its aux loss must be a mean over the chunk's
        queries. Default: the uncached dispatch of ``forward``."""
        return self.dispatch(q, k, v, hidden=hidden, q_pos=q_pos, k_pos=k_pos, cache=None)

    def cp_document_attention(
        self, q: Tensor, k: Tensor, v: Tensor, *, q_pos: Tensor, k_pos: Tensor, q_docs: Tensor, k_docs: Tensor
    ) -> AttnOut:
        """``document_attention`` for one CP chunk: q_docs [B, c] / k_docs [B, Tk] global document ids."""
        raise NotImplementedError

    # ---- what a variant implements --------------------------------------------------
    def document_attention(self, q: Tensor, k: Tensor, v: Tensor, *, hidden: Tensor, documents: Tensor) -> AttnOut:
        """Causal attention within each document of a packed sequence (documents: [B, T])."""
        raise NotImplementedError

    def reference(
        self, q: Tensor, k: Tensor, v: Tensor, *, hidden: Tensor, q_pos: Tensor, k_pos: Tensor, cache: KVCache | None
    ) -> AttnOut:
        """Dense path materialising T x T scores: slow, obviously correct, any device and dtype."""
        raise NotImplementedError

    def fast(
        self, q: Tensor, k: Tensor, v: Tensor, *, hidden: Tensor, q_pos: Tensor, k_pos: Tensor, cache: KVCache | None
    ) -> AttnOut:
        return self.reference(q, k, v, hidden=hidden, q_pos=q_pos, k_pos=k_pos, cache=cache)

    def has_fast_path(self, q: Tensor, cache: KVCache | None) -> bool:
        """Whether ``fast`` is exact and supported for this device, dtype and call."""
        return False

    @classmethod
    def attention_ops(cls) -> tuple[Any, ...]:
        """The operators that are this variant's attention kernels: selective activation checkpointing keeps their
        outputs for the backward instead of recomputing them (model/activation_checkpointing.py asks every registered
        variant). Default: the fused SDPA kernels and FlexAttention (every variant's GPU path is one of them); a
        variant with a kernel of its own (a Triton custom op) adds it."""
        return fused_attention_ops()

    def gpu_paths(self) -> dict[str, GpuPath]:
        """The calls of this module's GPU (CUDA) path that must stay compile-clean: no graph break under
        ``torch.compile`` and no recompile per length beyond the dynamic-shape bound
        (tests/attention/test_compile_clean.py traces each on CPU inside ``flex.gpu_paths_forced()``).
        Default: the whole-sequence training forward. A variant adds calls its forward does not reach
        (full: document masking), or returns ``{}`` when it has no compiled GPU path (say why)."""

        def forward(q: Tensor, k: Tensor, v: Tensor, hidden: Tensor, positions: Tensor) -> tuple[Tensor, ...]:
            out = self(q, k, v, hidden=hidden, positions=positions)
            return (out.output,) if out.aux_loss is None else (out.output, out.aux_loss)

        return {"forward": forward}


_FUSED_SDPA = (
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
)


def fused_attention_ops() -> tuple[Any, ...]:
    """SDPA's fused kernels (those this torch has) and the FlexAttention operator."""
    ops: list[Any] = [getattr(torch.ops.aten, name).default for name in _FUSED_SDPA if hasattr(torch.ops.aten, name)]
    flex = getattr(torch.ops.higher_order, "flex_attention", None)
    return (*ops, flex) if flex is not None else tuple(ops)


# context parallelism's gather: (this rank's tensor, sequence dim) -> the whole sequence, autograd-aware
CPGather = Callable[[Tensor, int], Tensor]


class CPRunner(Protocol):
    """What ``Attention.forward`` calls under context parallelism:
    ``model.attention.common.context_parallel.ContextParallel`` (named structurally: that module imports this one)."""

    def attend(
        self,
        core: Attention,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        hidden: Tensor,
        positions: Tensor,
        documents: Tensor | None = None,
    ) -> AttnOut: ...


# one GPU-path call: (q, k, v, hidden, positions) -> its output tensors
GpuPath = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], tuple[Tensor, ...]]


@dataclass(frozen=True)
class RegistryEntry:
    cls: type[Attention]
    config_cls: type


registry: dict[str, RegistryEntry] = {}


def register_attention(name: str, config_cls: type) -> Callable[[type[Attention]], type[Attention]]:
    """Class decorator: ``@register_attention("focus", FocusConfig)``."""

    def wrap(cls: type[Attention]) -> type[Attention]:
        if name in registry and registry[name].cls is not cls:
            raise ValueError(f"attention variant {name!r} registered twice")
        cls.name = name
        cls.config_cls = config_cls
        registry[name] = RegistryEntry(cls, config_cls)
        return cls

    return wrap


@contextlib.contextmanager
def attention_registered(name: str, config_cls: type, cls: type[Attention]) -> Iterator[type[Attention]]:
    """``register_attention`` for the duration of a block, then the registry as it was: a variant that is not
    the product's (a benchmark's baseline, a test's throwaway) never outlives its use in a shared process, where
    every registry-driven test and every saved config would otherwise see it."""
    added = name not in registry
    register_attention(name, config_cls)(cls)
    try:
        yield cls
    finally:
        if added:
            registry.pop(name, None)


def build_attention(kind: str, cfg: Any, spec: LayerSpec, impl: str = "auto") -> Attention:
    module = registry[kind].cls(cfg, spec)
    module.impl = impl
    return module


def kv_cache_nbytes(cache: KVCache) -> int:
    """Bytes allocated by every tensor a layer's cache holds (its raw keys and values and whatever a variant
    keeps in ``cache.extra``): the sum of their storages' sizes, each storage counted once. Measured, so
    preallocated capacity counts, and a view counts its whole storage."""
    seen: dict[tuple[str, int], int] = {}

    def visit(x: object) -> None:
        if isinstance(x, Tensor):
            storage = x.untyped_storage()
            seen[(str(x.device), storage.data_ptr() or id(storage))] = storage.nbytes()
        elif isinstance(x, dict):
            for value in x.values():
                visit(value)
        elif isinstance(x, list | tuple):
            for value in x:
                visit(value)

    visit([cache.k, cache.v, cache.extra])
    return sum(seen.values())
