"""The worker of tests/model/test_context_parallel.py: one gloo process of a cp=2 group. Every rank runs every
case twice, once whole on its own (the single-process reference) and once as its CP share, and rank 0 writes
each case's largest differences (relative to the reference's largest magnitude) as JSON."""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from model.attention import LayerSpec, build_attention, registry
from model.attention.common.context_parallel import ContextParallel, context_parallel_attention, shard_batch
from model.config import ModelConfig
from model.transformer import Transformer, apply_context_parallel

CP = 2
EOS = 3  # document masking: the token id ending a document


@dataclass(frozen=True)
class Case:
    """One attention-layer case: a variant's suite case, an impl, a dtype, with or without documents."""

    name: str
    kind: str
    options: dict[str, Any] = field(default_factory=dict)
    impl: str = "auto"
    dtype: str = "float32"
    documents: bool = False
    model: bool = False  # a 2-layer Transformer instead of one attention layer
    ref_impl: str | None = None  # the single-process reference's impl (the same parameters), when not ``impl``


def cases() -> list[Case]:
    """From the registry: every trainable variant's causal suite cases that have a CP form, the dense reference
    in float64 and the fast paths in float32; document masking where a variant supports it; and a tiny model
    per variant."""
    out = []
    for kind, entry in sorted(registry.items()):
        cls = entry.cls
        if not cls.trainable:
            continue
        suite = [c for c in cls.suite_cases() if c.causal and cls.cp_unsupported(entry.config_cls(**c.options)) is None]
        for sc in suite:
            out.append(Case(f"{kind}-{sc.name}-reference", kind, sc.options, "reference", "float64"))
            out.append(Case(f"{kind}-{sc.name}-auto", kind, sc.options, "auto", "float32"))
            # the fast paths under CP in float64 against the dense reference in one process
            out.append(Case(f"{kind}-{sc.name}-auto64", kind, sc.options, "auto", "float64", ref_impl="reference"))
        if cls.supports_documents:
            out.append(Case(f"{kind}-documents-reference", kind, {}, "reference", "float64", documents=True))
            out.append(Case(f"{kind}-documents-auto", kind, {}, "auto", "float32", documents=True))
        out.append(Case(f"{kind}-model", kind, suite[0].options if suite else {}, "auto", "float64", model=True))
        if cls.supports_documents:
            out.append(Case(f"{kind}-model-documents", kind, {}, "auto", "float64", documents=True, model=True))
    return out


def seq_len(case: Case) -> int:
    """4 chunks (cp=2), each a multiple of the variant's chunk multiple, about 12 tokens each."""
    entry = registry[case.kind]
    m = entry.cls.cp_chunk_multiple(entry.config_cls(**case.options))
    return 2 * CP * m * math.ceil(12 / m)


def rel(a: Tensor, b: Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-30))


def documents_of(b: int, t: int, gen: torch.Generator) -> Tensor:
    """Document ids [B, T] with boundaries crossing the CP chunks."""
    eos = torch.rand(b, t, generator=gen) < 0.12
    return eos.long().cumsum(-1) - eos.long()


def layer_case(case: Case, cp: ContextParallel) -> dict[str, float]:
    dtype = getattr(torch, case.dtype)
    torch.manual_seed(0)
    spec = LayerSpec(d_model=32, n_heads=4, n_kv_heads=2, head_dim=8, max_seq_len=256, layer_idx=0, n_layers=1)
    entry = registry[case.kind]
    core = build_attention(case.kind, entry.config_cls(**case.options), spec, case.impl).to(dtype)
    core.train()
    for p in core.parameters():  # off their initial values (zeros for Focal's w_tau)
        p.data.add_(0.3 * torch.randn_like(p))
    b, t = 2, seq_len(case)
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(b, n, t, 8, generator=gen, dtype=dtype) for n in (4, 2, 2))
    hidden = torch.randn(b, t, 32, generator=gen, dtype=dtype)
    w = torch.randn(b, 4, t, 8, generator=gen, dtype=dtype)
    docs = documents_of(b, t, gen) if case.documents else None
    leaves = [x.clone().requires_grad_() for x in (q, k, v, hidden)]
    ref_core = core
    if case.ref_impl is not None:
        ref_core = build_attention(case.kind, entry.config_cls(**case.options), spec, case.ref_impl).to(dtype)
        ref_core.load_state_dict(core.state_dict())
        ref_core.train()
    out = ref_core(*leaves[:3], hidden=leaves[3], positions=torch.arange(t), documents=docs)
    loss = (out.output * w).sum() + (out.aux_loss if out.aux_loss is not None else 0.0)
    ref_params = [p for p in ref_core.parameters() if p.requires_grad]
    ref_grads = torch.autograd.grad(loss, leaves + ref_params, allow_unused=True)
    params = [p for p in core.parameters() if p.requires_grad]
    core.zero_grad()

    def share(x: Tensor, dim: int) -> Tensor:
        return cp.shard(x, dim)

    local = [share(x, 2).clone().requires_grad_() for x in (q, k, v)] + [share(hidden, 1).clone().requires_grad_()]
    out_cp = context_parallel_attention(
        core, cp, *local[:3], hidden=local[3], positions=cp.positions(t // CP, "cpu"), documents=docs
    )
    aux_cp = out_cp.aux_loss if out_cp.aux_loss is not None else torch.zeros((), dtype=dtype)
    # the engines average gradients over the CP ranks: each rank's aux counts 1 / cp of the summed objective
    loss_cp = (out_cp.output * share(w, 2)).sum() + aux_cp / CP
    grads = torch.autograd.grad(loss_cp, local + params, allow_unused=True)
    errs = {"output": rel(out_cp.output, share(out.output.detach(), 2))}
    if out.aux_loss is not None:
        total = aux_cp.detach().clone()
        dist.all_reduce(total, group=cp.group)
        errs["aux"] = rel(total / CP, out.aux_loss.detach())  # each rank's is the mean over its own queries
    names = ["q", "k", "v", "hidden"]
    for i, (g, r) in enumerate(zip(grads[:4], ref_grads[:4], strict=True)):
        if r is None:  # hidden unused by this variant: CP must not use it either
            errs[f"grad_{names[i]}"] = 0.0 if g is None else float(g.abs().max())
        else:
            errs[f"grad_{names[i]}"] = rel(g, share(r, 2 if i < 3 else 1))
    pnames = [n for n, p in core.named_parameters() if p.requires_grad]
    for name, g, r in zip(pnames, grads[4:], ref_grads[4:], strict=True):
        if r is None:
            continue
        g = g.clone()
        dist.all_reduce(g, group=cp.group)
        errs[f"grad_{name}"] = rel(g, r)
    return errs


def model_case(case: Case, group: Any) -> dict[str, float]:
    """A 2-layer Transformer: loss (normalised by the global target count) and every parameter's gradient."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=256)
    cfg.attention.kind = case.kind
    cfg.attention.options[case.kind] = registry[case.kind].config_cls(**case.options)
    model = Transformer(cfg).double()
    model.document_eos_id = EOS if case.documents else None
    b, t = 2, seq_len(case)
    tokens = torch.randint(4, 64, (b, t + 1), generator=torch.Generator().manual_seed(2))
    if case.documents:
        tokens[:, 5::9] = EOS
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    n_global = targets.numel()

    def loss_of(x: Tensor, y: Tensor, ranks: int) -> Tensor:
        """What an engine averaging gradients over ``ranks`` ranks backpropagates (pretrain/engines/base.py)."""
        out = model(x, targets=y, return_logits=False)
        assert out.loss_sum is not None
        return out.loss_sum * (ranks / n_global) + (out.aux_loss if out.aux_loss is not None else 0.0)

    ref = loss_of(inputs, targets, 1)
    ref.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    cp = apply_context_parallel(model, group)
    loss = loss_of(*shard_batch(cp, inputs, targets), CP)
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total, group=group)
    errs = {"loss": rel(total / CP, ref.detach())}
    for n, p in model.named_parameters():
        if n in ref_grads:
            assert p.grad is not None
            g = p.grad.clone()
            dist.all_reduce(g, group=group)  # the data-parallel engines average over the CP ranks too
            errs[f"grad_{n}"] = rel(g / CP, ref_grads[n])
    return errs


def main(rank: int, init: str, out_path: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=CP)
    group = dist.group.WORLD
    cp = ContextParallel.of(group)
    torch.set_num_threads(1)
    results: dict[str, dict[str, float]] = {}
    for case in cases():
        results[case.name] = model_case(case, group) if case.model else layer_case(case, cp)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3])
