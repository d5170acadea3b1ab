"""``FocusAttention``, the Focus layer (the package docstring has the paper's summary and the paths).

The module computes the assignments (group scores -> Sinkhorn or softmax, cached for decoding), dispatches each call
to the dense reference (``naive``) or a fast path (``soft/``, ``hard/``), and adds the entropy penalty and the
statistics the trainer logs; under context parallelism it gathers the group scores (``cp_context``).
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from model.attention.common import reference as ref
from model.attention.common.base import Attention, AttnOut, CPGather, KVCache, LayerSpec, SuiteCase
from model.attention.common.flex import cached_structure, flex_supports, gpu_paths_active
from model.attention.common.triton import interpreting, triton_fits
from model.attention.focus import naive
from model.attention.focus.config import FocusConfig, lambda_at
from model.attention.focus.hard import decode_host as host_decode
from model.attention.focus.hard import decode_triton, group_sparse
from model.attention.focus.hard.cpu import cpu_hard_attention, cpu_kernel_dtypes
from model.attention.focus.hard.decode import GroupLists, cpu_decode_hard_attention, decode_hard_attention
from model.attention.focus.hard.decode_device import device_decode_step
from model.attention.focus.hard.decode_pages import GroupPages, build_pages
from model.attention.focus.hard.flex import FLEX_BLOCK, band_block_mask_tensors, flex_hard_attention
from model.attention.focus.naive import hard_mask, membership_bits
from model.attention.focus.sinkhorn import group_imbalance, sinkhorn_prefix, sinkhorn_sequence
from model.attention.focus.sinkhorn_op import PREFIX_OP, prefix_assignments
from model.attention.focus.soft import triton as soft_triton
from model.attention.focus.soft.cpu import cpu_soft_attention, soft_dtypes
from model.attention.focus.soft.flex import flex_soft_attention

STATS_ROWS = 256  # query rows sampled for pair statistics (gate on distant pairs, pairs kept)
FLEX_DECODE_ROWS = 128  # FlexAttention's decoding kernel takes fewer query rows (torch's _use_flex_decoding)
STATS_BLOCK = 1 << 18  # (query row, key) pairs of the pair statistics computed at once


def assign_scores(s: Tensor, cfg: FocusConfig) -> Tensor:
    """g [B, T, K] of every token of a whole sequence (no cache) from its group scores s [B, T, K]."""
    if cfg.assignment == "softmax":
        return torch.softmax(s, dim=-1)
    if cfg.sinkhorn_scope == "prefix":
        return prefix_assignments(s, cfg.sinkhorn_iters)
    return sinkhorn_sequence(s, cfg.sinkhorn_iters)


def centroid_scores(projected: Tensor, centroids: Tensor, tau: float) -> Tensor:
    """Group scores (h W_g) C^T / tau [B, T, K] from the projected hidden states, in float32 at least and with
    autocast off: autocast would run the product (and so the Sinkhorn after it) in bf16 (issue 48). The projection
    itself stays in the autocast dtype (d_model x d_group, the costly one); this product is d_group x K."""
    dtype = torch.float64 if projected.dtype == torch.float64 else torch.float32
    with torch.autocast(projected.device.type, enabled=False):
        return (projected.to(dtype) @ centroids.to(dtype).T) / tau


def hard_inference(
    q: Tensor, k: Tensor, v: Tensor, hidden: Tensor, w_g: Tensor, centroids: Tensor, cfg: FocusConfig, scale: float,
    band: tuple[Tensor, Tensor] | None = None,
) -> Tensor:  # fmt: skip
    """The whole hard-mode forward of a sequence on the GPU path (group scores, assignments, memberships, the two
    FlexAttention calls and their merge): what ``FocusAttention`` compiles as one graph for inference on CUDA
    (``hard_inference_fn``). The same operations as the module's eager path (``group_scores``, ``assign_whole``,
    ``membership_bits``, ``flex_hard_attention``). ``band``: the band call's shape-only block structure, built and
    cached outside the graph (``hard_band``); None = built inside it."""
    s = centroid_scores(F.linear(hidden, w_g), centroids, cfg.tau)
    bits = membership_bits(assign_scores(s, cfg), cfg.top_k)
    return flex_hard_attention(
        q, k, v, bits_q=bits, bits_k=bits, window=cfg.window, scale=scale, n_groups=cfg.n_groups, top_k=cfg.top_k,
        compiled=True, band=band,
    )  # fmt: skip


def hard_band(length: int, window: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """The band call's block structure of a whole sequence, built once per shape and passed into the compiled graph
    (inside it: seven operations per layer). Its block-count dimensions are marked dynamic: duck sizing would
    otherwise give a count equal to the batch or head count their symbol, and recompile at the next length."""

    def build() -> tuple[Tensor, Tensor]:
        num, idx = band_block_mask_tensors(length, length, window, device=device)
        torch._dynamo.maybe_mark_dynamic(num, 2)
        torch._dynamo.maybe_mark_dynamic(idx, 2)
        torch._dynamo.maybe_mark_dynamic(idx, 3)
        return num, idx

    return cached_structure(("focus_band_tensors", length, window, str(device)), build)


_HARD_INFERENCE: list[Callable[..., Tensor]] = []
_HARD_INFERENCE_GRAPHED: dict[int, Callable[..., Tensor]] = {}
# fixed-length buckets (the evaluation and benchmark lengths) that get a static-shape CUDA-graph compile on CUDA
CUDA_GRAPH_LENGTHS = frozenset(1 << n for n in range(10, 18))  # 1024 .. 131072


def hard_inference_fn(length: int | None = None, cuda: bool = False) -> Callable[..., Tensor]:
    """``hard_inference`` compiled once (dynamic shapes; every layer and length shares the graph: its guards are the
    configuration's values and the tensors' dtypes). Inside, ``flex_attention_fn`` sees the trace and returns plain
    FlexAttention, which inductor compiles into the same graph. The CPU tests trace it with ``fullgraph=True``.

    On CUDA a length in ``CUDA_GRAPH_LENGTHS`` gets its own static-shape compile with ``mode="reduce-overhead"``
    (CUDA graphs: one replay instead of some 70 kernel launches from the dynamic wrapper; each its own code object,
    so the buckets do not share dynamo's per-code recompile budget). Its output lives in the graph's memory, which
    the next replay overwrites: ``run_hard_inference`` copies it out."""
    if cuda and length in CUDA_GRAPH_LENGTHS:
        fn = _HARD_INFERENCE_GRAPHED.get(length)
        if fn is None:
            code = hard_inference.__code__.replace(co_name=f"hard_inference_{length}")
            copy = types.FunctionType(code, hard_inference.__globals__, f"hard_inference_{length}")
            fn = _HARD_INFERENCE_GRAPHED[length] = torch.compile(copy, mode="reduce-overhead", dynamic=False)
        return fn
    if not _HARD_INFERENCE:
        _HARD_INFERENCE.append(torch.compile(hard_inference, dynamic=True))
    return _HARD_INFERENCE[0]


def run_hard_inference(
    q: Tensor, k: Tensor, v: Tensor, hidden: Tensor, w_g: Tensor, centroids: Tensor, cfg: FocusConfig, scale: float
) -> Tensor:
    """``hard_inference`` of a whole sequence through ``hard_inference_fn`` (the length's compile)."""
    t = q.shape[2]
    graphed = q.is_cuda and t in CUDA_GRAPH_LENGTHS
    # a static (CUDA-graph) compile builds the band in its graph from constant shapes; the dynamic one takes it in
    band = None if graphed else hard_band(t, cfg.window, q.device)
    out = hard_inference_fn(t, q.is_cuda)(q, k, v, hidden, w_g, centroids, cfg, scale, band)
    return out.clone() if graphed else out


_DECODE_STEP: list[Callable[..., Tensor]] = []


def decode_step_fn() -> Callable[..., Tensor]:
    """``device_decode_step`` compiled once (on CUDA: the Sinkhorn token update's ~40 small operations fuse into a
    few kernels around the split-KV kernel). Its shapes are the cache's, so consecutive tokens of one cache share a
    graph; another cache shape compiles once more (automatic dynamic shapes). The CPU tests trace it with
    ``fullgraph=True``."""
    if not _DECODE_STEP:
        _DECODE_STEP.append(torch.compile(device_decode_step))
    return _DECODE_STEP[0]


def _decode_kernel(q: Tensor) -> bool:
    """Whether the device decode step's attention runs the split-KV Triton kernel (``hard/decode_triton.py``): CUDA
    tensors where triton imports; CPU tensors only while Triton's interpreter is on (the tests). Elsewhere its torch
    form (``decode_pages.torch_partials``)."""
    if q.dtype not in decode_triton.kernel_dtypes() or not decode_triton.available():
        return False
    return q.is_cuda or (q.device.type == "cpu" and interpreting())


def _compiles_whole(q: Tensor) -> bool:
    """Whether the hard forward (or decode step) of these queries runs as one compiled graph: on CUDA (tests patch
    it)."""
    return q.is_cuda


class FocusAttention(Attention):
    description = "Focus: Sinkhorn-balanced centroids, causal prefix scope (docs/focus.md)"
    no_weight_decay = ("centroids",)
    uses_reference_batch = True  # assignment stability is measured on a fixed batch

    @classmethod
    def attention_ops(cls) -> tuple[Any, ...]:
        """The soft mode's fused Triton forward and the prefix Sinkhorn op too: selective activation checkpointing
        keeps their outputs (the Sinkhorn's saved state: the backward runs no forward scan again)."""
        return (*super().attention_ops(), torch.ops.focus_triton.soft_forward.default, PREFIX_OP)

    def __init__(self, cfg: FocusConfig, spec: LayerSpec):
        super().__init__(cfg, spec)
        self.d_group = cfg.d_group or spec.d_model
        self.w_g = nn.Linear(spec.d_model, self.d_group, bias=False)
        self.centroids = nn.Parameter(torch.empty(cfg.n_groups, self.d_group))
        # shape [1], not 0-dim: FSDP2 cannot shard a scalar parameter (old 0-dim checkpoints load, see below)
        lam = torch.full((1,), float(cfg.lambda_init))
        if cfg.lambda_learnable:
            self.lam = nn.Parameter(lam)
        else:
            self.register_buffer("lam", lam)  # scheduled: saved with the weights, set by the trainer
        self.reference_batch = False  # set for the trainer's fixed-batch pass (stability only)
        self.backbone_trains = False  # set_backbone_trains (the trainer); on its own a module is in the centroid phase
        # soft mode's GPU kernel: "auto" = the Triton kernels where they run (soft/triton.py), else FlexAttention
        # (soft/flex.py); "flex" = FlexAttention always (comparisons, debugging)
        self.soft_kernel = "auto"
        self._previous_groups: Tensor | None = None
        self.reset_parameters()

    @classmethod
    def suite_cases(cls) -> list[SuiteCase]:
        small = {"window": 8}  # the suite's sequences are ~40 tokens: gate most pairs
        return [
            SuiteCase("soft-prefix", small),
            SuiteCase("soft-multiplicative", {**small, "gate": "multiplicative"}),
            SuiteCase("soft-softmax", {**small, "assignment": "softmax"}),
            SuiteCase("hard-k1", {**small, "mode": "hard"}),
            SuiteCase("hard-k2", {**small, "mode": "hard", "top_k": 2}),
            SuiteCase("soft-sequence", {**small, "sinkhorn_scope": "sequence"}, causal=False),
            SuiteCase("hard-sequence", {**small, "mode": "hard", "sinkhorn_scope": "sequence"}, causal=False),
        ]

    def reset_parameters(self) -> None:
        # Scores start at a few units (std ~3 at tau = 0.1): assignments confident but not one-hot,
        # so the centroids get gradient from the start.
        nn.init.normal_(self.w_g.weight, std=1.0 / math.sqrt(self.spec.d_model))
        nn.init.normal_(self.centroids, std=0.3 / math.sqrt(self.d_group))
        with torch.no_grad():
            self.lam.fill_(float(self.cfg.lambda_init))

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any) -> None:
        lam = state_dict.get(prefix + "lam")
        if lam is not None and lam.dim() == 0:  # saved while lambda was a 0-dim tensor
            state_dict[prefix + "lam"] = lam.reshape(1)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def set_backbone_trains(self, trains: bool) -> None:
        self.backbone_trains = trains

    def set_train_progress(self, step: int, max_steps: int) -> None:
        if self.cfg.lambda_schedule != "constant":
            with torch.no_grad():
                self.lam.fill_(lambda_at(self.cfg, step, max_steps))

    # ---- assignments ----------------------------------------------------------------
    def group_scores(self, hidden: Tensor, cache: KVCache | None = None) -> Tensor:
        dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32  # at least float32
        if cache is not None and hidden.shape[1] == 1 and not torch.is_grad_enabled():
            # decoding: one map through (C W_g) / tau, folded once per cache (the weights do not change while one
            # cache decodes), as a product and a sum (three operations; a batched matmul here takes seven)
            return (hidden.to(dtype).unsqueeze(2) * self._fold(cache, dtype)).sum(-1)  # [B, 1, 1, d] x [K, d]
        return centroid_scores(self.w_g(hidden), self.centroids, self.cfg.tau)

    def _fold(self, cache: KVCache, dtype: torch.dtype) -> Tensor:
        """(C W_g) / tau [K, d_model], folded once per cache (the weights do not change while one cache decodes)."""
        fold = cache.extra.get("focus_fold")
        if fold is None or fold.dtype != dtype:
            with torch.autocast(self.centroids.device.type, enabled=False):  # else a bf16 fold (and one per call)
                fold = (self.centroids.to(dtype) @ self.w_g.weight.to(dtype)) / self.cfg.tau
            cache.extra["focus_fold"] = fold
        return fold

    def assignments(self, hidden: Tensor, cache: KVCache | None) -> tuple[Tensor, Tensor]:
        """(g of the new tokens [B, Tq, K], g of every key [B, Tk, K]), caching what decoding needs."""
        host_decode.flush(cache)  # the tensors hold every token's state from here on
        s = self.group_scores(hidden, cache)
        if cache is None:
            g = self.assign_whole(s)
            return g, g
        cfg = self.cfg
        if cfg.assignment == "softmax" or cfg.sinkhorn_scope == "prefix":
            if cfg.assignment == "softmax":
                g = torch.softmax(s, dim=-1)
            else:
                g, state = sinkhorn_prefix(s, cfg.sinkhorn_iters, cache.extra.get("focus_sinkhorn") if cache else None)
                if cache is not None:
                    cache.extra["focus_sinkhorn"] = state
            return g, self._cached(cache, "focus_g", g)
        # sequence scope: every call renormalises over all tokens so far (earlier keys move too)
        s_all = self._cached(cache, "focus_scores", s)
        g_all = sinkhorn_sequence(s_all, cfg.sinkhorn_iters)
        return g_all[:, -s.shape[1] :], g_all

    def assign_whole(self, s: Tensor) -> Tensor:
        """g [B, T, K] of every token of a whole sequence (no cache) from its group scores s [B, T, K]."""
        return assign_scores(s, self.cfg)

    @staticmethod
    def _cached(cache: KVCache | None, key: str, new: Tensor) -> Tensor:
        """Write ``new`` (the last tokens' rows) into a per-cache buffer; return all rows so far."""
        if cache is None:
            return new
        buf = cache.extra.get(key)
        if buf is None:
            buf = cache.extra[key] = new.new_empty(new.shape[0], cache.max_len, *new.shape[2:])
        buf[:, cache.length - new.shape[1] : cache.length] = new
        return buf[:, : cache.length]

    # ---- paths ----------------------------------------------------------------------
    def _scale(self) -> float:
        return 1.0 / math.sqrt(self.spec.head_dim)

    def reference(
        self, q: Tensor, k: Tensor, v: Tensor, *, hidden: Tensor, q_pos: Tensor, k_pos: Tensor, cache: KVCache | None
    ) -> AttnOut:
        g_q, g_k = self.assignments(hidden, cache)
        return self.reference_assigned(q, k, v, g_q, g_k, q_pos=q_pos, k_pos=k_pos, cache=cache)

    def reference_assigned(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        g_q: Tensor,
        g_k: Tensor,
        *,
        q_pos: Tensor,
        k_pos: Tensor,
        cache: KVCache | None,
    ) -> AttnOut:
        if self.cfg.mode == "soft":
            return self._out(self._soft_reference(q, k, v, g_q, g_k, q_pos, k_pos), g_q, g_k, q_pos, k_pos, cache)
        bits_q, bits_k = self._memberships(g_q, g_k, cache)
        out = naive.hard_attention(
            q, k, v, bits_q, bits_k, q_pos=q_pos, k_pos=k_pos, window=self.cfg.window, scale=self._scale()
        )
        return self._out(out, g_q, g_k, q_pos, k_pos, cache)

    def _soft_reference(
        self, q: Tensor, k: Tensor, v: Tensor, g_q: Tensor, g_k: Tensor, q_pos: Tensor, k_pos: Tensor
    ) -> Tensor:
        """The soft mode's dense reference (``naive.soft_attention``) with this layer's lambda and options."""
        cfg = self.cfg
        return naive.soft_attention(
            q, k, v, g_q, g_k, self.lam, q_pos=q_pos, k_pos=k_pos, window=cfg.window, scale=self._scale(), gate=cfg.gate
        )

    def has_fast_path(self, q: Tensor, cache: KVCache | None) -> bool:
        if self.cfg.mode == "hard":
            return True  # the exact decomposition runs on any device
        # the CPU blockwise path not while torch.compile traces (compile on CPU: the reference, as before it)
        cpu = q.device.type == "cpu" and not torch.compiler.is_compiling()
        return self.soft_triton_supports(q) or flex_supports(q) or (cpu and q.dtype in soft_dtypes())

    def soft_triton_supports(self, q: Tensor) -> bool:
        """Whether the soft mode takes the Triton kernels (``soft/triton.py``): CUDA tensors where triton imports;
        CPU tensors only inside ``gpu_paths_forced`` while Triton's interpreter is on (the tests: elsewhere CPU
        tensors under ``gpu_paths_forced`` trace the FlexAttention path, as the compile tests do)."""
        if self.soft_kernel == "flex" or q.dtype not in soft_triton.kernel_dtypes() or not soft_triton.available():
            return False
        if q.is_cuda:  # where no tiles fit the device at this head dim: FlexAttention, one warning (common/triton.py)
            configs, kernels = soft_triton.tile_configs, soft_triton._LAUNCHED
            return triton_fits(configs, kernels, q.device, q.shape[-1], q.dtype, "focus soft", "FlexAttention")
        return gpu_paths_active(q) and q.device.type == "cpu" and interpreting()

    def _soft_takes_triton(self, q: Tensor) -> bool:
        """The soft call's kernel: Triton where it runs (``soft_triton_supports``), except a short query chunk of
        inference (decode) where FlexAttention runs too: its split-KV decoding kernel (queries < 128) spreads one
        query's keys over many programs, where the Triton forward walks them in one program per head."""
        if not self.soft_triton_supports(q):
            return False
        return q.shape[2] >= FLEX_DECODE_ROWS or torch.is_grad_enabled() or not flex_supports(q)

    def fast(
        self, q: Tensor, k: Tensor, v: Tensor, *, hidden: Tensor, q_pos: Tensor, k_pos: Tensor, cache: KVCache | None
    ) -> AttnOut:
        if self._device_decodes(q, cache):
            assert cache is not None  # checked there
            return self._hard_decode_device(q, hidden=hidden, q_pos=q_pos, cache=cache)
        if self._host_decodes(q, k, q_pos, cache):
            assert cache is not None  # checked there
            host = self._hard_decode_host(q, k, v, hidden=hidden, cache=cache)
            if host is not None:
                return host
        if self._hard_whole_graph(q, k, cache):
            torch._assert_async(
                (q_pos[-1] == q.shape[2] - 1) & (q_pos[0] == 0), "focus hard: positions must be 0 .. T - 1"
            )
            out = run_hard_inference(q, k, v, hidden, self.w_g.weight, self.centroids, self.cfg, self._scale())
            return AttnOut(out)  # what ``_out`` returns in plain inference (``_hard_whole_graph``)
        g_q, g_k = self.assignments(hidden, cache)
        return self.fast_assigned(q, k, v, g_q, g_k, q_pos=q_pos, k_pos=k_pos, cache=cache)

    def _hard_whole_graph(self, q: Tensor, k: Tensor, cache: KVCache | None) -> bool:
        """Whether this call is a whole-sequence hard-mode forward of plain inference on CUDA (no cache, autograd,
        loss, statistics or reference batch: nothing reads the assignments), run as one compiled graph
        (``hard_inference_fn``) rather than op by op. Not while an enclosing torch.compile traces (that graph takes
        the ops), nor for a sequence within one FlexAttention block (see ``flex_hard_attention``)."""
        if self.cfg.mode != "hard" or cache is not None or not _compiles_whole(q) or torch.compiler.is_compiling():
            return False
        if self.training or self.collect_stats or self.reference_batch or torch.is_grad_enabled():
            return False
        return flex_supports(q) and q.shape[2] == k.shape[2] and q.shape[2] * self.cfg.top_k > FLEX_BLOCK

    def fast_assigned(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        g_q: Tensor,
        g_k: Tensor,
        *,
        q_pos: Tensor,
        k_pos: Tensor,
        cache: KVCache | None,
    ) -> AttnOut:
        if self.cfg.mode == "hard":
            bits_q, bits_k = self._memberships(g_q, g_k, cache)
            out = self.hard_fast(q, k, v, bits_q, bits_k, q_pos, cache)
        elif self._soft_takes_triton(q):
            # queries at the last Tq positions of the keys (the base class's protocol: training, prefill, decode, CP)
            cfg = self.cfg
            out = soft_triton.triton_soft_attention(
                q, k, v, g_q, g_k, self.lam, window=cfg.window, scale=self._scale(), gate=cfg.gate
            )
        elif flex_supports(q):
            cfg = self.cfg
            out = flex_soft_attention(
                q, k, v, g_q, g_k, self.lam, q_pos, window=cfg.window, scale=self._scale(), gate=cfg.gate
            )
        else:
            out = self.soft_cpu(q, k, v, g_q, g_k, q_pos, k_pos)
        return self._out(out, g_q, g_k, q_pos, k_pos, cache)

    # ---- context parallelism ----------------------------------------------------------
    # A token's assignment reads the group scores of every token before it (prefix Sinkhorn: the cumulative
    # group masses; sequence scope: all tokens), and the gate reads every key's assignment. Under CP each rank
    # gathers the per-token group scores [B, T, K] (K floats a token, next to K and V's 2 Hkv D) and runs the
    # Sinkhorn over the whole sequence once per layer: cheap (T K iterations), exact, and the gradient of the
    # scores goes back to the rank that owns the token through the gather's reduce-scatter. Every rank runs it over
    # the whole sequence, so its intermediates (10 iterations of [B, T, K], partly float64) would not shrink with
    # cp: they are recomputed in the backward instead (non-reentrant checkpoint: the same values), and a rank keeps
    # only the gathered scores and assignments.
    def cp_context(
        self, q: Tensor, k: Tensor, v: Tensor, *, hidden: Tensor, gather: CPGather, positions: Tensor
    ) -> Any:
        scores = gather(self.group_scores(hidden), 1)
        if torch.is_grad_enabled() and scores.requires_grad and not torch.compiler.is_compiling():
            return checkpoint(self.assign_whole, scores, use_reentrant=False)
        return self.assign_whole(scores)

    def cp_attend(
        self, q: Tensor, k: Tensor, v: Tensor, *, hidden: Tensor, q_pos: Tensor, k_pos: Tensor, context: Any
    ) -> AttnOut:
        g_q, g_k = context[:, q_pos], context[:, : k.shape[2]]
        if self.impl != "reference" and self.has_fast_path(q, None):
            return self.fast_assigned(q, k, v, g_q, g_k, q_pos=q_pos, k_pos=k_pos, cache=None)
        return self.reference_assigned(q, k, v, g_q, g_k, q_pos=q_pos, k_pos=k_pos, cache=None)

    def soft_cpu(
        self, q: Tensor, k: Tensor, v: Tensor, g_q: Tensor, g_k: Tensor, q_pos: Tensor, k_pos: Tensor
    ) -> Tensor:
        """Soft mode on the CPU: the blockwise exact path (``soft/cpu.py``) when the queries are the last positions of
        the keys (a sequence, a prefill chunk, a decode step), else the dense form."""
        tq, tk = q.shape[2], k.shape[2]
        ends_keys = int(q_pos[-1]) == tk - 1 and (tq == 1 or int(q_pos[0]) == tk - tq) and int(k_pos[0]) == 0
        if not ends_keys:
            return self._soft_reference(q, k, v, g_q, g_k, q_pos, k_pos)
        cfg = self.cfg
        return cpu_soft_attention(q, k, v, g_q, g_k, self.lam, window=cfg.window, scale=self._scale(), gate=cfg.gate)

    def hard_fast(
        self, q: Tensor, k: Tensor, v: Tensor, bits_q: Tensor, bits_k: Tensor, q_pos: Tensor, cache: KVCache | None
    ) -> Tensor:
        """The fastest exact hard-mode path for this call (see the package docstring)."""
        cfg, scale = self.cfg, self._scale()
        tq, tk = q.shape[2], k.shape[2]
        lists = cache.extra.get("focus_lists") if cache is not None else None
        if flex_supports(q) and not (tq == 1 and lists is not None and lists.length == tk):
            # the GPU's training / prefill path: the queries are the last tq keys (the protocol), checked on the
            # device: reading the positions on the host would synchronise every layer of every step
            torch._assert_async(
                (q_pos[-1] == tk - 1) & (q_pos[0] == tk - tq), "focus hard: positions must end the keys"
            )
            return flex_hard_attention(
                q, k, v, bits_q=bits_q, bits_k=bits_k, window=cfg.window, scale=scale, n_groups=cfg.n_groups,
                top_k=cfg.top_k, compiled=q.is_cuda,
            )  # fmt: skip
        # positions are contiguous aranges ending at the last key (one read when decoding)
        ends_keys = int(q_pos[-1]) == tk - 1 and (tq == 1 or int(q_pos[0]) == tk - tq)
        if ends_keys and tq == 1 and lists is not None and lists.length == tk:
            decode = decode_hard_attention
            if q.device.type == "cpu" and q.dtype in cpu_kernel_dtypes() and not torch.is_grad_enabled():
                decode = cpu_decode_hard_attention
            return decode(q, k, v, bits_q=bits_q, bits_k=bits_k, lists=lists, window=cfg.window, scale=scale)
        common = dict(bits_q=bits_q, bits_k=bits_k, window=cfg.window, scale=scale, n_groups=cfg.n_groups)
        if ends_keys and q.device.type == "cpu" and q.dtype in cpu_kernel_dtypes():
            return cpu_hard_attention(q, k, v, **common, top_k=cfg.top_k)
        return group_sparse.hard_attention(q, k, v, q_pos=q_pos, **common)

    def _device_decodes(self, q: Tensor, cache: KVCache | None) -> bool:
        """Whether this call is one hard-mode decode step of plain inference (no autograd, no loss, statistics or
        reference batch: nothing reads the assignments) after a prefill, on the GPU paths (CUDA, or CPU inside
        ``gpu_paths_forced``): ``_hard_decode_device``. Prefix Sinkhorn or softmax assignments (sequence scope
        re-assigns every key at each token)."""
        cfg = self.cfg
        if cache is None or q.shape[2] != 1 or cfg.mode != "hard" or not gpu_paths_active(q):
            return False
        sinkhorn = cfg.assignment == "sinkhorn"
        if sinkhorn and cfg.sinkhorn_scope != "prefix":
            return False
        if self.training or self.collect_stats or self.reference_batch or torch.is_grad_enabled():
            return False
        extra = cache.extra
        if "focus_bits" not in extra or "focus_g" not in extra:  # no prefill yet: the tensor path starts the cache
            return False
        state = extra.get("focus_sinkhorn")
        return not sinkhorn or host_decode.KEY in extra or (state is not None and state.dtype == extra["focus_g"].dtype)

    def _hard_decode_device(self, q: Tensor, *, hidden: Tensor, q_pos: Tensor, cache: KVCache) -> AttnOut:
        """One hard-mode decode step as ``device_decode_step`` (see its module docstring: static shapes, no host
        synchronisation, capturable in a CUDA graph), reading the token's groups' pages and the window; on CUDA
        compiled (``decode_step_fn``), its attention the split-KV Triton kernel (``_decode_kernel``). Equal to
        ``assignments`` + ``_memberships`` + ``hard_fast``, and it keeps the cache's tensors (Sinkhorn state,
        assignments, membership words) as they do, and the group page tables (``focus_pages``) for the next token."""
        host_decode.flush(cache)  # a cache decoded on the host before (CPU): its state back into the tensors
        cache.extra.pop("focus_lists", None)  # the CPU paths' per-group lists: not kept up to date from here
        cfg = self.cfg
        state = cache.extra.get("focus_sinkhorn") if cfg.assignment == "sinkhorn" else None
        g_all, bits_all = cache.extra["focus_g"], cache.extra["focus_bits"]
        # the protocol: the token is the last cached key (a device-side check: reading q_pos would synchronise)
        torch._assert_async((q_pos == cache.length - 1).all(), "focus decode: the position must end the cache")
        pages: GroupPages | None = cache.extra.get("focus_pages")
        if pages is None or pages.length != cache.length - 1:  # after a prefill (or a chunk by the tensor path)
            pages = cache.extra["focus_pages"] = build_pages(bits_all, q_pos, cfg.n_groups, cfg.window)
        step = decode_step_fn() if _compiles_whole(q) and not torch.compiler.is_compiling() else device_decode_step
        out = step(
            q, cache.k, cache.v, hidden, self._fold(cache, g_all.dtype), q_pos, state, g_all, bits_all, pages,
            iters=cfg.sinkhorn_iters, top_k=cfg.top_k, window=cfg.window, scale=self._scale(),
            kernel=_decode_kernel(q), splits=decode_triton.splits_for(cache.max_len),
        )  # fmt: skip
        pages.length = cache.length
        return AttnOut(out)  # what ``_out`` returns in plain inference (``_device_decodes``)

    def _host_decodes(self, q: Tensor, k: Tensor, q_pos: Tensor, cache: KVCache | None) -> bool:
        """Whether this call is one CPU hard-mode decode step of plain inference (no autograd, no loss, statistics
        or reference batch: nothing reads the assignments) after a prefill, whose assignment ``_hard_decode_host``
        computes on host floats."""
        cfg = self.cfg
        if cache is None or q.shape[2] != 1 or cfg.mode != "hard" or cfg.assignment != "sinkhorn":
            return False
        if self.training or self.collect_stats or self.reference_batch:
            return False
        lists, tk = cache.extra.get("focus_lists"), k.shape[2]
        if lists is None or lists.length != tk - 1 or cfg.sinkhorn_scope != "prefix" or torch.is_grad_enabled():
            return False
        state = host_decode.KEY in cache.extra or "focus_sinkhorn" in cache.extra
        return state and q.device.type == "cpu" and q.dtype in cpu_kernel_dtypes() and int(q_pos[0]) == tk - 1

    def _hard_decode_host(self, q: Tensor, k: Tensor, v: Tensor, *, hidden: Tensor, cache: KVCache) -> AttnOut | None:
        """One hard-mode decode step whose scores -> Sinkhorn -> top-k memberships run on host floats
        (``focus_decode_host``), then ``cpu_decode_hard_attention``. Equal to ``assignments`` + ``_memberships`` +
        ``hard_fast`` (the assignment rounded to its tensor dtype before the top-k, as there). None, with nothing
        changed, where the tensor path must run (a non-finite score or mass, another dtype)."""
        dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        host = cache.extra.get(host_decode.KEY)
        if host is None:
            state = cache.extra["focus_sinkhorn"]
            if not host_decode.HostDecode.accepts(state, dtype):
                return None
            host = host_decode.HostDecode(state, start=cache.length - 1)
        elif host.dtype != dtype:
            return None
        # [B][K]; one sequence as a matrix-vector product (the shortest call: F.linear cost 3x as long in situ)
        fold, b_size = self._fold(cache, dtype), hidden.shape[0]
        if b_size == 1:
            scores = [torch.mv(fold, hidden.reshape(-1).to(dtype)).tolist()]
        else:
            scores = (hidden.reshape(b_size, -1).to(dtype) @ fold.T).tolist()
        words = host.step(scores, self.cfg.top_k)
        if words is None:
            return None
        if cache.extra.pop("focus_sinkhorn", None) is not None:  # the host holds the state from here on
            cache.extra[host_decode.KEY] = host
        lists: GroupLists = cache.extra["focus_lists"]
        lists.append_words(words)
        out = cpu_decode_hard_attention(
            q, k, v, bits_q=None, words=words, bits_k=lambda: host.bits(cache), lists=lists, window=self.cfg.window,
            scale=self._scale(),
        )  # fmt: skip
        return AttnOut(out)  # what ``_out`` returns in plain inference (``_host_decodes``)

    def _memberships(self, g_q: Tensor, g_k: Tensor, cache: KVCache | None) -> tuple[Tensor, Tensor]:
        bits_q = membership_bits(g_q, self.cfg.top_k)
        if self.cfg.sinkhorn_scope == "sequence" and self.cfg.assignment == "sinkhorn":
            return bits_q, membership_bits(g_k, self.cfg.top_k)  # earlier keys were re-assigned
        if cache is None and g_k is not g_q:  # context parallelism: the keys' assignments, gathered (cp_context)
            return bits_q, membership_bits(g_k, self.cfg.top_k)
        if cache is not None and self.cfg.mode == "hard" and not gpu_paths_active(bits_q):
            # per-group member positions, for the CPU's decoding (the device step reads ``focus_bits`` instead)
            lists = cache.extra.get("focus_lists")
            if lists is None:
                lists = cache.extra["focus_lists"] = GroupLists(bits_q.shape[0], self.cfg.n_groups, bits_q.device)
            lists.append(bits_q)
        return bits_q, self._cached(cache, "focus_bits", bits_q)

    # ---- auxiliary loss and statistics ------------------------------------------------
    def _out(
        self, output: Tensor, g_q: Tensor, g_k: Tensor, q_pos: Tensor, k_pos: Tensor, cache: KVCache | None
    ) -> AttnOut:
        aux = None
        penalise = self.cfg.entropy == "always" or not self.backbone_trains  # the paper: centroid phase only
        if self.training and self.cfg.entropy_weight > 0 and self.centroids.requires_grad and penalise:
            aux = self.cfg.entropy_weight * self._entropy(g_q) / self.spec.n_layers  # summed by the model: the mean
        if self.reference_batch:
            return AttnOut(output, stats=self._stability(g_q))
        if not self.collect_stats:
            return AttnOut(output, aux_loss=aux)
        entropy = self._entropy(g_q)
        with torch.no_grad():
            g = g_q.detach()
            # counts by scatter rather than bincount, whose output size depends on the data: a compiled block
            # (train.compile) would break its graph there on every logging step
            top = g.argmax(-1).flatten()
            share = g.new_zeros(self.cfg.n_groups, dtype=torch.float32).scatter_add_(
                0, top, torch.ones_like(top, dtype=torch.float32)
            ) / (g.shape[0] * g.shape[1])
            stats = {
                "max_group_share": share.max(),
                "confidence": g.max(-1).values.mean(),
                "entropy": entropy.detach(),
                "imbalance": group_imbalance(g),
                "lambda": self.lam.detach().float().sum(),  # a new tensor: FSDP2 frees the gathered parameter
            }
            stats.update(self._pair_stats(g, g_k.detach(), q_pos, k_pos, cache))
        return AttnOut(output, aux_loss=aux, stats=stats)

    @staticmethod
    def _entropy(g: Tensor) -> Tensor:
        """Mean assignment entropy (computed only when the loss or the statistics use it)."""
        return -(g * torch.log(g.clamp_min(1e-30))).sum(-1).mean()

    def _pair_stats(
        self, g_q: Tensor, g_k: Tensor, q_pos: Tensor, k_pos: Tensor, cache: KVCache | None
    ) -> dict[str, Tensor]:
        """Mean gate on distant pairs (soft) or the share of causal pairs kept (hard), on sampled query rows."""
        rows = torch.arange(0, g_q.shape[1], max(1, g_q.shape[1] // STATS_ROWS), device=g_q.device)
        g_q, q_pos = g_q[:, rows], q_pos[rows]
        # sampled rows in blocks of at most STATS_BLOCK pairs: the [B, rows, Tk] temporaries would otherwise be a
        # fixed cost the size of a layer's activations at long context (and not split by context parallelism)
        step = max(1, STATS_BLOCK // max(1, k_pos.numel()))
        # sums stay on the device (no host sync, no data-dependent shape: the compiled block keeps one graph)
        total = torch.zeros((), dtype=torch.float64, device=g_q.device)
        count = torch.zeros((), dtype=torch.long, device=g_q.device)
        causal_count = torch.zeros((), dtype=torch.long, device=g_q.device)
        for lo in range(0, q_pos.numel(), step):
            gq, qp = g_q[:, lo : lo + step], q_pos[lo : lo + step]
            causal = ref.causal_mask(qp, k_pos)
            if self.cfg.mode == "hard":
                bits_q, bits_k = membership_bits(gq, self.cfg.top_k), membership_bits(g_k, self.cfg.top_k)
                total = total + hard_mask(bits_q, bits_k, qp, k_pos, self.cfg.window).sum()
                causal_count = causal_count + causal.sum() * gq.shape[0]
                continue
            gate, distant = naive.gate_logits(gq, g_k, self.lam, qp, k_pos, window=self.cfg.window, gate=self.cfg.gate)
            if self.cfg.gate == "additive":
                gate = gate.exp()
            pairs = distant & causal
            total = total + torch.where(pairs, gate, 0).sum(dtype=torch.float64)
            count = count + pairs.sum() * gq.shape[0]
        if self.cfg.mode == "hard":
            return {"pairs_kept": (total / causal_count).to(torch.get_default_dtype())}
        if k_pos.numel() <= self.cfg.window:  # from the shapes: no key lies `window` positions before a query
            return {}
        return {"gate_distant": (total / count.clamp(min=1)).to(g_q.dtype)}  # 0 if the sampled rows hold none

    def _stability(self, g: Tensor) -> dict[str, Tensor]:
        """Share of the reference batch's tokens whose argmax group is the same as at the last pass."""
        groups = g.detach().argmax(-1)
        previous, self._previous_groups = self._previous_groups, groups
        if previous is None or previous.shape != groups.shape:
            return {}
        return {"stability": (groups == previous).float().mean()}
