"""Tensor parallelism for the GPT-2 and LLaMA blocks (``train.parallel.tp``), with ``parallelize_module``.

The plan (torchtitan's):

- ``wq``, ``wk``, ``wv``, ``mlp.up``, ``mlp.gate``: ``ColwiseParallel`` (a rank holds its heads / columns);
  ``wo``, ``mlp.down``: ``RowwiseParallel``.
- ``tok_emb``: ``RowwiseParallel`` (vocabulary rows split); ``lm_head``: ``ColwiseParallel`` with replicated logits
  (no loss parallel). A tied head is tied again to the sharded embedding (both split the vocabulary dimension).
- Sequence parallelism (``train.parallel.sequence_parallel``, on by default): the residual stream between the
  blocks is split on the sequence dimension over the TP ranks. The embedding's output, ``wo``'s and ``down``'s are
  reduce-scattered onto the sequence (``output_layouts=Shard(1)``); the norms run ``SequenceParallel`` on the
  rank's tokens (dropout and the residual adds too, on plain local tensors); attention and the MLP take their input
  all-gathered (``PrepareModuleInput``: ``Shard(1)`` -> ``Replicate``), and so does the LM head (the final norm's
  output). Learned positions are split like the tokens (``_split_positions``). A forward with KV caches, or of a
  length the TP ranks do not divide, runs the same modules on the whole sequence (``SequenceSwitch``). Without
  it the residual stream stays replicated: the embedding, ``wo`` and ``down`` all-reduce.
- Everything else becomes a DTensor on the TP mesh too (so FSDP2 sees one 2-D mesh and the gradient norm is
  one DTensor reduction), and each module computes on its local tensors (forward hooks swap them in):
  - an attention variant's per-head parameters (``Attention.head_sharded_parameters``) are split with the
    heads; the rest of the variant's parameters, and the per-head QK-norms, are replicated and their gradients
    summed over TP (each rank computes only its heads' part);
  - learned positions (and, without sequence parallelism, the norms) are replicated; they see every token, so
    their gradients are already whole on every rank. Under sequence parallelism the norms' gradients are partial
    sums over the rank's tokens, DTensors that FSDP2 all-reduces over TP.
- The variant's ``hidden`` input (the residual stream, whole: Focus and Focal read it) gets its gradient summed
  over TP, as the projections' inputs do inside ``ColwiseParallel``: gathered under sequence parallelism, it is the
  DTensor's local tensor with a partial gradient, which the gather's backward reduce-scatters.

A new variant is placed by its ``head_sharded_parameters`` alone; nothing here names a variant.

Under ``train.float8`` with the tensorwise recipe the converted projections take torchao's float8 styles
(``Float8ColwiseParallel`` / ``Float8RowwiseParallel``: the input cast to float8 before it is gathered) and the MLP's
input is gathered in float8 (``PrepareFloat8ModuleInput``); attention's stays high precision (the variant reads the
residual stream as ``hidden``). The parameters are placed as by the plain styles (``pretrain.engines.float8``). On a
CPU mesh (gloo cannot carry float8 tensors) the plain styles apply to every recipe.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

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


class SequenceSwitch:
    """Whether the running forward splits the residual stream over the TP ranks: set by the model's forward
    pre-hook, read by the sequence-parallel styles' hooks of every module the forward runs (and of an
    activation-checkpointed block's recompute, which the backward runs before the next forward). Off for a forward
    with KV caches (decoding one token at a time) or of a length the TP ranks do not divide (evaluation's own
    lengths): the same modules then take the whole sequence, as without sequence parallelism."""

    def __init__(self, tp: int):
        self.tp = tp
        self.on = False

    def decide(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        idx = args[0] if args else kwargs["idx"]
        self.on = not kwargs.get("caches") and idx.shape[1] % self.tp == 0


class _SequenceRowwise(RowwiseParallel):
    """``RowwiseParallel`` whose partial output is reduce-scattered onto the sequence (``Shard(1)``) while the
    switch is on, all-reduced (``Replicate``) otherwise."""

    def __init__(self, switch: SequenceSwitch, **kwargs: Any):
        super().__init__(output_layouts=Shard(1), **kwargs)
        self.switch = switch

    def _prepare_output_fn(  # type: ignore[override]  # the style binds it with partial(self._prepare_output_fn, ...)
        self, output_layouts: Any, use_local_output: bool, mod: nn.Module, outputs: Any, device_mesh: DeviceMesh
    ) -> Any:
        layouts = output_layouts if self.switch.on else (Replicate(),)
        # the next style in the MRO: RowwiseParallel's, or torchao's float8 one (_float8_sequence_rowwise)
        return super()._prepare_output_fn(layouts, use_local_output, mod, outputs, device_mesh)


def _float8_sequence_rowwise(switch: SequenceSwitch) -> RowwiseParallel:
    """``_SequenceRowwise`` over torchao's ``Float8RowwiseParallel`` (a tensorwise float8 linear's)."""
    from torchao.float8.float8_tensor_parallel import Float8RowwiseParallel

    class _Float8SequenceRowwise(_SequenceRowwise, Float8RowwiseParallel):
        pass

    return _Float8SequenceRowwise(switch)


class _SequenceNorm(SequenceParallel):
    """``SequenceParallel`` for a norm: its (plain) input is this rank's share of the sequence while the switch is
    on, the whole sequence otherwise. The output stays a DTensor either way, so attention's and the MLP's
    ``PrepareModuleInput`` and the LM head's ``ColwiseParallel`` all-gather it only when it is split."""

    def __init__(self, switch: SequenceSwitch):
        super().__init__()
        self.switch = switch

    def _prepare_input_fn(  # type: ignore[override]  # bound with partial(self._prepare_input_fn, ...)
        self, sequence_sharding: Any, mod: nn.Module, inputs: Any, device_mesh: DeviceMesh
    ) -> Any:
        layouts = sequence_sharding if self.switch.on else (Replicate(),)
        return SequenceParallel._prepare_input_fn(layouts, mod, inputs, device_mesh)


def _split_positions(switch: SequenceSwitch, mesh: DeviceMesh) -> Callable[[nn.Module, Any, Tensor], Tensor | None]:
    """The learned positions' forward hook under sequence parallelism: their [T, D] (or, per document, [B, T, D])
    embeddings, computed whole, split like the tokens; the backward all-gathers the gradient, so every rank's
    (local, replicated) table gets the whole sequence's."""

    def hook(module: nn.Module, args: Any, output: Tensor) -> Tensor | None:
        if not switch.on:
            return None
        whole = DTensor.from_local(output, mesh, [Replicate()], run_check=False)
        return whole.redistribute(mesh, [Shard(output.dim() - 2)]).to_local()

    return hook


def _sum_hidden_grad(group: dist.ProcessGroup) -> Callable[[nn.Module, tuple, dict], tuple[tuple, dict]]:
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        hidden = kwargs.get("hidden")
        if isinstance(hidden, DTensor):  # sequence parallelism: attention's gathered input; this rank's heads' part
            kwargs = {**kwargs, "hidden": hidden.to_local(grad_placements=(Partial(),))}
        elif isinstance(hidden, Tensor) and hidden.requires_grad:
            kwargs = {**kwargs, "hidden": sum_grad_over(hidden, group)}
        return args, kwargs

    return hook


def _styles(model: nn.Module, path: str, float8: bool) -> tuple[type[ColwiseParallel], type[RowwiseParallel]]:
    """The (colwise, rowwise) style classes of linear ``path``: with ``float8``, torchao's float8 ones for a
    tensorwise float8 linear."""
    from pretrain.engines.float8 import tp_styles

    module = model.get_submodule(path)
    if not float8:
        return ColwiseParallel, RowwiseParallel
    return tp_styles(module, "colwise") or ColwiseParallel, tp_styles(module, "rowwise") or RowwiseParallel


def tp_plan(
    model: Transformer, switch: SequenceSwitch | None = None, *, float8_styles: bool = True
) -> dict[str, ParallelStyle]:
    """The ``parallelize_module`` plan: module path -> style; with ``switch``, sequence parallelism's.
    ``float8_styles``: torchao's float8 styles for tensorwise float8 linears (off over gloo, which carries no float8
    tensors: their activations and gradients would be gathered in float8; the plain styles then place the same
    parameters, and the linears still compute in float8)."""
    projections = {
        i: ("attn.wq", "attn.wk", "attn.wv", "mlp.up") + (("mlp.gate",) if block.mlp.gate is not None else ())
        for i, block in enumerate(model.blocks)
    }

    def colwise(path: str) -> ParallelStyle:
        return _styles(model, path, float8_styles)[0]()

    def rowwise(path: str) -> ParallelStyle:
        return _styles(model, path, float8_styles)[1]()

    plan: dict[str, ParallelStyle] = {}
    if switch is None:
        plan["tok_emb"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        plan["lm_head"] = ColwiseParallel(output_layouts=Replicate())
        for i in projections:
            plan |= {f"blocks.{i}.{name}": colwise(f"blocks.{i}.{name}") for name in projections[i]}
            plan |= {f"blocks.{i}.{out}": rowwise(f"blocks.{i}.{out}") for out in ("attn.wo", "mlp.down")}
        return plan
    gather = (Shard(1),), (Replicate(),)  # a module's input: split on the sequence -> whole
    plan["tok_emb"] = _SequenceRowwise(switch, input_layouts=Replicate())
    plan["norm_f"] = _SequenceNorm(switch)
    # norm_f's output DTensor: the style redistributes only when the declared input layout differs from Replicate
    # (it compares the declaration, not the actual placement), so it must say Shard(1) to gather a split one; a
    # whole one (the switch off) is Replicate already and passes unchanged
    plan["lm_head"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
    for i in projections:
        for norm, module, out in (("norm1", "attn", "attn.wo"), ("norm2", "mlp", "mlp.down")):
            plan[f"blocks.{i}.{norm}"] = _SequenceNorm(switch)
            plan[f"blocks.{i}.{module}"] = PrepareModuleInput(input_layouts=gather[0], desired_input_layouts=gather[1])
            float8_out = _styles(model, f"blocks.{i}.{out}", float8_styles)[1] is not RowwiseParallel
            plan[f"blocks.{i}.{out}"] = _float8_sequence_rowwise(switch) if float8_out else _SequenceRowwise(switch)
        mlp_inputs = [f"blocks.{i}.{name}" for name in projections[i] if name.startswith("mlp.")]
        if all(_styles(model, path, float8_styles)[0] is not ColwiseParallel for path in mlp_inputs):
            # the MLP's input feeds only its float8 linears: gathered in float8, once for up and gate
            from pretrain.engines.float8 import prepare_input_style

            plan[f"blocks.{i}.mlp"] = prepare_input_style(
                input_layouts=gather[0][0], desired_input_layouts=gather[1][0], fwd_config_submodule_fqn="up"
            )
        plan |= {f"blocks.{i}.{name}": colwise(f"blocks.{i}.{name}") for name in projections[i]}
    return plan


def tp_shard_dims(model: Transformer) -> dict[str, int | None]:
    """Every parameter's name (``named_parameters``, a tied one once) -> the dimension tensor parallelism splits, or
    None where it is replicated: what ``apply_tp`` does, read off the same plan and variant hook (torch's styles:
    colwise splits a Linear's weight and bias on dim 0, an Embedding's weight on dim 1; rowwise a Linear's weight on
    dim 1 with the bias replicated, an Embedding's weight on dim 0). Sequence parallelism places the same parameters
    the same way (its norms are replicated), so the plan without it says. The layout planner's source."""
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


def apply_tp(model: Transformer, mesh: DeviceMesh, *, sequence_parallel: bool) -> None:
    """Split ``model`` over the 1-D tensor-parallel ``mesh`` in place (see the module docstring)."""
    tied = model.lm_head.weight is model.tok_emb.weight
    trainable = {name: p.requires_grad for name, p in model.named_parameters()}
    switch = SequenceSwitch(mesh.size()) if sequence_parallel else None
    parallelize_module(model, mesh, tp_plan(model, switch, float8_styles=mesh.device_type != "cpu"))
    if tied:
        model.lm_head.weight = model.tok_emb.weight
    for name, placed in model.named_parameters():  # SequenceParallel makes a new (trainable) parameter of each norm's
        placed.requires_grad_(trainable[name])

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
    if switch is not None:
        model.register_forward_pre_hook(switch.decide, with_kwargs=True)
        if model.pos_emb is not None:
            model.pos_emb.register_forward_hook(_split_positions(switch, mesh))
    model.heads_split = mesh.size()  # KV caches (generation) hold the local heads
