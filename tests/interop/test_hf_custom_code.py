"""Focused exports as transformers custom code (model/hf/custom_code.py): the folder runs the project's own
Transformer, copied into it, through ``AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)`` in a
fresh process that cannot import this project; stock classes refuse it."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.interop.conftest import SMALL, VOCAB, our_checkpoint

transformers = pytest.importorskip("transformers")

T = 512  # beyond every variant's window
NEW = 32
# what the fresh process runs: no repository on its path, offline, cwd elsewhere
LOADER = """
import json, sys, torch, transformers
out = sys.argv[1]
ids = torch.load(sys.argv[2], weights_only=True)
try:
    transformers.AutoModelForCausalLM.from_pretrained(out)
except ValueError as exc:
    refused = "trust_remote_code" in str(exc)
else:
    refused = False
try:
    transformers.LlamaForCausalLM.from_pretrained(out)
except Exception:
    stock_fails = True
else:
    stock_fails = False
model = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
import_ok = not any(m.split(".")[0] in {"model", "core", "pretrain"} for m in sys.modules)
with torch.no_grad():
    logits = model(ids).logits
    tokens = model.generate(ids[:, :16], do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=0)
torch.save({"logits": logits, "tokens": tokens}, sys.argv[3])
print("REPORT", json.dumps({"refused": refused, "stock_fails": stock_fails, "class": type(model).__name__,
                  "import_ok": import_ok}))
""".replace("NEW_TOKENS", str(NEW))


def trainable_variants() -> list[str]:
    from model.attention import registry

    return sorted(name for name, entry in registry.items() if name != "full" and entry.cls.trainable)


def _export(tmp_path: Path, sp_model: Path, kind: str, family: str = "llama") -> tuple[Path, Path]:
    from pretrain.export import export_hf

    model = SMALL | dict(family=family, max_seq_len=T + NEW, attention={"kind": kind})
    path = our_checkpoint(tmp_path / "run", model, sp_model)
    lines: list[str] = []
    out = export_hf(path, tmp_path / "hf", allow_variant=True, log=lines.append)
    load = [line for line in lines if "trust_remote_code=True" in line]
    assert len(load) == 1 and "AutoModelForCausalLM.from_pretrained" in load[0], lines
    return path, out


@pytest.mark.slow  # an export and two refused loads through transformers: ~20 s
def test_bundle_is_self_contained_and_the_config_names_custom_code(tmp_path, sp_model):
    from model.hf.custom_code import FIRST_PARTY, bundle_sources

    files = bundle_sources()
    assert "fp_model_transformer.py" in files and "fp_model_attention_common_reference.py" in files
    for name, text in files.items():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and not node.level:
                assert (node.module or "").split(".")[0] not in FIRST_PARTY, (name, node.module)
    _, out = _export(tmp_path, sp_model, "focal")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["FocusedLlamaForCausalLM"] and config["model_type"] == "focused_llama"
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_focused.FocusedLlamaForCausalLM"
    assert not (out / "model.safetensors").exists() and (out / "focused_model.safetensors").is_file()
    with pytest.raises(ValueError, match="trust_remote_code"):
        transformers.AutoModelForCausalLM.from_pretrained(out)
    with pytest.raises(OSError):  # a stock class finds no weights it knows: never a silent full-attention load
        transformers.LlamaForCausalLM.from_pretrained(out)


@pytest.mark.slow
@pytest.mark.parametrize("kind", trainable_variants())
def test_custom_code_matches_the_project_in_a_fresh_process(tmp_path, sp_model, kind):
    from run.checkpoint import load_model

    path, out = _export(tmp_path, sp_model, kind)
    ids = torch.randint(0, VOCAB, (1, T), generator=torch.Generator().manual_seed(5))
    torch.save(ids, tmp_path / "ids.pt")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"HF_HUB_OFFLINE": "1"}
    env["HF_MODULES_CACHE"] = str(tmp_path / "modules")
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    done = subprocess.run(
        [sys.executable, "-c", LOADER, str(out), str(tmp_path / "ids.pt"), str(tmp_path / "res.pt")],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        stdin=subprocess.DEVNULL,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.split("REPORT ", 1)[1])
    assert report == {"refused": True, "stock_fails": True, "class": "FocusedLlamaForCausalLM", "import_ok": True}
    theirs = torch.load(tmp_path / "res.pt", weights_only=True)
    ours, _ = load_model(path)
    with torch.no_grad():
        logits = ours(ids).logits
        tokens = ours.generate(ids[:, :16], NEW)
    assert float((theirs["logits"] - logits).abs().max()) <= 1e-4
    assert theirs["tokens"].tolist() == tokens.tolist()
