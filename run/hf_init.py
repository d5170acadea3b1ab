"""A run started from a local Hugging Face model directory: ``train.init_from = "hf:PATH"`` and
``python -m pretrain.hf_import``.

The model's *shape* (family, sizes, norms, RoPE, biases, vocabulary) comes from the folder's ``config.json``;
what the run config *chooses* (the attention variant's table, dropout) stays the config's, so a Focus
retrofit keeps ``kind = "focus"`` whatever shape the source has. A config that names no attention variant
(the default, full attention) takes the folder's own (a focused export's ``focused_attention``). The
folder's weights are mapped with model/hf; a variant's own parameters (``*.core.*``) the source lacks keep
their initialisation, anything else that does not fit is one ``ConfigError`` line naming the first
parameters and their two shapes. Nothing is downloaded: PATH is a local directory in the hub's layout.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from core import configlib
from core.errors import ConfigError

if TYPE_CHECKING:
    import torch
    from torch import nn

    from model.config import ModelConfig

HF_PREFIX = "hf:"
KEPT_MODEL_KEYS = ("attention", "dropout")  # what the run config chooses over the source's config.json


def hf_source(init_from: str) -> Path | None:
    """``hf:PATH`` -> PATH (user-expanded); anything else -> None."""
    if not init_from.startswith(HF_PREFIX):
        return None
    path = init_from[len(HF_PREFIX) :].strip()
    if not path:
        raise ConfigError("train.init_from: 'hf:' names no directory (hf:PATH, a local Hugging Face model folder)")
    return Path(path).expanduser()


def merged_model_table(table: dict[str, Any], imported: ModelConfig) -> dict[str, Any]:
    """The run config's raw ``[model]`` table -> the source's shape with the table's own choices
    (``KEPT_MODEL_KEYS``) on top. ``table`` is the TOML as written (plus ``--set``): a key it leaves out is
    not a choice, so a table without ``attention`` keeps the source's variant."""
    merged = configlib.to_dict(imported)  # every key, resolved
    merged["preset"] = ""  # the shape is the source's, whatever preset the config named
    for key in KEPT_MODEL_KEYS:
        if key in table:
            merged[key] = table[key]
    return merged


def imported_config(path: Path, key: str) -> tuple[ModelConfig, str]:
    """The source folder's config.json -> (its ModelConfig, its architecture); errors name ``key``."""
    from model import hf

    if not path.is_dir():
        raise ConfigError(f"{key}: no such directory {str(path)!r} (hf:PATH names a local Hugging Face model folder)")
    try:
        imported = hf.model_config_from_hf(hf.load_hf_config(path), str(path / "config.json"))
        hf.check_hf_indexes(path)
    except ConfigError as exc:
        raise ConfigError(f"{key}: {str(exc).removeprefix('--hf: ')}") from None
    return imported.model, imported.architecture


def apply_hf_init(data: dict[str, Any]) -> None:
    """A raw run-config dict whose ``train.init_from`` is ``hf:PATH``: its model table becomes the source's
    shape (``merged_model_table``) and an unset ``data.tokenizer`` the folder's tokenizer. Other dicts are
    left alone."""
    train = data.get("train")
    init_from = train.get("init_from", "") if isinstance(train, dict) else ""
    path = hf_source(init_from) if isinstance(init_from, str) else None
    if path is None:
        return
    imported, _ = imported_config(path, "train.init_from")
    table = data.get("model", {})
    data["model"] = merged_model_table(table if isinstance(table, dict) else {}, imported)
    data_table = data.setdefault("data", {})
    if isinstance(data_table, dict) and not data_table.get("tokenizer"):
        data_table["tokenizer"] = str(path)


def mapped_state(path: Path, key: str = "train.init_from") -> tuple[dict[str, torch.Tensor], ModelConfig, str]:
    """The folder's weights in this project's names, float32: (state dict, its ModelConfig, architecture)."""
    import torch

    from model import hf

    cfg, arch = imported_config(path, key)
    state = hf.from_hf_state_dict(hf.cast(hf.load_hf_weights(path), torch.float32), cfg, arch)
    return state, cfg, arch


def shape_mismatches(shapes: dict[str, tuple[int, ...]], model: nn.Module) -> list[str]:
    """``name: [a] there, [b] here`` for every tensor of ``shapes`` the model holds with another shape."""
    own = model.state_dict()
    return [
        f"{name} is {list(shape)} there, {list(own[name].shape)} here"
        for name, shape in shapes.items()
        if name in own and tuple(own[name].shape) != tuple(shape)
    ]


def fit_line(where: str, problems: list[str], key: str, fields: str = "") -> str:
    """One line: the first two mismatched tensors (and how many more), then which config fields differ."""
    more = f" (and {len(problems) - 2} more)" if len(problems) > 2 else ""
    why = f"; {fields}" if fields else ""
    return f"{key}: the weights in {where} do not fit this model config: {'; '.join(problems[:2])}{more}{why}"


def load_state(
    model: nn.Module, state: dict[str, torch.Tensor], *, where: str, key: str, new_attention_ok: bool = True
) -> None:
    """``state`` into ``model`` (strict but for a variant's own ``*.core.*`` parameters with
    ``new_attention_ok``); a misfit is one ConfigError line."""
    problems = shape_mismatches({k: tuple(v.shape) for k, v in state.items()}, model)
    if problems:
        raise ConfigError(fit_line(where, problems, key))
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [name for name in missing if not (new_attention_ok and ".core." in name)]
    if missing or unexpected:
        detail = f"missing {', '.join(missing[:3])}" if missing else f"unexpected {', '.join(unexpected[:3])}"
        raise ConfigError(f"{key}: the weights in {where} do not fit this model config ({detail})")
