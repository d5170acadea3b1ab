"""Sizes against what a job can hold, checked before anything is allocated (``--dry-run`` included).

The model's own integer sizes are bounded by ``ModelConfig.validate`` (``model.config.SIZE_LIMITS``: what the formats
allow, or far past any model trained). Here they meet the machine: a run is refused in one line when a floor of what
it must hold already exceeds the memory of the job, so that a typo (``num_hidden_layers: 1e9``, ``--set
model.n_layers=...``) ends before a model is built rather than growing memory until the kernel kills the process.

The floors are lower bounds, never estimates, so a run that could fit is never refused (the planner, ``launch.plan``,
estimates the rest):

- parameters: 4 bytes (float32) for each of ``ModelConfig.parameter_floor()``; a training run adds its gradients (4)
  and AdamW's two moments (8), 16 bytes in all (what ``model.info`` counts), unless ``train.trainable`` /
  ``train.freeze`` leave parameters without them; sharded over every rank at best;
- activations: every activation checkpointing mode keeps each block's input until the backward: ``n_layers x micro
  x seq_len / (cp x tp) x d_model`` values of 2 bytes (bf16) or 4 (float32) on each rank; without ``full``
  recomputation a block also keeps its projections' outputs (q, k, v, the attention output, the MLP's input
  projections: ``block_width``), which ``none`` and ``selective`` both keep for the backward.

The memory of one rank is its CUDA device's (``total_memory``) when the run uses one, else this host's physical
memory; a CUDA run validated on a machine without CUDA (a login node) is checked against the formats' bounds only.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from core.errors import ConfigError
from run.parallel import check_world_size

if TYPE_CHECKING:
    from model.config import ModelConfig
    from run.config import RunConfig

GIB = 1 << 30


def host_memory() -> int | None:
    """This machine's physical memory in bytes (None where the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def rank_memory(device: str) -> tuple[int, str] | None:
    """(bytes, a label) of the memory one rank of a run on ``device`` (train.device) has here, or None when this
    machine cannot tell (a CUDA run validated without CUDA)."""
    import torch

    wants_cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    if wants_cuda:
        if not torch.cuda.is_available():
            return None
        named = torch.device(device).index if device.startswith("cuda") else None
        index = 0 if named is None or named >= torch.cuda.device_count() else named
        total = torch.cuda.get_device_properties(index).total_memory
        return total, f"{total / GIB:.1f} GiB of device memory"
    host = host_memory()
    return None if host is None else (host, f"{host / GIB:.1f} GiB of memory on this host")


def check_parameters_fit(model: ModelConfig, capacity: int, where: str) -> None:
    """The float32 parameters (``parameter_floor``) fit ``capacity`` bytes (``where`` says whose: one line)."""
    floor = model.parameter_floor()
    if 4 * floor > capacity:
        raise ConfigError(
            f"model: at least {floor:,} parameters ({model.n_layers:,} layers, d_model {model.d_model:,}, vocab "
            f"{model.vocab_size:,}) need {4 * floor / GIB:,.1f} GiB in float32, more than {where}"
        )


def training_bytes_per_parameter(cfg: RunConfig) -> int:
    """Bytes each parameter costs a training run at least: float32 weights, and unless freezing leaves some without
    them, float32 gradients and AdamW's two float32 moments."""
    frozen_some = bool(cfg.train.trainable or cfg.train.freeze)
    return 4 if frozen_some else 4 + 4 + 8


def block_width(model: ModelConfig, checkpointing: str) -> int:
    """Values per token one block keeps for the backward, at least: its input (every mode), and without ``full``
    recomputation its projections' outputs too (q, k, v, the attention output, the MLP's input projections)."""
    if checkpointing == "full":
        return model.d_model
    qkv = (model.n_heads + 2 * model.kv_heads) * model.head_dim
    mlp_in = (2 if model.family == "llama" else 1) * model.ffn_dim
    return model.d_model + qkv + model.d_model + mlp_in


def activation_floor(cfg: RunConfig, world: int) -> int:
    """Bytes of activations one rank keeps for the backward under the run's activation checkpointing mode."""
    par = cfg.train.parallel
    split = max(1, par.cp * par.tp)
    dp = max(1, world // split)
    micro = cfg.train.micro_batch_size or max(1, cfg.train.batch_size // dp)
    value = 4 if cfg.train.precision == "fp32" else 2
    width = block_width(cfg.model, cfg.train.activation_checkpointing)
    return cfg.model.n_layers * micro * (cfg.data.seq_len // split) * width * value


def check_fits(cfg: RunConfig, world: int, per_rank: int, label: str) -> None:
    """``cfg`` on ``world`` ranks of ``per_rank`` bytes each (``label``: what that memory is, for the message)."""
    check_world_size(world, "world size")
    check_parameters_fit(cfg.model, per_rank * world, f"{world:,} rank(s) x {label}")
    floor = cfg.model.parameter_floor()
    state = training_bytes_per_parameter(cfg) * floor / world  # sharded over every rank at best
    if state > per_rank:
        raise ConfigError(
            f"model: at least {floor:,} parameters ({cfg.model.n_layers:,} layers) need {state / GIB:,.1f} GiB per "
            f"rank for training ({training_bytes_per_parameter(cfg)} bytes each: weights, gradients, AdamW; sharded "
            f"over {world:,} rank(s) at best), more than {label}"
        )
    activations = activation_floor(cfg, world)
    if state + activations > per_rank:
        what = "weights, gradients and AdamW state" if training_bytes_per_parameter(cfg) > 4 else "weights"
        kept = "input" if cfg.train.activation_checkpointing == "full" else "input and projections' outputs"
        raise ConfigError(
            f"train.batch_size: one rank holds at least {(state + activations) / GIB:,.1f} GiB ({state / GIB:,.1f} "
            f"GiB of {what} for {floor:,} parameters, {activations / GIB:,.1f} GiB of activations: each of "
            f"{cfg.model.n_layers:,} blocks' {kept} for a micro-batch of {data_seq(cfg)}), more than {label}; "
            "lower train.micro_batch_size, data.seq_len or model.n_layers, or set train.activation_checkpointing"
        )


def data_seq(cfg: RunConfig) -> str:
    return f"{cfg.train.micro_batch_size or 'batch_size / ranks'} x {cfg.data.seq_len:,} tokens"


def check_machine(cfg: RunConfig, world: int) -> None:
    """``cfg`` on ``world`` ranks of this machine's kind (``rank_memory``): what ``pretrain.train`` checks before it
    builds anything, ``--dry-run`` included."""
    memory = rank_memory(cfg.train.device)
    if memory is not None:
        try:
            check_fits(cfg, world, *memory)
        except ConfigError as exc:
            if cfg.train.device != "auto" or "on this host" not in memory[1]:
                raise
            # train.device = auto on a host without CUDA (a login node) trains here: said, with the way out
            raise ConfigError(
                f"{exc} (train.device=auto trains on this host; a run meant for CUDA devices: --set train.device=cuda)"
            ) from None
