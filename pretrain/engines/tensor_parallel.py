"""Tensor parallelism for the GPT-2 and LLaMA blocks (``train.parallel.tp``), with ``parallelize_module``.

The plan (torchtitan's, without sequence parallelism: the residual stream stays replicated on the TP ranks):

- ``wq``, ``wk``, ``wv``, ``mlp.up``, ``mlp.gate``: ``ColwiseParallel`` (a rank holds its heads / columns);
  ``wo``, ``mlp.down``: ``RowwiseParallel`` (partial outputs all-reduced).
- ``tok_emb``: ``RowwiseParallel`` (vocabulary rows split, output replicated); ``lm_head``: ``ColwiseParallel``
  with replicated logits (no loss parallel). A tied head is tied again to the sharded embedding (both split
  the vocabulary dimension).
- Everything else becomes a DTensor on the TP mesh too (so FSDP2 sees one 2-D mesh and the gradient norm is
  one DTensor reduction), and each module computes on its local tensors (forward hooks swap them in):
  - an attention variant's per-head parameters (``Attention.head_sharded_parameters``) are split with the
    heads; the rest of the variant's parameters, and the per-head QK-norms, are replicated and their gradients
    summed over TP (each rank computes only its heads' part);
  - norms and learned positions are replicated; they see the replicated residual stream, so their gradients
    are already whole on every rank.
- The variant's ``hidden`` input (the replicated residual stream, which Focus and Focal read) gets its gradient
  summed over TP, as the projections' inputs do inside ``ColwiseParallel``.

A new variant is placed by its ``head_sharded_parameters`` alone; nothing here names a variant.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from model.transformer import Transformer


class _SumGradOverGroup(torch.autograd.Function):
    """Identity forward; the backward all-reduces (sums) the gradient over ``group`` (Megatron's ``f``)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def sum_grad_over(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """``x`` unchanged; its gradient summed over ``group``."""
    out: Tensor = _SumGradOverGroup.apply(x, group)
    return out


def _compute_locally(module: nn.Module, names: dict[str, dist.ProcessGroup | None]) -> None:
    """During ``module``'s forward its DTensor parameters ``names`` (dotted, its submodules' included: a variant
    may read a child's weight without calling the child, as Focus's decoding fold does) are their local tensors
    (the gradient summed over the group where one is given), restored afterwards. The swap reads ``_parameters``
    at call time, so it follows FSDP2, which registers the gathered parameters before the forward of the unit."""
    saved: dict[tuple[nn.Module, str], Any] = {}

    def swap_in(mod: nn.Module, args: Any) -> None:
        for dotted, group in names.items():
            path, _, leaf = dotted.rpartition(".")
            owner = mod.get_submodule(path)
            param = owner._parameters[leaf]
            if param is None:
                continue
            saved[(owner, leaf)] = param
            local = param.to_local() if hasattr(param, "to_local") else param
            owner._parameters[leaf] = sum_grad_over(local, group) if group is not None else local  # type: ignore[assignment]  # a local view stands in for the parameter during this forward

    def swap_out(mod: nn.Module, args: Any, output: Any) -> None:
        for (owner, leaf), param in saved.items():
            owner._parameters[leaf] = param
        saved.clear()

    module.register_forward_pre_hook(swap_in)
    module.register_forward_hook(swap_out, always_call=True)


def _sum_hidden_grad(group: dist.ProcessGroup) -> Callable[[nn.Module, tuple, dict], tuple[tuple, dict]]:
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        hidden = kwargs.get("hidden")
        if isinstance(hidden, Tensor) and hidden.requires_grad:
            kwargs = {**kwargs, "hidden": sum_grad_over(hidden, group)}
        return args, kwargs

    return hook


def tp_plan(model: Transformer) -> dict[str, Any]:
    """The ``parallelize_module`` plan: module path -> ``ColwiseParallel`` / ``RowwiseParallel``."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict[str, Any] = {
        "tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    }
    for i, block in enumerate(model.blocks):
        for name in ("attn.wq", "attn.wk", "attn.wv", "mlp.up") + (("mlp.gate",) if block.mlp.gate is not None else ()):
            plan[f"blocks.{i}.{name}"] = ColwiseParallel()
        plan[f"blocks.{i}.attn.wo"] = RowwiseParallel()
        plan[f"blocks.{i}.mlp.down"] = RowwiseParallel()
    return plan


def tp_shard_dims(model: Transformer) -> dict[str, int | None]:
    """Every parameter's name (``named_parameters``, a tied one once) -> the dimension tensor parallelism splits, or
    None where it is replicated: what ``apply_tp`` does, read off the same plan and variant hook (torch's styles:
    colwise splits a Linear's weight and bias on dim 0, an Embedding's weight on dim 1; rowwise a Linear's weight on
    dim 1 with the bias replicated, an Embedding's weight on dim 0). The layout planner's source."""
    from torch.distributed.tensor.parallel import ColwiseParallel

    dims: dict[str, int | None] = {}
    for path, style in tp_plan(model).items():
        module = model.get_submodule(path)
        colwise = isinstance(style, ColwiseParallel)
        for leaf, _ in module.named_parameters(recurse=False):
            if isinstance(module, nn.Embedding):
                dims[f"{path}.{leaf}"] = 1 if colwise else 0
            elif colwise:
                dims[f"{path}.{leaf}"] = 0
            else:
                dims[f"{path}.{leaf}"] = 1 if leaf == "weight" else None
    for i, block in enumerate(model.blocks):
        for leaf, dim in block.attn.core.head_sharded_parameters().items():
            dims[f"blocks.{i}.attn.core.{leaf}"] = dim
    return {name: dims.get(name) for name, _ in model.named_parameters()}


def apply_tp(model: Transformer, mesh: DeviceMesh) -> None:
    """Split ``model`` over the 1-D tensor-parallel ``mesh`` in place (see the module docstring)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import parallelize_module

    tied = model.lm_head.weight is model.tok_emb.weight
    parallelize_module(model, mesh, tp_plan(model))
    if tied:
        model.lm_head.weight = model.tok_emb.weight

    group = mesh.get_group()
    attention_modules = {id(m) for block in model.blocks for m in block.attn.modules()}
    # a variant's whole subtree is swapped by its core's hooks (it may read a child's weight directly)
    owner_of: dict[int, tuple[nn.Module, str]] = {}
    for block in model.blocks:
        for path, sub in block.attn.core.named_modules():
            owner_of[id(sub)] = (block.attn.core, path + "." if path else "")
    swaps: dict[int, tuple[nn.Module, dict[str, dist.ProcessGroup | None]]] = {}
    for module in model.modules():
        owner, prefix = owner_of.get(id(module), (module, ""))
        is_core = owner is module and id(module) in owner_of
        per_head = module.head_sharded_parameters() if is_core else {}  # type: ignore[operator]  # an Attention core
        for name, param in list(module._parameters.items()):
            if param is None or hasattr(param, "to_local"):  # placed by the plan above
                continue
            placement = Shard(per_head[name]) if name in per_head else Replicate()
            dt = distribute_tensor(param.detach(), mesh, [placement])
            module.register_parameter(name, nn.Parameter(dt, requires_grad=param.requires_grad))
            # inside the attention, a replicated parameter only sees the local heads: its gradient is partial
            reduce = group if id(module) in attention_modules and name not in per_head else None
            swaps.setdefault(id(owner), (owner, {}))[1][prefix + name] = reduce
    for owner, names in swaps.values():
        _compute_locally(owner, names)
    for block in model.blocks:
        block.attn.core.register_forward_pre_hook(_sum_hidden_grad(group), with_kwargs=True)
    model.heads_split = mesh.size()  # KV caches (generation) hold the local heads
