"""The one recipe that readies a built model for training, for every engine: ``parallelize``.

In this order, as torchtitan's ``parallelize_llama``:

0. float8 (``train.float8``, ``pretrain.engines.float8.convert``): the blocks' eligible linears become torchao's
   ``Float8Linear`` (same parameters); first, so the styles and wraps below see the converted modules;
1. tensor parallelism (``train.parallel.tp > 1``, ``tensor_parallel.apply_tp``): heads and MLP columns split over
   the TP mesh, every other parameter a DTensor on it;
2. context parallelism (``train.parallel.cp > 1``, ``model.transformer.apply_context_parallel``): every attention
   layer gets the CP group; after TP, so the cores see their local heads;
3. activation checkpointing (``train.activation_checkpointing``), per block;
4. ``torch.compile`` (``train.compile``), each block in place: parameter names, and so checkpoints, do not depend on
   it, and the wrap below shards compiled blocks;
5. the data-parallel wrap: FSDP2 (``fully_shard`` per block, then the root) over the mesh's data-parallel dims, or
   DDP, or none (one process; DeepSpeed wraps model and optimizer together afterwards).

The layout comes in as ``ParallelDims`` (the mesh over ``run.parallel.ParallelLayout``); without one (single, ddp,
deepspeed) steps 1, 2 are skipped: the config check allows tp / cp > 1 only on an engine that hosts them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch
    from torch import nn

    from model.transformer import Transformer
    from pretrain.engines.parallel_dims import ParallelDims
    from run.config import TrainConfig

DataParallel = Literal["none", "ddp", "fsdp"]


def parallelize(
    model: Transformer,
    cfg: TrainConfig,
    *,
    dims: ParallelDims | None = None,
    data_parallel: DataParallel = "none",
    device: torch.device | None = None,
    param_dtype: torch.dtype | None = None,
) -> nn.Module:
    """Apply TP, CP, activation checkpointing, compile and the data-parallel wrap to ``model`` in place (module
    docstring); returns the module the forward runs through. ``data_parallel``: ``"fsdp"`` shards over ``dims``
    (``param_dtype``: FSDP2's compute dtype, with float32 gradient reduction; None keeps the parameters' own),
    ``"ddp"`` replicates on ``device``. Under ``train.float8`` the conversion's log line is left in
    ``model.float8_summary``."""
    if cfg.float8 != "none":
        from pretrain.engines.float8 import convert

        where = device if device is not None else next(model.parameters()).device
        setattr(model, "float8_summary", convert(model, cfg, where, fsdp=data_parallel == "fsdp"))  # noqa: B010  (Module.__setattr__ is typed for tensors and modules)
    if dims is not None:
        tp_mesh = dims.tp_mesh()
        if tp_mesh is not None:
            from pretrain.engines.tensor_parallel import apply_tp

            apply_tp(model, tp_mesh, sequence_parallel=cfg.parallel.sequence_parallel)
        cp_mesh = dims.cp_mesh()
        if cp_mesh is not None:
            from model.transformer import apply_context_parallel

            apply_context_parallel(model, cp_mesh)
    model.activation_checkpointing = cfg.activation_checkpointing
    model.fused_cross_entropy = cfg.fused_cross_entropy
    if cfg.compile:
        for block in model.blocks:
            block.compile()
    if data_parallel == "fsdp":
        if dims is None:
            raise ValueError("parallelize: FSDP2 shards over a mesh; pass dims")
        return apply_fsdp(model, dims, param_dtype)
    if data_parallel == "ddp":
        if device is None:
            raise ValueError("parallelize: DDP needs the device")
        return apply_ddp(model, device)
    return model


def apply_fsdp(model: Transformer, dims: ParallelDims, param_dtype: torch.dtype | None) -> nn.Module:
    """``fully_shard`` each block, then the root (embeddings, final norm and the tied head in one unit), over
    ``dp_shard x cp`` (with ``dp_replicate`` in front: HSDP)."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kwargs: dict[str, Any] = {"mesh": dims.fsdp_mesh()}
    if param_dtype is not None:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def apply_ddp(model: Transformer, device: torch.device) -> nn.Module:
    """Replicated weights, gradients all-reduced (averaged) by DDP's reducer; also how ``ddp`` re-wraps when the
    trainable set changes."""
    from torch.nn.parallel import DistributedDataParallel

    ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=ids)
