"""Retrofits from any Hugging Face model (docs/retrofit.md, run/hf_init.py): ``train.init_from = "hf:PATH"`` and
``pretrain.hf_import --config`` take the model's shape from the folder's config.json and keep the config's
attention table; a misfit is one line naming the tensors and their shapes; a failed import leaves nothing
behind. Every HF model here is made locally (``save_pretrained`` into tmp_path); nothing is downloaded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from itertools import islice
from pathlib import Path

import pytest
import torch

from core.errors import ConfigError
from tests.conftest import REPO
from tests.interop.conftest import SMALL, VOCAB, our_checkpoint, randomise

transformers = pytest.importorskip("transformers")

FOCUS = REPO / "launch" / "configs" / "tiny_retrofit_focus.toml"
SEQ = 64


def save_hf(folder: Path, tokenizer: Path, cfg: object, seed: int = 0) -> torch.nn.Module:
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    randomise(model, seed)
    model.eval().save_pretrained(folder)
    (folder / tokenizer.name).write_bytes(tokenizer.read_bytes())
    return model


def llama_config(**shape: int) -> object:
    values = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4) | shape
    return transformers.LlamaConfig(
        vocab_size=VOCAB,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        **values,
    )


@pytest.fixture(scope="module")
def text_file(tmp_path_factory) -> Path:
    from data.embedded import iter_embedded

    path = tmp_path_factory.mktemp("text") / "domain.txt"
    path.write_text("\n".join(d.text[:40_000] for d in islice(iter_embedded(), 3)), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def llama_256(tmp_path_factory, sp_model) -> tuple[Path, torch.nn.Module]:
    """The must-hold shape: hidden_size=256, num_hidden_layers=4."""
    folder = tmp_path_factory.mktemp("llama256")
    return folder, save_hf(folder, sp_model, llama_config(hidden_size=256, intermediate_size=688, num_hidden_layers=4))


def recipe_args(run_dir: Path, hf_dir: Path, text: Path, cache_dir: Path) -> list[str]:
    """The recipe's Focus config, any HF folder standing in for the base, shrunk to seconds. The window covers
    the whole sequence, so that at step 1 (Focus parameters at their init) the model is the HF model's."""
    values = {
        "run.dir": f'"{run_dir}"',
        "train.init_from": f'"hf:{hf_dir}"',
        "data.path": f'"{text}"',
        "data.cache_dir": f'"{cache_dir}"',
        "data.seq_len": SEQ,
        "model.attention.focus.window": SEQ,
        "train.batch_size": 4,
        "train.max_steps": 2,
        "train.warmup_steps": 1,
        "train.log_every": 1,
        "eval.batches": 1,
        "eval.sample_tokens": 0,
        "log.console": "false",
    }
    return ["--config", str(FOCUS), *[a for k, v in values.items() for a in ("--set", f"{k}={v}")]]


@pytest.mark.slow
def test_recipe_from_a_256_wide_llama(llama_256, tmp_path, text_file, cache_dir):
    """docs/retrofit.md step 4 with a locally made LLaMA (hidden 256, 4 layers) for the base: step-1 loss is the
    HF model's on the same batch (1e-5 relative) and every frozen tensor ends bitwise as the HF folder has it."""
    from pretrain.loop import Trainer
    from run.checkpoint import MODEL_FILE, latest_checkpoint
    from run.config import load_run_config
    from run.hf_init import mapped_state

    hf_dir, theirs = llama_256
    run = tmp_path / "focus"
    args = recipe_args(run, hf_dir, text_file, cache_dir)
    proc = subprocess.run(
        [sys.executable, "-m", "pretrain.train", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    step1 = next(r["loss"] for r in lines if r.get("step") == 1 and "loss" in r)

    # the same batch: the same config's loader, in a scratch run directory
    overrides = [a for a in args[2:] if a != "--set"]
    cfg = load_run_config(FOCUS, [*overrides, f'run.dir="{tmp_path / "probe"}"'])
    assert cfg.model.attention.kind == "focus" and (cfg.model.d_model, cfg.model.n_layers) == (256, 4)
    probe = Trainer(cfg)
    probe.setup()
    batch = torch.cat(probe.loader.next_step())
    probe.release_run_dir()
    probe.loggers.close()
    with torch.no_grad():
        logits = theirs(batch[:, :-1]).logits.float()
    hf_loss = float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()))
    assert abs(step1 - hf_loss) <= 1e-5 * hf_loss, (step1, hf_loss)

    from safetensors.torch import load_file

    final = load_file(str(latest_checkpoint(run) / MODEL_FILE))
    source, _, _ = mapped_state(hf_dir)
    assert sorted(k for k in final if ".core." not in k) == sorted(source)
    for name, tensor in source.items():
        assert torch.equal(final[name].view(torch.int32), tensor.view(torch.int32)), f"{name} moved"
    assert any(".core." in k for k in final)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_import_keeps_the_configs_attention_and_takes_the_shape(kind, tmp_path, sp_model, text_file):
    """hf_import --config tiny_retrofit_focus.toml from a non-tiny model: Focus stays, the shape is the source's."""
    from pretrain.hf_import import import_hf
    from run.config import load_run_config

    if kind == "gpt2":
        cfg = transformers.GPT2Config(
            vocab_size=VOCAB, n_embd=96, n_layer=3, n_head=4, n_positions=256, bos_token_id=None, eos_token_id=None
        )
    else:
        cfg = llama_config(hidden_size=96, num_hidden_layers=3, num_attention_heads=4)
    save_hf(tmp_path / "hf", sp_model, cfg)
    out = import_hf(
        tmp_path / "hf",
        tmp_path / "run",
        base_config=str(FOCUS),
        overrides=[f'data.path="{text_file}"'],
        start=False,
        log=lambda line: None,
    )
    assert out == tmp_path / "run" / "hf_import"
    run_cfg = load_run_config(tmp_path / "run" / "config.toml", validate=False)
    model = run_cfg.model
    assert model.attention.kind == "focus" and model.attention.options["focus"].window == 32
    assert (model.family, model.d_model, model.n_layers) == ("gpt2" if kind == "gpt2" else "llama", 96, 3)
    assert run_cfg.train.trainable == ["*.core.*"] and run_cfg.train.init_from == str(out)
    assert run_cfg.data.tokenizer == str(out)
    # the import itself is the source model as it is: full attention, evaluable and comparable as such
    from run.checkpoint import load_model

    imported, imported_cfg = load_model(out)
    assert imported_cfg.model.attention.kind == "full"


def test_a_failed_import_leaves_nothing(tmp_path, sp_model, monkeypatch):
    from pretrain.hf_import import import_hf
    from pretrain.loop import Trainer

    save_hf(tmp_path / "hf", sp_model, llama_config())
    run = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"train.trainable: pattern '\*.nothing.\*' matches no parameter"):
        import_hf(tmp_path / "hf", run, overrides=['train.trainable=["*.nothing.*"]'], start=False, log=print)
    assert not run.exists()
    run.mkdir()
    (run / "notes.txt").write_text("mine")

    def fail(self: Trainer) -> None:
        raise ConfigError("data: the start failed")

    monkeypatch.setattr(Trainer, "setup", fail)
    with pytest.raises(ConfigError, match="the start failed"):  # the import takes back what it wrote
        import_hf(tmp_path / "hf", run, log=print)
    assert sorted(p.name for p in run.iterdir()) == ["notes.txt"]


def test_misfits_are_one_line_naming_tensors_and_fields(tmp_path, sp_model):
    from model.transformer import build_model
    from run.checkpoint import load_weights, resolve_checkpoint
    from run.config import load_run_config

    checkpoint = our_checkpoint(tmp_path / "ours", SMALL, sp_model)
    wider = load_run_config(
        None, ['model.preset=""', *[f"model.{k}={v}" for k, v in SMALL.items()], "model.d_model=128"], validate=False
    )
    with pytest.raises(ConfigError) as info:
        load_weights(build_model(wider.model), checkpoint)
    line = str(info.value)
    assert "\n" not in line and "blocks.0.attn.wo.weight is [64, 64] there, [128, 128] here" in line
    assert "model.d_model = 64 there, 128 here" in line

    hf_dir = tmp_path / "hf"
    save_hf(hf_dir, sp_model, llama_config())
    with pytest.raises(
        ConfigError, match=rf"train.init_from: {hf_dir} is a Hugging Face model directory.*'hf:{hf_dir}'"
    ):
        resolve_checkpoint(hf_dir, key="train.init_from")
    with pytest.raises(ConfigError, match="train.init_from: no such directory"):
        load_run_config(None, [f'train.init_from="hf:{tmp_path / "absent"}"'])
