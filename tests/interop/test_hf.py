"""Hugging Face interop without downloads: tiny random ``transformers`` models built here, saved with
``save_pretrained``, imported (model/hf.py, pretrain/hf_import.py) and compared with the real
``from_pretrained`` on the export side (pretrain/export.py): logits in float32 (max |diff| <= 1e-5, same
argmax), greedy continuations, and HF -> ours -> HF tensors bitwise equal."""

from __future__ import annotations

import json
import os
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from core.errors import ConfigError
from tests.conftest import REPO
from tests.interop.conftest import SMALL, VOCAB, our_checkpoint, randomise

transformers = pytest.importorskip("transformers")

TOL = 1e-5
TEXT = (
    "When forty winters shall besiege thy brow, and dig deep trenches in thy beauty's field,\n"
    "thy youth's proud livery, so gazed on now, will be a tattered weed, of small worth held.\n"
    "Then being asked where all thy beauty lies, where all the treasure of thy lusty days,\n"
    "to say, within thine own deep-sunken eyes, were an all-eating shame and thriftless praise.\n"
)
PARITY: dict[str, float] = {}  # max |logit diff| per case, printed at the end of the module (pytest -s)


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    for name, diff in sorted(PARITY.items()):
        print(f"\nparity {name}: max |logit diff| {diff:.2e}", end="")


# ---- fixtures: tokenizers and tiny random models ----------------------------------------------------


@pytest.fixture(scope="module")
def bpe_folder(tmp_path_factory) -> Path:
    """A byte-level BPE tokenizer folder (tokenizer.json + tokenizer_config.json), trained here."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([TEXT] * 4, trainer)
    folder = tmp_path_factory.mktemp("bpe")
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(folder)
    return folder


def _hf_config(kind: str, **extra):
    common = dict(vocab_size=VOCAB, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if kind == "gpt2":
        return transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=64, **common, **extra)
    llama_like = dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        **common,
    )
    cls = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
    }[kind]
    if kind == "qwen3":
        llama_like["head_dim"] = 16
    return cls(**(llama_like | extra))


def _save_hf(folder: Path, kind: str, tokenizer: Path, *, seed: int = 0, **extra):
    cfg = _hf_config(kind, **extra)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    randomise(model, seed)
    model.eval().save_pretrained(folder)
    if tokenizer.is_dir():
        for f in tokenizer.iterdir():
            (folder / f.name).write_bytes(f.read_bytes())
    else:
        (folder / tokenizer.name).write_bytes(tokenizer.read_bytes())
    return model


def _compare(name: str, theirs: torch.nn.Module, ours: torch.nn.Module, length: int = 48, seed: int = 1) -> float:
    ids = torch.randint(0, VOCAB, (2, length), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        a = theirs(ids).logits.float()
        b = ours(ids).logits.float()
    diff = float((a - b).abs().max())
    PARITY[name] = max(diff, PARITY.get(name, 0.0))
    assert diff <= TOL, f"{name}: max |logit diff| {diff:.2e}"
    assert torch.equal(a.argmax(-1), b.argmax(-1)), name
    return diff


def _greedy_equal(theirs, ours, prompt_len: int = 8, new: int = 16) -> None:
    prompt = torch.randint(0, VOCAB, (1, prompt_len), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        a = theirs.generate(prompt, max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
        b = ours.generate(prompt, new)
    assert a.tolist() == b.tolist()


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    from model.hf import load_hf_weights

    return load_hf_weights(folder)


# ---- import: HF -> ours ---------------------------------------------------------------------------

CASES = {
    "gpt2": ("gpt2", {}),
    "gpt2-untied": ("gpt2", {"tie_word_embeddings": False, "n_inner": 96}),
    "llama": ("llama", {}),
    "llama-tied-bias": ("llama", {"tie_word_embeddings": True, "attention_bias": True, "mlp_bias": True}),
    "llama-linear": ("llama", {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}}),
    "llama-dynamic": ("llama", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}}),
    "llama-yarn": (
        "llama",
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 16,
            }
        },
    ),
    "llama-llama3": (
        "llama",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            }
        },
    ),
    "mistral": ("mistral", {"sliding_window": None}),
    "qwen2": ("qwen2", {"tie_word_embeddings": True}),
    "qwen3": ("qwen3", {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_import_matches_transformers_and_round_trips_bitwise(case, tmp_path, bpe_folder):
    from pretrain.export import export_hf
    from pretrain.hf_import import import_hf
    from run.checkpoint import load_model

    kind, extra = CASES[case]
    theirs = _save_hf(tmp_path / "hf", kind, bpe_folder, **extra)
    path = import_hf(tmp_path / "hf", tmp_path / "run", start=False, log=lambda _: None)
    ours, cfg = load_model(path)
    _compare(f"import {case}", theirs, ours, length=100 if case == "llama-dynamic" else 48)  # past 64: NTK grows
    _greedy_equal(theirs, ours)
    assert cfg.data.tokenizer == str(path) and cfg.train.init_from == str(path)

    export_hf(path, tmp_path / "back", log=lambda _: None)
    before, after = _tensors(tmp_path / "hf"), _tensors(tmp_path / "back")
    assert sorted(before) == sorted(after)
    for key, value in before.items():
        assert after[key].dtype == value.dtype and torch.equal(after[key], value), key
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back", attn_implementation="eager")
    _compare(f"round trip {case}", theirs, again.eval())


def test_mistral_sliding_window_caps_the_length(tmp_path, bpe_folder):
    from pretrain.hf_import import import_hf
    from run.checkpoint import load_model

    theirs = _save_hf(tmp_path / "hf", "mistral", bpe_folder, sliding_window=16)
    notes = []
    path = import_hf(tmp_path / "hf", tmp_path / "run", start=False, log=notes.append)
    ours, _ = load_model(path)
    assert ours.cfg.max_seq_len == 16 and any("sliding window 16" in n for n in notes), notes
    _compare("import mistral-window16", theirs, ours, length=16)


def test_sentencepiece_folder_and_bin_weights(tmp_path, sp_model):
    """A LLaMA folder with only tokenizer.model, and weights as pytorch_model.bin (weights_only load)."""
    from data.tokenizer import SentencePieceTokenizer, load_tokenizer
    from pretrain.hf_import import import_hf
    from run.checkpoint import load_model

    theirs = _save_hf(tmp_path / "hf", "llama", sp_model)
    hf = tmp_path / "hf"
    torch.save(theirs.state_dict(), hf / "pytorch_model.bin")
    (hf / "model.safetensors").unlink()
    path = import_hf(hf, tmp_path / "run", start=False, log=lambda _: None)
    _compare("import llama-bin", theirs, load_model(path)[0])
    tok = load_tokenizer(path)
    assert isinstance(tok, SentencePieceTokenizer) and tok.fingerprint == load_tokenizer(sp_model).fingerprint


def test_gpt2_original_key_layout(tmp_path, bpe_folder):
    """OpenAI's GPT-2 files: no ``transformer.`` prefix, causal-mask buffers stored as tensors."""
    from safetensors.torch import load_file, save_file

    from pretrain.hf_import import import_hf
    from run.checkpoint import load_model

    theirs = _save_hf(tmp_path / "hf", "gpt2", bpe_folder)
    weights = load_file(str(tmp_path / "hf" / "model.safetensors"))
    old = {k.removeprefix("transformer."): v for k, v in weights.items()}
    old["h.0.attn.bias"] = torch.tril(torch.ones(1, 1, 64, 64))
    old["h.0.attn.masked_bias"] = torch.tensor(-1e4)
    save_file(old, str(tmp_path / "hf" / "model.safetensors"))
    path = import_hf(tmp_path / "hf", tmp_path / "run", start=False, log=lambda _: None)
    _compare("import gpt2 (original key layout)", theirs, load_model(path)[0])


@pytest.mark.parametrize(
    "kind, extra, words",
    [
        ("gpt2", {"activation_function": "relu"}, ["GPT2LMHeadModel", "activation_function='relu'"]),
        ("gpt2", {"scale_attn_by_inverse_layer_idx": True}, ["scale_attn_by_inverse_layer_idx"]),
        ("llama", {"hidden_act": "gelu"}, ["hidden_act='gelu'"]),
        ("llama", {"head_dim": 32}, ["head_dim=32"]),
        ("llama", {"attention_bias": True}, ["attention_bias=True", "mlp_bias=False"]),
        ("llama", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, ["'longrope'"]),
        (
            "llama",
            {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
            ["partial_rotary_factor"],
        ),
    ],
)
def test_unsupported_options_are_one_line(kind, extra, words):
    from model.hf import model_config_from_hf

    hf = _hf_config(kind).to_dict() | extra
    with pytest.raises(ConfigError) as err:
        model_config_from_hf(hf)
    message = str(err.value)
    assert "\n" not in message and "not supported" in message and all(w in message for w in words), message


def test_unsupported_architecture_and_missing_tokenizer(tmp_path, bpe_folder):
    from model.hf import model_config_from_hf
    from pretrain.hf_import import main

    with pytest.raises(ConfigError, match=r"^hf: architecture FalconForCausalLM is not supported \(supported: GPT2"):
        model_config_from_hf({"architectures": ["FalconForCausalLM"], "model_type": "falcon"})
    _save_hf(tmp_path / "hf", "llama", bpe_folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "hf" / name).unlink()
    assert main(["--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "run"), "--no-start"]) == 2
    assert not (tmp_path / "run" / "hf_import").exists()


# ---- export: ours -> HF ---------------------------------------------------------------------------


EXPORTS = {
    "llama-gqa": (dict(family="llama", n_kv_heads=2), "LlamaForCausalLM"),
    "llama-tied-bias": (dict(family="llama", tie_embeddings=True, bias=True), "LlamaForCausalLM"),
    "gpt2": (dict(family="gpt2", tie_embeddings=True, bias=True), "GPT2LMHeadModel"),
    "gpt2-nobias": (dict(family="gpt2", bias=False), "GPT2LMHeadModel"),
    "qwen2": (dict(family="llama", qkv_bias=True, n_kv_heads=2), "Qwen2ForCausalLM"),
    "qwen3": (dict(family="llama", qk_norm=True, qkv_bias=True), "Qwen3ForCausalLM"),
    "rope-linear": (dict(family="llama", rope={"scaling": "linear", "factor": 2.0}), "LlamaForCausalLM"),
    "rope-ntk": (dict(family="llama", rope={"scaling": "ntk", "factor": 4.0}), "LlamaForCausalLM"),
    "rope-dynamic": (
        dict(family="llama", rope={"scaling": "dynamic_ntk", "factor": 2.0, "original_max_seq_len": 32}),
        "LlamaForCausalLM",
    ),
    "rope-yarn": (dict(family="llama", rope={"scaling": "yarn", "factor": 4.0}), "LlamaForCausalLM"),
    "rope-llama3": (
        dict(family="llama", rope={"scaling": "llama3", "factor": 8.0, "original_max_seq_len": 16, "theta": 5e5}),
        "LlamaForCausalLM",
    ),
}


@pytest.mark.parametrize("case", list(EXPORTS))
def test_export_loads_in_transformers_with_parity(case, tmp_path, sp_model):
    from data.hf_tokenizer import check_hf_tokenizer
    from data.tokenizer import load_tokenizer
    from pretrain.export import export_hf
    from run.checkpoint import load_model

    model, arch = EXPORTS[case]
    path = our_checkpoint(tmp_path / "run", SMALL | model, sp_model)
    out = export_hf(path, tmp_path / "hf", log=lambda _: None)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [arch]
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(out))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    assert type(theirs).__name__ == arch
    ours, _ = load_model(path)
    _compare(f"export {case}", theirs, ours)
    _greedy_equal(theirs, ours)
    if arch == "Qwen2ForCausalLM":  # transformers 5 imposes Qwen2's own tokenizer pipeline on model_type qwen2
        hf_tok = transformers.PreTrainedTokenizerFast.from_pretrained(out)
    else:
        assert check_hf_tokenizer(load_tokenizer(sp_model), out) is None
        hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    assert hf_tok.encode(TEXT, add_special_tokens=False) == load_tokenizer(sp_model).encode(TEXT)
    assert hf_tok.decode(hf_tok.encode(TEXT, add_special_tokens=False)) == TEXT


def test_export_bf16_sharded_and_refuses_non_empty_out(tmp_path, sp_model):
    from pretrain.export import export_hf

    path = our_checkpoint(tmp_path / "run", SMALL | dict(family="llama"), sp_model)
    out = export_hf(path, tmp_path / "hf", dtype="bf16", max_shard_size="60KB", log=lambda _: None)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1 and not (out / "model.safetensors").exists()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert theirs.dtype == torch.bfloat16
    ours = _tensors(out)
    assert all(t.dtype == torch.bfloat16 for t in ours.values())
    with pytest.raises(ConfigError, match="exists and is not an empty directory"):
        export_hf(path, out, log=lambda _: None)
    # the weight shards get the mode of the export's other files (safetensors alone writes 0600)
    modes = {f.name: stat.S_IMODE(f.stat().st_mode) for f in out.iterdir()}
    assert set(modes.values()) == {modes["config.json"]}, modes


def test_variant_export_is_refused_or_explicit_and_imports_back(tmp_path, sp_model):
    from pretrain.export import export_hf, main
    from pretrain.hf_import import import_hf
    from run.checkpoint import load_model

    model = SMALL | dict(family="llama", attention={"kind": "focal", "focal": {"mode": "learned"}})
    path = our_checkpoint(tmp_path / "run", model, sp_model)
    with pytest.raises(ConfigError) as err:
        export_hf(path, tmp_path / "hf", log=lambda _: None)
    message = str(err.value)
    assert "\n" not in message and "'focal'" in message and "--allow-variant" in message, message
    assert main(["--checkpoint", str(path), "--out", str(tmp_path / "hf"), "--format", "hf"]) == 2

    lines = []
    out = export_hf(path, tmp_path / "hf", allow_variant=True, log=lines.append)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "focused_llama" and config["focused_attention"]["kind"] == "focal"
    assert any("trust_remote_code=True" in line and "'focal'" in line for line in lines), lines
    with pytest.raises((ValueError, KeyError)):
        transformers.AutoModelForCausalLM.from_pretrained(out)
    back = import_hf(out, tmp_path / "back", start=False, log=lambda _: None)
    ours, cfg = load_model(path)
    again, cfg_back = load_model(back)
    assert cfg_back.model.attention.kind == "focal" and cfg_back.model.attention.variant.mode == "learned"
    ids = torch.randint(0, VOCAB, (1, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, again(ids).logits)


# ---- through the command lines (slow) --------------------------------------------------------------


def _cli(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="disabled", PYTHONPATH=str(REPO))
    out = subprocess.run(
        [sys.executable, "-m", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert out.returncode == 0, f"{args[0]} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


@pytest.mark.slow
def test_trained_demo_model_exports_with_parity_on_held_out_text(tmp_path, cache_dir):
    """The README demo config, 3 steps, exported through the CLI and run in transformers."""
    from data.tokenizer import load_tokenizer
    from run.checkpoint import latest_checkpoint, load_model

    run = tmp_path / "tiny"
    _cli(
        "pretrain.train",
        "--config",
        str(REPO / "launch" / "configs" / "tiny.toml"),
        "--set",
        "train.max_steps=3",
        "--set",
        f"run.dir={run}",
        "--set",
        f"data.cache_dir={cache_dir}",
        "--set",
        "log.wandb=disabled",
        "--set",
        "log.tensorboard=false",
    )
    out = tmp_path / "hf"
    done = _cli("pretrain.export", "--run", str(run), "--format", "hf", "--out", str(out))
    assert "LlamaForCausalLM" in done.stdout and "warning" not in done.stderr, done.stderr
    ours, cfg = load_model(latest_checkpoint(run))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    text = TEXT * 4  # a sonnet: not in the embedded plays the model trained on

    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids == load_tokenizer(latest_checkpoint(run) / "tokenizer.model").encode(text)
    x = torch.tensor([ids[: cfg.data.seq_len]])
    with torch.no_grad():
        a, b = theirs(x).logits, ours(x).logits
    diff = float((a - b).abs().max())
    PARITY["export demo (tiny, 3 steps, held-out text)"] = diff
    assert diff <= TOL and torch.equal(a.argmax(-1), b.argmax(-1))
    with torch.no_grad():
        g1 = theirs.generate(x[:, :16], max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
        g2 = ours.generate(x[:, :16], 24)
    assert g1.tolist() == g2.tolist()


@pytest.mark.slow
def test_import_cli_starts_a_run_that_trains_and_evaluates(tmp_path, bpe_folder, cache_dir):
    """python -m pretrain.hf_import -> step 0 checkpoint; pretrain.train continues it; eval.run evaluates it."""
    from run.checkpoint import latest_checkpoint, load_model

    theirs = _save_hf(tmp_path / "hf", "qwen2", bpe_folder)
    run = tmp_path / "run"
    sets = [f"data.cache_dir={cache_dir}", "log.wandb=disabled", "log.tensorboard=false", "train.batch_size=4"]
    sets += ["data.seq_len=64", "train.max_steps=2", "eval.batches=1", "checkpoint.every=1"]
    _cli(
        "pretrain.hf_import", "--hf", str(tmp_path / "hf"), "--out", str(run), *[a for s in sets for a in ("--set", s)]
    )
    start = latest_checkpoint(run)
    assert start.name == "step_00000000"
    _compare("import qwen2 via CLI (step 0)", theirs, load_model(start)[0])
    trained = _cli("pretrain.train", "--config", str(run / "config.toml"))
    assert "resumed from" in trained.stdout and latest_checkpoint(run).name == "step_00000002", trained.stdout
    evaluated = _cli("eval.run", "--run", str(run), "--tasks", "ppl", "--limit", "2")
    assert "ppl: validation loss" in evaluated.stdout


def _readme_hf_lines() -> list[str]:
    """The command lines of the README's "Hugging Face in and out" block, up to the import (comments dropped)."""
    text = (REPO / "README.md").read_text()
    section = text.split("\n### Hugging Face in and out\n", 1)[1]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    lines = [line.split("   #", 1)[0].strip() for line in block.splitlines()]
    lines = [line for line in lines if line and not line.startswith("#")]
    return lines[: next(i for i, line in enumerate(lines) if "pretrain.hf_import" in line)]


@pytest.mark.slow  # four interpreters, two of them import transformers
def test_the_readmes_hf_lines_run_as_written_and_the_tokenizer_asks_nothing_on_a_terminal(tmp_path, sp_model):
    """The README's export and loading lines for a full-attention run and a variant run, as written (``[--dtype
    bf16]`` is the optional flag, left out), in a folder holding runs/tiny and runs/tiny_focus. The loading lines
    run on a pseudo-terminal with nothing typed: a prompt to trust the model's code would hang until the timeout."""
    lines = _readme_hf_lines()
    assert lines[0].startswith("pip install") and sum("pretrain.export" in line for line in lines) == 2, lines
    for name, model in (
        ("tiny", SMALL | dict(family="llama")),
        ("tiny_focus", SMALL | dict(attention={"kind": "focus"})),
    ):
        our_checkpoint(tmp_path / "runs" / name, model, sp_model)
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    for line in lines[1:]:
        argv = shlex.split(line.replace(" [--dtype bf16]", ""))
        assert argv[0] == "python", line
        if argv[1] == "-c":  # on a terminal: script(1) gives it one, stdin is empty
            cmd = ["script", "-qec", shlex.join([sys.executable, *argv[1:]]), "/dev/null"]
        else:
            cmd = [sys.executable, *argv[1:]]
        proc = subprocess.run(
            cmd, cwd=tmp_path, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300
        )
        assert proc.returncode == 0, f"{line}\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
        assert "Do you wish to run the custom code" not in proc.stdout + proc.stderr, line
    assert (tmp_path / "hf" / "tiny_focus" / "modeling_focused.py").is_file()
