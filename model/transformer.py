"""Pre-norm decoder shared by the GPT-2 and LLaMA families, with KV-cache generation."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.activation_checkpointing import checkpointed
from model.attention import AttnOut, KVCache, LayerSpec, build_attention
from model.attention.common.context_parallel import ContextParallel
from model.attention.common.flex import gpu_paths_active
from model.config import ModelConfig
from model.documents import document_ids, document_positions
from model.loss import IGNORE_INDEX, chunked_linear_cross_entropy
from model.rope import RotaryEmbedding, apply_rope


def make_norm(cfg: ModelConfig, dim: int | None = None) -> nn.Module:
    dim = dim or cfg.d_model
    if cfg.family == "gpt2":
        return nn.LayerNorm(dim, eps=cfg.norm_eps, bias=True)
    return nn.RMSNorm(dim, eps=cfg.norm_eps)


class MLP(nn.Module):
    """GELU MLP (gpt2) or SwiGLU (llama)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, h = cfg.d_model, cfg.ffn_dim
        self.gated = cfg.family == "llama"
        self.up = nn.Linear(d, h, bias=cfg.bias)
        self.gate = nn.Linear(d, h, bias=cfg.bias) if self.gated else None
        self.down = nn.Linear(h, d, bias=cfg.bias)

    def forward(self, x: Tensor) -> Tensor:
        if self.gate is not None:  # gated (llama)
            return self.down(F.silu(self.gate(x)) * self.up(x))
        return self.down(F.gelu(self.up(x), approximate="tanh"))


class SelfAttention(nn.Module):
    """Projections, QK-norm and RoPE around a pluggable attention core."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        d, hd = cfg.d_model, cfg.head_dim
        qkv_bias = cfg.bias or cfg.qkv_bias
        self.wq = nn.Linear(d, self.n_heads * hd, bias=qkv_bias)
        self.wk = nn.Linear(d, self.n_kv_heads * hd, bias=qkv_bias)
        self.wv = nn.Linear(d, self.n_kv_heads * hd, bias=qkv_bias)
        self.wo = nn.Linear(self.n_heads * hd, d, bias=cfg.bias)
        self.q_norm = nn.RMSNorm(hd, eps=cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = nn.RMSNorm(hd, eps=cfg.norm_eps) if cfg.qk_norm else None
        spec = LayerSpec(d, cfg.n_heads, cfg.kv_heads, hd, cfg.max_seq_len, layer_idx, cfg.n_layers)
        self.core = build_attention(cfg.attention.kind, cfg.attention.variant, spec, cfg.attention.impl)
        self.context_parallel: ContextParallel | None = None  # set by apply_context_parallel

    def forward(
        self,
        x: Tensor,
        *,
        positions: Tensor,
        rope: tuple[Tensor, Tensor] | None,
        cache: KVCache | None,
        documents: Tensor | None = None,
        step: Any = None,
    ) -> AttnOut:
        b, t, _ = x.shape
        # heads from the projections' sizes: under tensor parallelism a rank holds n_heads / tp of them
        q = self.wq(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        # under CP the core runs context_parallel_attention (through its module call: hooks on the core, such as
        # tensor parallelism's local-tensor swap, see the CP path too); a KV cache (generation) ignores CP
        cp = self.context_parallel if cache is None else None
        out = self.core(
            q, k, v, hidden=x, positions=positions, cache=cache, documents=documents, context_parallel=cp, step=step
        )
        out.output = self.wo(out.output.transpose(1, 2).reshape(b, t, -1))
        return out


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.norm1 = make_norm(cfg)
        self.attn = SelfAttention(cfg, layer_idx)
        self.norm2 = make_norm(cfg)
        self.mlp = MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)
        # train.activation_checkpointing (set through Transformer.activation_checkpointing). On the GPU paths it is
        # applied inside the block's own forward, so a compiled block traces the checkpoint and its selective policy
        # into one graph (checkpointing a compiled block from outside recomputes the whole compiled region in the
        # backward, whatever the policy). On the CPU paths (autograd Functions around the fused CPU kernel, which
        # torch.compile does not trace inside a checkpoint under autocast) the model checkpoints the block from outside.
        self.checkpointing = "none"

    def forward(
        self,
        x: Tensor,
        *,
        positions: Tensor,
        rope: tuple[Tensor, Tensor] | None,
        cache: KVCache | None,
        documents: Tensor | None = None,
        step: Any = None,
    ) -> tuple[Tensor, AttnOut]:
        """``step``: the attention core's per-step state (``Attention.prepare_step``), shared by every layer."""
        if self.recomputes(x, cache) and gpu_paths_active(x):
            return checkpointed(
                self.layer,
                self.checkpointing,
                x,
                positions=positions,
                rope=rope,
                cache=None,
                documents=documents,
                step=step,
            )
        return self.layer(x, positions=positions, rope=rope, cache=cache, documents=documents, step=step)

    def recomputes(self, x: Tensor, cache: KVCache | None) -> bool:
        """Whether this forward runs under activation checkpointing (training, with gradients, no cache)."""
        return self.checkpointing != "none" and self.training and torch.is_grad_enabled() and cache is None

    def layer(
        self,
        x: Tensor,
        *,
        positions: Tensor,
        rope: tuple[Tensor, Tensor] | None,
        cache: KVCache | None,
        documents: Tensor | None = None,
        step: Any = None,
    ) -> tuple[Tensor, AttnOut]:
        a = self.attn(self.norm1(x), positions=positions, rope=rope, cache=cache, documents=documents, step=step)
        x = x + self.drop(a.output)
        x = x + self.drop(self.mlp(self.norm2(x)))
        # the attention output is in the residual stream now; handed out with its graph, FSDP2 hooked it as a second
        # output of the block, a view under tensor parallelism (DTensor.to_local), and warned (docs/parallel.md)
        a.output = a.output.detach()
        return x, a


@dataclass
class ModelOutput:
    logits: Tensor | None = None  # [B, T, V]
    loss_sum: Tensor | None = None  # summed token cross-entropy (the loop normalises by the global token count)
    n_tokens: int = 0  # targets counted in loss_sum
    aux_loss: Tensor | None = None  # summed over layers
    stats: dict[str, Tensor] = field(default_factory=dict)  # attn/<variant>/<name>, mean over layers
    layer_stats: list[dict[str, Tensor]] = field(default_factory=list)  # each layer's own statistics (when collected)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.max_seq_len, cfg.d_model) if cfg.family == "gpt2" else None
        self.rope = RotaryEmbedding(cfg.rope, cfg.head_dim, cfg.max_seq_len) if cfg.uses_rope else None
        self.drop = nn.Dropout(cfg.dropout)
        # an nn.ModuleList (registered as submodules), typed by what it holds
        self.blocks = cast("Sequence[Block]", nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers)))
        self.norm_f = make_norm(cfg)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        # data.document_masking: the EOS id that ends documents; whole-sequence forwards then mask
        # attention per document and restart positions (model/documents.py). None = off.
        self.document_eos_id: int | None = None
        # tensor parallelism splits the heads over this many ranks (set by the TP plan): a KV cache holds the local ones
        self.heads_split = 1
        # context parallelism (apply_context_parallel): idx / targets hold this rank's share of each sequence
        self.context_parallel: ContextParallel | None = None
        # training forwards (targets, no logits) take the fused chunked head + cross-entropy (model/loss.py) where the
        # head allows it (fused_head_applies); False forces the plain logits path, the reference. loss_chunk: tokens
        # per chunk (None: model.loss.default_chunk by the vocabulary size)
        self.fused_cross_entropy = True
        self.loss_chunk: int | None = None
        scalars = [name for name, p in self.named_parameters() if p.dim() == 0]
        if scalars:  # fully_shard refuses them at wrap time, on a cluster: say so when the model is built
            raise ValueError(
                f"attention variant {cfg.attention.kind!r}: 0-dim parameters {', '.join(scalars)}; FSDP2 cannot "
                "shard a scalar parameter, make it shape [1]"
            )
        self.reset_parameters()

    @property
    def activation_checkpointing(self) -> str:
        """train.activation_checkpointing: a training choice, not part of the model (set by the engine); each block
        holds it (``Block.checkpointing``) and applies it inside its forward on the GPU paths, the model around the
        block on the CPU paths."""
        return self.blocks[0].checkpointing if len(self.blocks) else "none"

    @activation_checkpointing.setter
    def activation_checkpointing(self, mode: str) -> None:
        for block in self.blocks:
            block.checkpointing = mode

    def reset_parameters(self) -> None:
        """GPT-2 initialisation: N(0, 0.02), residual output projections scaled by 1/sqrt(2L)."""
        std = self.cfg.init_std
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                scale = (
                    1.0 / math.sqrt(2 * self.cfg.n_layers) if name.endswith(("wo.weight", "mlp.down.weight")) else 1.0
                )
                nn.init.normal_(p, mean=0.0, std=std * scale)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
        for m in self.modules():
            if isinstance(m, (nn.LayerNorm, nn.RMSNorm)):
                m.reset_parameters()
            elif m is not self and hasattr(m, "reset_parameters") and not isinstance(m, (nn.Linear, nn.Embedding)):
                getattr(m, "reset_parameters")()  # noqa: B009  (Module.__getattr__ is typed as a tensor or module)  # variant-owned parameters (centroids, bias tables, ...)
        if self.rope is not None:
            self.rope.reset_buffers()

    def set_collect_stats(self, enabled: bool) -> None:
        for block in self.blocks:
            block.attn.core.collect_stats = enabled

    def set_train_progress(self, step: int, max_steps: int) -> None:
        """Tell variants with step-dependent settings (Focus's lambda schedule) where training is."""
        for block in self.blocks:
            block.attn.core.set_train_progress(step, max_steps)

    @contextmanager
    def whole_sequences(self) -> Iterator[None]:
        """Inside, forwards take whole sequences on this rank, as without context parallelism (the fixed-batch
        statistics, or evaluation that does not shard its batches); CP is restored on exit."""
        cp, self.context_parallel = self.context_parallel, None
        for block in self.blocks:
            block.attn.context_parallel = None
        try:
            yield
        finally:
            self.context_parallel = cp
            for block in self.blocks:
                block.attn.context_parallel = cp

    def fused_head_applies(self) -> bool:
        """Whether the fused head + cross-entropy computes what ``lm_head`` would: a bias-free ``nn.Linear`` whose
        forward nothing intercepts (no module hooks: tensor parallelism's styles and DeepSpeed ZeRO-3 gather through
        them) on an ordinary tensor (not a DTensor: a column-parallel head under TP; nor a ZeRO-3 partitioned one).
        FSDP2 qualifies: the root's hooks put the gathered weight in place before this forward runs."""
        head = self.lm_head
        weight = head.weight
        return (
            type(head) is nn.Linear
            and head.bias is None
            and not head._forward_hooks
            and not head._forward_pre_hooks
            and not hasattr(weight, "to_local")  # a DTensor
            and not hasattr(weight, "ds_id")  # a DeepSpeed ZeRO-3 parameter
        )

    @torch.no_grad()
    def reference_batch_stats(self, idx: Tensor) -> dict[str, Tensor]:
        """Statistics a variant measures on a fixed batch across log steps (Focus: assignment
        stability). An eval-mode forward, only when some layer asks for it."""
        cores = [block.attn.core for block in self.blocks if block.attn.core.uses_reference_batch]
        if not cores:
            return {}
        was_training = self.training
        self.eval()
        for core in cores:
            core.reference_batch = True
        try:
            with self.whole_sequences():  # the fixed batch is whole on every rank
                return self(idx, return_logits=False).stats
        finally:
            for core in cores:
                core.reference_batch = False
            self.train(was_training)

    def new_caches(
        self, batch: int, max_len: int, *, dtype: torch.dtype | None = None, device: torch.device | str | None = None
    ) -> list[KVCache]:
        ref = self.tok_emb.weight
        return [
            KVCache(
                batch,
                self.cfg.kv_heads // self.heads_split,
                self.cfg.head_dim,
                max_len,
                dtype=dtype or ref.dtype,
                device=device or ref.device,
            )
            for _ in self.blocks
        ]

    def forward(
        self,
        idx: Tensor,
        *,
        targets: Tensor | None = None,
        caches: list[KVCache] | None = None,
        return_logits: bool = True,
    ) -> ModelOutput:
        b, t = idx.shape
        cp = self.context_parallel if not caches else None
        start = caches[0].length if caches else 0
        total = start + t if cp is None else t * cp.size
        if self.pos_emb is not None and total > self.cfg.max_seq_len:
            raise ValueError(
                f"sequence of {total} tokens exceeds model.max_seq_len={self.cfg.max_seq_len} (learned positions)"
            )
        positions = torch.arange(start, start + t, device=idx.device) if cp is None else cp.positions(t, idx.device)
        documents, token_pos = None, positions  # token_pos: [B, T] within documents, else [T]
        if self.document_eos_id is not None and not caches:
            if cp is None:
                documents = document_ids(idx, self.document_eos_id)
                token_pos = document_positions(documents)
            else:
                # documents and their positions are global: read off the whole sequence's tokens (ids only, no
                # gradient); the attention layers get the whole [B, T] document ids, the embeddings this rank's share
                documents = document_ids(cp.gather_no_grad(idx, 1), self.document_eos_id)
                token_pos = cp.shard(document_positions(documents), 1)
        x = self.tok_emb(idx)
        if self.pos_emb is not None:
            x = x + self.pos_emb(token_pos)
        x = self.drop(x)
        rope = None
        if self.rope is not None:
            cos, sin = self.rope.cos_sin(token_pos.flatten(), x.dtype)
            # per-sequence positions broadcast over heads: [B, 1, T, D]
            rope = (cos, sin) if documents is None else (cos.view(b, 1, t, -1), sin.view(b, 1, t, -1))
        aux: Tensor | None = None
        stats: dict[str, Tensor] = {}
        layer_stats: list[dict[str, Tensor]] = []
        outside = not gpu_paths_active(x)  # the CPU paths: the block is checkpointed from here (Block.__init__)
        # what every layer's attention shares (a block mask that depends only on the shape, ...): built once here,
        # outside the compiled blocks, for whole-sequence forwards (Attention.prepare_step)
        step = None
        if cp is None and not caches and documents is None and len(self.blocks):
            step = self.blocks[0].attn.core.prepare_step(t, idx.device)
        for i, block in enumerate(self.blocks):
            cache = caches[i] if caches else None
            if outside and block.recomputes(x, cache):
                x, a = checkpointed(
                    block,
                    block.checkpointing,
                    x,
                    positions=positions,
                    rope=rope,
                    cache=None,
                    documents=documents,
                    step=step,
                )
            else:
                x, a = block(x, positions=positions, rope=rope, cache=cache, documents=documents, step=step)
            if a.aux_loss is not None:
                aux = a.aux_loss if aux is None else aux + a.aux_loss
            for key, value in a.stats.items():
                stats[key] = stats.get(key, 0.0) + value.detach().float() / len(self.blocks)
            if a.stats:
                layer_stats.append({k: v.detach().float() for k, v in a.stats.items()})
        kind = self.cfg.attention.kind
        out = ModelOutput(
            aux_loss=aux, stats={f"attn/{kind}/{k}": v for k, v in stats.items()}, layer_stats=layer_stats
        )
        hidden = self.norm_f(x)
        if targets is not None and not return_logits and self.fused_cross_entropy and self.fused_head_applies():
            out.loss_sum = chunked_linear_cross_entropy(
                hidden.flatten(0, 1), self.lm_head.weight, targets.flatten(), chunk=self.loss_chunk
            )
            out.n_tokens = int((targets != IGNORE_INDEX).sum())
            return out
        logits = self.lm_head(hidden)
        if targets is not None:
            out.loss_sum = F.cross_entropy(
                logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
            )
            out.n_tokens = int((targets != IGNORE_INDEX).sum())
        if return_logits:
            out.logits = logits
        return out

    @torch.no_grad()
    def generate(
        self,
        idx: Tensor,
        max_new_tokens: int,
        *,
        temperature: float = 0.0,
        top_k: int | None = None,
        eos_id: int | None = None,
        generator: torch.Generator | None = None,
        return_logits: bool = False,
        stop: Callable[[Tensor], bool] | None = None,
        vocab_size: int | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Prefill ``idx`` [B, T0] into a KV cache, then decode one token at a time.

        temperature 0 is greedy. Rows that produced ``eos_id`` keep emitting it.
        ``stop(new_tokens [B, n])`` ends decoding early when it returns True (stop strings).
        ``vocab_size``: only ids below it are generated (a tokenizer smaller than the model's padded
        vocabulary: the logits beyond it are masked, so every id decodes).
        With ``return_logits`` also returns the logits that chose each new token, [B, new, V].
        """
        b, t0 = idx.shape
        caches = self.new_caches(b, t0 + max_new_tokens)

        def last_logits(x: Tensor) -> Tensor:
            logits = self(x, caches=caches).logits[:, -1]
            if vocab_size is not None and vocab_size < logits.shape[-1]:
                logits = logits.clone()
                logits[:, vocab_size:] = float("-inf")
            return logits

        logits = last_logits(idx)
        tokens, chosen_logits = [], []
        done = torch.zeros(b, dtype=torch.bool, device=idx.device)
        for step in range(max_new_tokens):
            chosen_logits.append(logits)
            nxt = sample_next(logits, temperature=temperature, top_k=top_k, generator=generator)
            if eos_id is not None:
                nxt = torch.where(done, torch.full_like(nxt, eos_id), nxt)
                done |= nxt == eos_id
            tokens.append(nxt)
            if step + 1 == max_new_tokens or (eos_id is not None and bool(done.all())):
                break
            if stop is not None and stop(torch.stack(tokens, dim=1)):
                break
            logits = last_logits(nxt[:, None])
        out = torch.cat([idx, torch.stack(tokens, dim=1)], dim=1)
        return (out, torch.stack(chosen_logits, dim=1)) if return_logits else out


def sample_next(
    logits: Tensor, *, temperature: float = 0.0, top_k: int | None = None, generator: torch.Generator | None = None
) -> Tensor:
    if temperature <= 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def apply_context_parallel(model: Transformer, group: Any) -> ContextParallel:
    """Switch a built model to context parallelism over ``group`` (a process group or a 1-D DeviceMesh): every
    forward without a KV cache then takes this rank's share of each sequence (``shard_batch``), at global
    positions, and every attention layer gathers over the group. Checks each layer's variant has a CP form."""
    cp = ContextParallel.of(group)
    for block in model.blocks:
        core = block.attn.core
        reason = type(core).cp_unsupported(core.cfg)
        if reason:
            raise ValueError(f"attention variant {core.name!r} has no context parallelism: {reason}")
        block.attn.context_parallel = cp
    model.context_parallel = cp
    return cp


def build_model(cfg: ModelConfig, *, device: torch.device | str = "cpu") -> Transformer:
    cfg.validate()
    with torch.device(device):
        return Transformer(cfg)
