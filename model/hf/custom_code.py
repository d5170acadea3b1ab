"""The custom-code folder of a focused export: transformers runs the project's own model code.

A model whose attention transformers lacks is exported the Hub way (``trust_remote_code=True``):
``configuration_focused.py`` and ``modeling_focused.py`` beside the weights, named by ``auto_map`` in
config.json. The attention math keeps one source: the modeling file is a thin ``PreTrainedModel`` around
the project's ``Transformer``, and that Transformer, its attention variants, RoPE, config and the HF
tensor mapping are copied here from this repository at export time, flattened to ``fp_<dotted path>.py``
with their first-party imports rewritten to relative ones (transformers copies a model file's relative
imports, not packages). ``bundle_sources`` refuses any import it cannot rewrite, so the folder needs
nothing of this project installed.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

from core.errors import ConfigError

ROOTS = ("model.transformer", "model.config", "model.hf.configs", "model.hf.tensors")  # what the wrapper imports
FIRST_PARTY = ("core", "model", "data", "run", "eval", "pretrain", "launch", "bench")
# third-party packages a transformers install has; a nested import of anything else is wrapped in try/raise
# so that transformers' import check (which skips try blocks) does not demand an optional package
PROVIDED = frozenset({"torch", "safetensors", "huggingface_hub", "transformers", "numpy"}) | sys.stdlib_module_names
CONFIG_FILE, MODELING_FILE = "configuration_focused.py", "modeling_focused.py"
REPO = Path(__file__).resolve().parents[2]


def flat_name(module: str) -> str:
    return "fp_" + module.replace(".", "_")


def _source_file(module: str) -> Path | None:
    path = REPO.joinpath(*module.split("."))
    for file in (path.with_suffix(".py"), path / "__init__.py"):
        if file.is_file():
            return file
    return None


def _is_module(module: str) -> bool:
    return _source_file(module) is not None


def _rewrite(module: str, text: str) -> tuple[str, set[str]]:
    """``text`` with first-party imports made relative to the flat folder; returns (text, modules imported)."""
    lines = text.splitlines(keepends=True)
    needed: set[str] = set()
    edits: list[tuple[int, int, str]] = []  # (first line, last line, replacement), 0-based inclusive
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                top = alias.name.split(".")[0]
                if top in FIRST_PARTY:
                    raise ConfigError(
                        f"custom code: {module} line {node.lineno}: 'import {alias.name}' cannot be bundled"
                    )
                if top not in PROVIDED and node.col_offset == 0:
                    raise ConfigError(
                        f"custom code: {module} imports {alias.name} at top level (not a transformers dependency)"
                    )
            continue
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            raise ConfigError(f"custom code: {module} line {node.lineno}: relative import cannot be bundled")
        source = node.module or ""
        top = source.split(".")[0]
        first, last = node.lineno - 1, (node.end_lineno or node.lineno) - 1
        indent = lines[first][: node.col_offset]
        if top not in FIRST_PARTY:
            if top not in PROVIDED:
                if node.col_offset == 0:
                    raise ConfigError(
                        f"custom code: {module} imports {source} at top level (not a transformers dependency)"
                    )
                body = "".join(lines[first : last + 1])
                inner = "".join("    " + line if line.strip() else line for line in body.splitlines(keepends=True))
                edits.append((first, last, f"{indent}try:\n{inner}{indent}except ImportError:\n{indent}    raise\n"))
            continue
        submodules = [a for a in node.names if _is_module(f"{source}.{a.name}")]
        if submodules and len(submodules) != len(node.names):
            raise ConfigError(f"custom code: {module} line {node.lineno}: mixes modules and names in one import")
        if submodules:
            parts = []
            for alias in node.names:
                full = f"{source}.{alias.name}"
                needed.add(full)
                parts.append(f"{flat_name(full)} as {alias.asname or alias.name}")
            edits.append((first, last, f"{indent}from . import {', '.join(parts)}\n"))
        else:
            if not _is_module(source):
                raise ConfigError(f"custom code: {module} line {node.lineno}: no module {source}")
            needed.add(source)
            head = lines[first]
            prefix = f"from {source} import"
            if not head[node.col_offset :].startswith(prefix):
                raise ConfigError(f"custom code: {module} line {node.lineno}: unexpected import layout")
            new = indent + f"from .{flat_name(source)} import" + head[node.col_offset + len(prefix) :]
            edits.append((first, last, new + "".join(lines[first + 1 : last + 1])))
    for first, last, new in sorted(edits, reverse=True):
        lines[first : last + 1] = [new]
    return "".join(lines), needed


def bundle_sources(roots: tuple[str, ...] = ROOTS) -> dict[str, str]:
    """flat file name -> rewritten source, for ``roots`` and every first-party module they import."""
    out: dict[str, str] = {}
    origin: dict[str, str] = {}
    todo = list(roots)
    while todo:
        module = todo.pop()
        name = flat_name(module) + ".py"
        if name in out:
            if origin[name] != module:
                raise ConfigError(f"custom code: {module} and {origin[name]} flatten to the same file {name}")
            continue
        file = _source_file(module)
        if file is None:
            raise ConfigError(f"custom code: no module {module}")
        text, needed = _rewrite(module, file.read_text())
        header = f"# Copied from focused-pretrain {file.relative_to(REPO)} at export, imports made relative.\n"
        out[name], origin[name] = header + text, module
        todo += sorted(needed)
        parent = module.rpartition(".")[0]
        if parent and _source_file(parent) is not None and _source_file(parent).name == "__init__.py":  # type: ignore[union-attr]  # checked just before
            todo.append(parent)  # Python runs a package's __init__ before its modules: keep that (registries)
    check_self_contained(out)
    return out


def check_self_contained(files: dict[str, str]) -> None:
    """Every relative import names a bundled file, and no import reaches this project."""
    for name, text in files.items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and node.level:
                targets = [node.module] if node.module else [a.name for a in node.names]
                for target in targets:
                    if f"{target}.py" not in files and target != "configuration_focused":
                        raise ConfigError(f"custom code: {name} imports .{target}, which is not bundled")
            elif isinstance(node, ast.ImportFrom | ast.Import):
                mods = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                for mod in mods:
                    if mod.split(".")[0] in FIRST_PARTY:
                        raise ConfigError(f"custom code: {name} still imports {mod}")


CONFIGURATION = '''"""Configuration of a focused-pretrain export (written by model/hf/custom_code.py)."""

from transformers import PretrainedConfig


class FocusedConfig(PretrainedConfig):
    model_type = {model_type!r}

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
'''

MODELING = '''"""A focused-pretrain model in transformers (trust_remote_code=True), written by model/hf/custom_code.py.

The network is the project's own ``Transformer`` (fp_model_transformer.py and the fp_*.py files it imports,
copied from the project at export), so the attention variant computes exactly what it computed in training.
Generation recomputes the whole prefix every step (no KV cache): exact, and slow for long outputs.
"""

import os

import torch
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_focused import FocusedConfig
from .fp_model_hf_configs import model_config_from_hf
from .fp_model_hf_tensors import cast, from_hf_state_dict, load_hf_weights
from .fp_model_transformer import Transformer


class FocusedForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = FocusedConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _no_split_modules = ["Block"]

    def __init__(self, config):
        super().__init__(config)
        imported = model_config_from_hf(config.to_dict())
        self.architecture = imported.architecture
        self.model = Transformer(imported.model)
        self.post_init()

    def _init_weights(self, module):
        pass  # Transformer initialises itself; weights come from the export

    def get_input_embeddings(self):
        return self.model.tok_emb

    def get_output_embeddings(self):
        return self.model.lm_head

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, config=None, **kwargs):
        """Builds the model and loads the export's weights through the project's own tensor mapping."""
        path = str(pretrained_model_name_or_path)
        if not os.path.isdir(path):
            from huggingface_hub import snapshot_download

            path = snapshot_download(path, revision=kwargs.get("revision"))
        if config is None:
            config = FocusedConfig.from_pretrained(path)
        model = cls(config)
        imported = model_config_from_hf(config.to_dict())
        state = from_hf_state_dict(cast(load_hf_weights(path), torch.float32), imported.model, imported.architecture)
        model.model.load_state_dict(state, strict=True)
        dtype = kwargs.get("dtype", kwargs.get("torch_dtype"))
        if dtype == "auto":
            dtype = getattr(config, "dtype", None) or "float32"
        if dtype is not None:
            model = model.to(getattr(torch, dtype) if isinstance(dtype, str) else dtype)
        device = kwargs.get("device_map")
        if isinstance(device, (str, torch.device)) and str(device) != "auto":
            model = model.to(device)
        return model.eval()

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, **kwargs):
        return {{"input_ids": input_ids, "attention_mask": attention_mask}}  # the whole prefix: no cache

    def forward(self, input_ids=None, attention_mask=None, labels=None, return_dict=None, **kwargs):
        if input_ids is None:
            raise ValueError("{arch}: input_ids is required (inputs_embeds is not supported)")
        if attention_mask is not None and not bool(attention_mask.bool().all()):
            raise ValueError("{arch}: padded batches are not supported (attention_mask has zeros)")
        logits = self.model(input_ids).logits
        loss = None
        if labels is not None:
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100
            )
        return CausalLMOutputWithPast(loss=loss, logits=logits)


class {arch}(FocusedForCausalLM):
    pass


def _bundled_files():  # never called: names every copied file so that transformers copies it too
{bundled}
'''


def write_custom_code(out: Path, config: dict) -> list[str]:
    """Writes the custom-code files into ``out`` and sets config.json's ``auto_map``; returns the files."""
    arch = config["architectures"][0]
    files = bundle_sources()
    bundled = "\n".join(f"    from .{name[:-3]} import __name__  # noqa: F401" for name in sorted(files))
    files[CONFIG_FILE] = CONFIGURATION.format(model_type=config["model_type"])
    files[MODELING_FILE] = MODELING.format(arch=arch, bundled=bundled)
    for name, text in files.items():
        (out / name).write_text(text)
    config["auto_map"] = {
        "AutoConfig": f"{CONFIG_FILE[:-3]}.FocusedConfig",
        "AutoModelForCausalLM": f"{MODELING_FILE[:-3]}.{arch}",
    }
    return [CONFIG_FILE, MODELING_FILE, *sorted(n for n in files if n.startswith("fp_"))]
