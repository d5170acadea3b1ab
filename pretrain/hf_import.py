"""``python -m pretrain.hf_import --hf PATH --out RUN_DIR [--config BASE.toml] [--set key=value ...] [--no-start]``

Starts a run from a local Hugging Face ``transformers`` checkpoint (``GPT2LMHeadModel``, ``LlamaForCausalLM``,
``MistralForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``; safetensors, or ``pytorch_model.bin``
read with ``weights_only=True``) and its tokenizer (the folder's ``tokenizer.json`` or ``tokenizer.model``,
or ``--tokenizer``). Nothing is downloaded. What it writes:

- ``RUN_DIR/hf_import/``: the weights mapped onto a matching model config (model/hf.py) as a checkpoint
  directory (``model.safetensors``, ``trainer.pt`` at step 0, the tokenizer files, ``hf_config.json``: the
  source's config.json);
- ``RUN_DIR/config.toml``: ``--config`` (default: the built-in defaults) with the model's shape from the
  source's config.json (whatever preset ``--config`` names) and ``--config``'s own attention table and
  dropout (run/hf_init.py: a Focus retrofit stays Focus), ``data.tokenizer`` and ``train.init_from`` set to
  ``RUN_DIR/hf_import``, ``run.dir = RUN_DIR``, ``data.seq_len`` capped at the model's length, then
  ``--set`` overrides;
- ``RUN_DIR/checkpoints/step_00000000/``: the run started at step 0 by the trainer itself (it builds the
  data, loads ``train.init_from``, saves), so ``python -m pretrain.train --config RUN_DIR/config.toml``
  continues it and ``python -m eval.run --run RUN_DIR`` evaluates it. ``--no-start`` skips this (large
  models, or when the data is not at hand yet); ``pretrain.train`` then starts from ``train.init_from`` and
  ``eval.run --checkpoint RUN_DIR/hf_import`` evaluates the import.

An unsupported architecture or option, weights that do not fit (the first tensors and their two shapes) or
a ``train.trainable`` pattern the model does not have stop with one line, before anything is written; a
start that fails later takes back what the import wrote. ``train.init_from = "hf:PATH"`` in a run config
does the same mapping at the start of training, without the intermediate ``hf_import/`` copy.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from core import configlib
from core.errors import ConfigError, OneLineParser, cli_errors
from core.files import atomic_directory, plain_mode

if TYPE_CHECKING:
    from model.config import ModelConfig
    from run.config import RunConfig

IMPORT_DIR = "hf_import"


def _say(line: str) -> None:
    print(line, flush=True)


def run_config(
    model_cfg: ModelConfig,
    run_dir: Path,
    import_dir: Path,
    *,
    base_config: str | None = None,
    overrides: Sequence[str] = (),
    tokenizer_now: str | Path | None = None,
) -> RunConfig:
    """The run's config: ``base_config`` (or the defaults) with the imported model's shape and the base's own
    choices (its attention table, dropout: run/hf_init.py), the import as tokenizer and initial weights,
    ``data.seq_len`` capped at the model's length, then ``overrides``. ``tokenizer_now``: validate with this
    tokenizer in place of the import's, which is not written yet."""
    from run.config import raw_run_config, run_config_from_dict
    from run.hf_init import merged_model_table

    data = raw_run_config(base_config)
    table = data.get("model", {})
    data["model"] = merged_model_table(table if isinstance(table, dict) else {}, model_cfg)
    for section in ("run", "data", "train"):
        if not isinstance(data.setdefault(section, {}), dict):
            raise ConfigError(f"{section}: must be a table, got {data[section]!r}")
    data["run"]["dir"] = str(run_dir)
    data["data"]["tokenizer"] = str(import_dir)
    data["train"]["init_from"] = str(import_dir)
    data["data"]["seq_len"] = min(run_config_from_dict(data).data.seq_len, model_cfg.max_seq_len)
    for assignment in overrides:
        configlib.apply_override(data, assignment)
    cfg = run_config_from_dict(data)
    if tokenizer_now is None:
        cfg.validate()
    else:
        dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tokenizer=str(tokenizer_now))).validate()
    return cfg


def _check_fits(cfg: RunConfig, state: dict[str, torch.Tensor], where: str) -> None:
    """What the start would find, found before anything is written: the run's model (with its attention
    variant) takes the imported weights, and every ``train.freeze`` / ``train.trainable`` pattern names
    one of its parameters."""
    from model.transformer import build_model
    from pretrain.freezing import check_patterns
    from run.hf_init import load_state

    model = build_model(cfg.model)
    load_state(model, state, where=where, key="--hf")
    check_patterns(model, cfg.train)


def _remove_new(run_dir: Path, before: set[str] | None) -> None:
    """Undo a failed import: what it added to ``run_dir`` (all of it when the import made the directory)."""
    if before is None:
        shutil.rmtree(run_dir, ignore_errors=True)
        return
    for entry in run_dir.iterdir() if run_dir.is_dir() else ():
        if entry.name not in before:
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)


def import_hf(
    hf_path: str | Path,
    run_dir: str | Path,
    *,
    base_config: str | None = None,
    overrides: Sequence[str] = (),
    tokenizer: str | Path | None = None,
    start: bool = True,
    log: Callable[[str], None] = _say,
) -> Path:
    """Import ``hf_path`` into ``run_dir`` (see the module docstring); returns the checkpoint directory a
    user evaluates: ``checkpoints/step_00000000`` when started, else ``hf_import``. Everything that can fail
    on bad input is checked before ``run_dir`` is written; a start that fails anyway takes back what the
    import wrote, so the same command can run again."""
    hf_path, run_dir = Path(hf_path), Path(run_dir)
    import_dir = run_dir / IMPORT_DIR
    for taken in (import_dir, run_dir / "checkpoints"):
        if taken.exists():
            raise ConfigError(f"--out: {run_dir} already holds {taken.name}/; import into a new directory")
    before = {entry.name for entry in run_dir.iterdir()} if run_dir.is_dir() else None
    try:
        return _import(hf_path, run_dir, import_dir, base_config, overrides, tokenizer, start, log)
    except BaseException:
        _remove_new(run_dir, before)
        raise


def _import(
    hf_path: Path,
    run_dir: Path,
    import_dir: Path,
    base_config: str | None,
    overrides: Sequence[str],
    tokenizer: str | Path | None,
    start: bool,
    log: Callable[[str], None],
) -> Path:
    from safetensors.torch import save_model

    from data.tokenizer import load_tokenizer
    from model import hf
    from model.transformer import build_model
    from pretrain.checkpoint import write_manifest
    from run.hf_init import load_state
    from run.sizes import check_parameters_fit, host_memory

    source = hf.load_hf_config(hf_path)
    imported = hf.model_config_from_hf(source, str(hf_path / "config.json"))
    cfg_model = imported.model
    for note in imported.notes:
        log(f"note: {note}")
    memory = host_memory()  # the import maps and builds the model in float32 on this host
    if memory is not None:
        check_parameters_fit(cfg_model, memory, f"this host's {memory / 2**30:.1f} GiB (--hf is imported here)")
    try:
        tok = load_tokenizer(tokenizer if tokenizer is not None else hf_path)
    except ConfigError as exc:
        raise ConfigError(f"{exc} (pass --tokenizer if the model's tokenizer lives elsewhere)") from None
    if tok.vocab_size > cfg_model.vocab_size:
        raise ConfigError(
            f"--tokenizer: {tok.vocab_size} tokens do not fit the model's vocab_size={cfg_model.vocab_size}"
        )
    state = hf.from_hf_state_dict(hf.cast(hf.load_hf_weights(hf_path), torch.float32), cfg_model, imported.architecture)
    model = build_model(cfg_model)
    load_state(model, state, where=str(hf_path), key="--hf", new_attention_ok=False)
    cfg = run_config(
        cfg_model, run_dir, import_dir, base_config=base_config, overrides=overrides, tokenizer_now=tok.path
    )
    _check_fits(cfg, state, str(hf_path))
    if cfg.model.attention.kind != cfg_model.attention.kind:
        log(f"note: attention {cfg.model.attention.kind!r} from the config; its own parameters start at their init")
    # the import itself is the source model as it is (its own attention), so that it evaluates and compares as such
    import_cfg = dataclasses.replace(cfg, model=cfg_model)

    with atomic_directory(import_dir) as tmp:  # run_dir made too
        save_model(model, str(tmp / "model.safetensors"))
        plain_mode(tmp / "model.safetensors")
        tok.save(tmp)
        shutil.copyfile(hf_path / "config.json", tmp / "hf_config.json")
        fingerprint = load_tokenizer(tmp).fingerprint  # what the run will load as data.tokenizer
        trainer_state = {
            "step": 0,
            "tokens": 0,
            "config": import_cfg.to_toml(),
            "tokenizer_fingerprint": fingerprint,
            "data_fingerprint": "",
            "code_version": "hf_import",
            "source": str(hf_path.resolve()),
        }
        torch.save(trainer_state, tmp / "trainer.pt")
        meta = {"step": 0, "time": time.time(), "source": str(hf_path.resolve()), "architecture": imported.architecture}
        write_manifest(tmp, meta)  # last: the checksums of every file above
    (run_dir / "config.toml").write_text(cfg.to_toml())
    n_params = sum(p.numel() for p in model.parameters())
    log(f"imported {hf_path} ({imported.architecture}, {n_params:,} parameters) -> {import_dir}")
    del model, state
    if not start:
        log(f"run config: {run_dir / 'config.toml'} (python -m pretrain.train --config {run_dir / 'config.toml'})")
        return import_dir
    from pretrain.loop import Trainer

    trainer = Trainer(cfg)
    trainer.setup()
    path = trainer.save()
    trainer.loggers.close()
    trainer.engine.close()
    if path is None:  # the imported weights are not finite: no step 0 was written
        raise ConfigError(f"--hf: {hf_path}: {trainer.error}")
    log(f"run started at step 0: {path}; continue with python -m pretrain.train --config {run_dir / 'config.toml'}")
    return path


@cli_errors
def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(
        prog="python -m pretrain.hf_import",
        description=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--hf", required=True, help="local Hugging Face model directory (config.json + weights)")
    p.add_argument("--out", required=True, help="run directory to create")
    p.add_argument("--config", help="base TOML run config (data, train, ... settings); the model comes from --hf")
    configlib.add_set_argument(p, "dotted config override, repeatable (train.max_steps=100)")
    p.add_argument("--tokenizer", help="tokenizer file or folder, if not in the --hf directory")
    p.add_argument("--no-start", action="store_true", help="write the import and config.toml only (no step 0)")
    args = p.parse_args(argv)
    import_hf(
        args.hf,
        args.out,
        base_config=args.config,
        overrides=args.overrides,
        tokenizer=args.tokenizer,
        start=not args.no_start,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
