"""Float8 training (``train.float8``) through torchao: the blocks' linear layers compute their matmuls in float8.

``convert`` runs in the one parallelize recipe after the model is built and before TP, CP, activation checkpointing,
compile and the data-parallel wrap (``pretrain.engines.parallelize``). It swaps each eligible ``nn.Linear`` for
torchao's ``Float8Linear`` (a subclass with the same ``weight`` / ``bias`` parameters, so state-dict keys,
checkpoints and exports are unchanged: the weights stay in their high precision; only each matmul casts its
operands). What stays high precision, as torchtitan filters it, is named in one log line:

- the LM head (the fused head + cross-entropy reads its weight directly) and the embeddings (not linears);
- an attention variant's own linears (``*.attn.core.*``: a variant may read its weights directly, e.g. Focus's
  decoding fold), so each variant keeps its own arithmetic and only the projections change;
- any linear whose dimensions are not multiples of 16 (float8 tensor cores need them);
- the name patterns of ``train.float8_filter`` (fnmatch on module names, as ``train.freeze`` on parameters).

Composition: under FSDP2 the tensorwise recipe all-gathers the weights in float8 (``enable_fsdp_float8_all_gather``)
with their scales precomputed once per step after the optimizer (``precompute_scales``, called by the engine),
halving the all-gather bytes of the converted weights. Under TP the tensorwise recipe uses torchao's float8 parallel
styles (the inputs cast to float8 before their all-gather); the rowwise recipes use the plain styles (torchtitan's
choice: torchao's float8 styles assume tensorwise scales). DeepSpeed is refused (``run.engines``: the engines whose
spec declares ``float8``).

On a CUDA device below compute capability 8.9 (no float8 tensor cores) ``train.float8_emulate`` must be on (the
matmuls then run in high precision on the float8-rounded values: right numbers, no speed). CPU runs need no flag:
torch's CPU ``_scaled_mm`` computes float8 matmuls, which is how the tests run it.
"""

from __future__ import annotations

import logging
import re
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from core.errors import ConfigError, install_hint, missing_extra

if TYPE_CHECKING:
    from run.config import TrainConfig

MIN_CAPABILITY = (8, 9)  # float8 tensor cores: Ada (8.9), Hopper (9.0) and newer
ALIGN = 16  # float8 matmuls need both dimensions of a weight to be multiples of this


def torchao_float8() -> Any:
    """``torchao.float8``, or one line naming the extra. torchao's import logs a warning for each CUDA extension it
    cannot load (every CPU-only install): quiet for the import only."""
    # and torch's pytree one about an enum torchao registers
    quiet = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in quiet]
    for logger in quiet:
        logger.setLevel(logging.ERROR)
    try:
        import torchao.float8 as float8
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] == "torchao":
            raise missing_extra("torchao", "train.float8") from None
        raise
    finally:
        for logger, level in zip(quiet, levels):
            logger.setLevel(level)
    return float8


def recipe_config(cfg: TrainConfig, *, fsdp_all_gather: bool) -> Any:
    """torchao's ``Float8LinearConfig`` for ``train.float8`` (a recipe name), with emulation and, for the
    tensorwise recipe under FSDP2, the float8 all-gather."""
    float8 = torchao_float8()
    import torchao

    known = [r.value for r in float8.Float8LinearRecipeName]
    if cfg.float8 not in known:
        raise ConfigError(
            f"train.float8: the installed torchao {torchao.__version__} has no recipe {cfg.float8!r} (it has: "
            f"{', '.join(known)}); upgrade it ({install_hint('float8')}) or pick one of those"
        )
    base = float8.Float8LinearConfig.from_recipe_name(cfg.float8)
    changes = {"emulate": cfg.float8_emulate}
    if fsdp_all_gather and cfg.float8 == "tensorwise":
        changes["enable_fsdp_float8_all_gather"] = True
    from dataclasses import replace

    return replace(base, **changes)


def check_device(cfg: TrainConfig, device: torch.device) -> None:
    """A CUDA device without float8 tensor cores runs float8 only emulated (``train.float8_emulate``)."""
    if device.type != "cuda" or cfg.float8_emulate:
        return
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        raise ConfigError(
            f"train.float8: {cfg.float8!r} needs float8 tensor cores (CUDA compute capability "
            f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}+: Ada, Hopper and newer); {name} is "
            f"{capability[0]}.{capability[1]}: set train.float8_emulate = true (correct, not faster) or train.float8 "
            "= 'none'"
        )


def eligible(model: nn.Module, patterns: list[str]) -> tuple[list[str], dict[str, str]]:
    """(the linears that convert, {linear kept in high precision: why}) by module name."""
    names = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    for pattern in patterns:
        if not any(fnmatchcase(name, pattern) for name in names):
            raise ConfigError(
                f"train.float8_filter: pattern {pattern!r} matches no linear layer (names look like {names[0]!r})"
            )
    convert: list[str] = []
    kept: dict[str, str] = {}
    for name in names:
        module = model.get_submodule(name)
        assert isinstance(module, nn.Linear)
        out_features, in_features = module.weight.shape
        if name == "lm_head":
            kept[name] = "the LM head"
        elif not name.startswith("blocks."):
            kept[name] = "outside the blocks"
        elif ".attn.core." in name:
            kept[name] = "the attention variant's own"
        elif any(fnmatchcase(name, p) for p in patterns):
            kept[name] = "train.float8_filter"
        elif out_features % ALIGN or in_features % ALIGN:
            kept[name] = f"{out_features}x{in_features}, not multiples of {ALIGN}"
        else:
            convert.append(name)
    return convert, kept


def summary(recipe: str, convert: list[str], kept: dict[str, str], all_gather: bool) -> str:
    """One line: what converted and what stayed high precision (block indices folded: ``blocks.*.mlp.down x4``)."""

    def fold(names: list[str]) -> str:
        groups: dict[str, list[str]] = {}
        for name in names:
            groups.setdefault(re.sub(r"^blocks\.\d+\.", "blocks.*.", name), []).append(name)
        return ", ".join(group[0] if len(group) == 1 else f"{key} x{len(group)}" for key, group in groups.items())

    by_reason: dict[str, list[str]] = {}
    for name, why in kept.items():
        by_reason.setdefault(why, []).append(name)
    kept_text = "; ".join(f"{fold(names)} ({why})" for why, names in by_reason.items()) or "none"
    gather = ", float8 all-gather under FSDP2" if all_gather else ""
    return (
        f"float8 ({recipe}{gather}): {len(convert)} linear layers converted; kept in high precision with the "
        f"embeddings: {kept_text}"
    )


def convert(model: nn.Module, cfg: TrainConfig, device: torch.device, *, fsdp: bool) -> str:
    """Swap the eligible linears of ``model`` for torchao's ``Float8Linear`` in place (module docstring); returns the
    one log line naming what converted and what did not."""
    check_device(cfg, device)
    config = recipe_config(cfg, fsdp_all_gather=fsdp)
    names, kept = eligible(model, cfg.float8_filter)
    chosen = set(names)
    torchao_float8().convert_to_float8_training(model, config=config, module_filter_fn=lambda _, fqn: fqn in chosen)
    return summary(cfg.float8, names, kept, config.enable_fsdp_float8_all_gather)


def is_float8_linear(module: nn.Module) -> bool:
    """A converted linear (without importing torchao where nothing converted)."""
    return type(module).__name__ == "Float8Linear" and isinstance(module, nn.Linear)


def tensorwise(module: nn.Module) -> bool:
    """A linear converted with tensorwise scales: the one torchao's float8 TP styles serve."""
    if not is_float8_linear(module):
        return False
    config: Any = module.config
    granularity = config.cast_config_weight.scaling_granularity
    return bool(
        granularity.value == "tensorwise"
        and config.cast_config_input.scaling_granularity.value == "tensorwise"
        and config.cast_config_grad_output.scaling_granularity.value == "tensorwise"
    )


def uses_float8_all_gather(model: nn.Module) -> bool:
    configs: list[Any] = [m.config for m in model.modules() if is_float8_linear(m)]
    return any(c.enable_fsdp_float8_all_gather for c in configs)


def precompute_scales(model: nn.Module) -> None:
    """The float8 all-gather's weight scales, for all converted weights in one all-reduce: after every optimizer
    step and after weights are loaded (a resume), so each forward's all-gather casts with current scales."""
    torchao_float8().precompute_float8_dynamic_scale_for_fsdp(model)


def plain(tensor: Tensor) -> Tensor:
    """A weight as an ordinary tensor: the float8 all-gather wraps the high-precision weight in a tensor subclass
    (``WeightWithDynamicFloat8CastTensor``), which a safetensors file cannot hold."""
    inner = getattr(tensor, "_tensor", None)
    if isinstance(inner, Tensor) and type(tensor).__name__ == "WeightWithDynamicFloat8CastTensor":
        return inner.detach()
    return tensor


def plain_state(state: dict[str, Tensor]) -> dict[str, Tensor]:
    return {key: plain(value) for key, value in state.items()}


def plain_tree(state: Any) -> Any:
    """``state`` (a model or optimizer state dict for DCP, nested dicts and lists) with every float8 weight wrapper
    unwrapped, a DTensor's local one included, so the checkpoint's shards hold ordinary tensors that any run (float8
    or not) and the restricted unpickler read. Loading needs no counterpart: DCP copies into the wrapper in place."""
    from torch.distributed.tensor import DTensor

    if isinstance(state, dict):
        return {key: plain_tree(value) for key, value in state.items()}
    if isinstance(state, list):
        return [plain_tree(value) for value in state]
    if isinstance(state, DTensor):
        local = state._local_tensor
        inner = plain(local)
        if inner is local:
            return state
        return DTensor.from_local(
            inner, state.device_mesh, state.placements, run_check=False, shape=state.shape, stride=state.stride()
        )
    if isinstance(state, Tensor):
        return plain(state)
    return state


def tp_styles(module: nn.Module, kind: str) -> Any:
    """torchao's float8 parallel style class for ``kind`` ("colwise" / "rowwise") of a tensorwise float8 linear, or
    None (the plain style applies)."""
    if not tensorwise(module):
        return None
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    return Float8ColwiseParallel if kind == "colwise" else Float8RowwiseParallel


def prepare_input_style(**kwargs: Any) -> Any:
    """torchao's ``PrepareFloat8ModuleInput``: a module's input cast to float8 before its all-gather (the MLP, whose
    input only its float8 linears read)."""
    from torchao.float8.float8_tensor_parallel import PrepareFloat8ModuleInput

    return PrepareFloat8ModuleInput(**kwargs)
