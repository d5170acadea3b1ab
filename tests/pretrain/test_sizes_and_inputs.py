"""Issue 41: absurd sizes, malformed foreign configs, custom-code tokenizer folders and bad CLI arguments are
refused in one line with exit 2, before anything is built (``--dry-run`` included), all in process."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from core.errors import ConfigError
from launch import plan as planner
from pretrain import hf_import, train
from run.config import load_run_config
from run.parallel import _divisors
from tests.conftest import REPO

TINY = str(REPO / "launch/configs/tiny.toml")
LLAMA_7B = str(REPO / "launch/configs/llama-7b.toml")

SMALL_HF = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "vocab_size": 320,
}


def one_line(capsys: pytest.CaptureFixture, code: int, *words: str) -> str:
    """Exit 2 and one stderr line holding ``words``; returns the line."""
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip() and "[WARNING]" not in line]
    assert code == 2 and len(lines) == 1, (code, err)
    assert all(w in lines[0] for w in words), (words, lines[0])
    return lines[0]


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory) -> bytes:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=280, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(["a few words of text"] * 4, trainer)
    return tok.to_str().encode()


def hf_folder(root: Path, tokenizer_json: bytes, config: object = None, raw: bytes | None = None) -> Path:
    """A Hugging Face folder's config.json (``config`` as JSON, or ``raw`` bytes) and tokenizer.json; no weights."""
    folder = root / "hf"
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes(tokenizer_json)
    (folder / "config.json").write_bytes(raw if raw is not None else json.dumps(config).encode())
    return folder


def dry_run(folder: Path, root: Path, *sets: str) -> int:
    args = ["--config", TINY, "--dry-run", "--set", f"train.init_from=hf:{folder}", "--set", f"run.dir={root}/run"]
    for item in ("data.seq_len=32", *sets):
        args += ["--set", item]
    return train.main(args)


# ---- sizes ---------------------------------------------------------------------------------------------------------

HF_SIZES = {
    "layers-1e9": ({"num_hidden_layers": 1e9}, ["config.json", "model.n_layers", "1,000,000,000", "4,096"]),
    "vocab-1e12": ({"vocab_size": 1e12}, ["config.json", "model.vocab_size", "2^32"]),
    "width-2e9": ({"hidden_size": 2**31, "intermediate_size": 64}, ["config.json", "model.d_model"]),
}


@pytest.mark.parametrize("case", list(HF_SIZES))
def test_absurd_sizes_in_an_hf_config_are_one_line_under_dry_run(case, tmp_path, tokenizer_json, capsys):
    change, words = HF_SIZES[case]
    folder = hf_folder(tmp_path, tokenizer_json, SMALL_HF | change)
    one_line(capsys, dry_run(folder, tmp_path), "train.init_from", *words)
    assert hf_import.main(["--hf", str(folder), "--out", str(tmp_path / "imp"), "--no-start"]) == 2
    one_line(capsys, 2, *words)
    assert not (tmp_path / "imp").exists()


SET_SIZES = {
    "n-layers-1e9": (["model.n_layers=1000000000"], ["model.n_layers", "4,096"]),
    "heads-huge": (["model.n_heads=1048576", "model.d_model=1048576"], ["model.d_model", "2^17"]),
    # within every format's bound, beyond this machine's memory: the float32 parameters alone
    "parameters-beyond-memory": (
        ["model.n_layers=4096", "model.d_model=65536", "model.n_heads=512"],
        ["model: at least", "parameters", "GiB in float32, more than 1 rank(s)"],
    ),
    "micro-batch-beyond-memory": (
        ["train.batch_size=4000000", "train.micro_batch_size=4000000"],
        ["train.batch_size: one rank holds at least", "activations"],
    ),
    "batch-tokens": (["train.batch_size=100000000"], ["train.batch_size", "tokens per step", "2^32"]),
}


@pytest.mark.parametrize("case", list(SET_SIZES))
def test_absurd_sizes_set_on_the_command_line_are_one_line_under_dry_run(case, capsys):
    sets, words = SET_SIZES[case]
    args = ["--config", TINY, "--dry-run"]
    for item in sets:
        args += ["--set", item]
    start = time.monotonic()
    one_line(capsys, train.main(args), *words)
    assert time.monotonic() - start < 30  # refused before anything is built


# The weights fit in float32, but not with their gradients and AdamW state (and the activations): one line at once,
# not an out-of-memory kill in the first backward minutes later. On a host of 24 GiB (this project's machines).
TRAINING_STATE = {
    "a-thousand-layers": (["model.n_layers=1000"], ["train.batch_size: one rank holds at least", "AdamW state"]),
    "state-beyond-memory": (
        ["model.n_layers=300", "model.d_model=1024", "model.n_heads=8"],
        ["model: at least", "bytes each: weights, gradients, AdamW"],
    ),
}


@pytest.mark.parametrize("case", list(TRAINING_STATE))
def test_training_state_beyond_memory_is_one_line_under_dry_run(case, capsys, monkeypatch):
    import run.sizes

    monkeypatch.setattr(run.sizes, "host_memory", lambda: 24 << 30)
    sets, words = TRAINING_STATE[case]
    args = ["--config", TINY, "--dry-run", "--set", "train.device=cpu"]
    for item in sets:
        args += ["--set", item]
    one_line(capsys, train.main(args), *words)
    # with the activations recomputed and only the weights of a frozen model, the same shape is not refused
    if case == "a-thousand-layers":
        frozen = [*args, "--set", "train.activation_checkpointing=full", "--set", 'train.freeze=["*"]']
        assert train.main(frozen) == 0, capsys.readouterr().err


PLAN_CASES = {
    "gpus-1e9": (["--gpus", "1000000000"], ["--gpus", "1,048,576"]),
    "gpus-0": (["--gpus", "0"], ["--gpus", ">= 1"]),
    "n-layers-1e9": (["--gpus", "8", "--set", "model.n_layers=1000000000"], ["model.n_layers", "4,096"]),
    "beyond-every-device": (
        ["--gpus", "8", "--set", "model.n_layers=4096", "--set", "model.d_model=65536", "--set", "model.n_heads=512"],
        ["model: at least", "--gpus 8 x 72.0 GiB usable"],
    ),
}


@pytest.mark.parametrize("case", list(PLAN_CASES))
def test_the_planner_refuses_absurd_sizes_in_one_line(case, capsys):
    args, words = PLAN_CASES[case]
    start = time.monotonic()
    one_line(capsys, planner.main(["--config", LLAMA_7B, "--gpu-memory", "80GiB", *args]), *words)
    assert time.monotonic() - start < 30


def test_the_planners_search_is_bounded_at_a_million_devices():
    """2^20 devices (the bound) and a highly composite count: divisors by trial division to sqrt(n), so the
    search takes seconds, and still picks a layout; 7B at 64 GPUs is unchanged (tests/pretrain/test_layout_plan.py)."""
    assert _divisors(720720)[:6] == [1, 2, 3, 4, 5, 6] and len(_divisors(720720)) == 240
    assert _divisors(36) == [1, 2, 3, 4, 6, 9, 12, 18, 36] and _divisors(1) == [1]
    for gpus in (2**20, 720720):
        cfg = load_run_config(LLAMA_7B, [f"train.batch_size={gpus}", "train.micro_batch_size=0"])
        start = time.monotonic()
        estimates = planner.plan(cfg, gpus, 80 << 30, gpus_per_node=gpus)
        assert time.monotonic() - start < 30
        chosen = planner.pick(estimates)
        assert chosen is not None and chosen.layout.world == gpus


@pytest.mark.parametrize("where", ["missing-folder", "a-folder"])
def test_plan_emit_into_a_missing_folder_or_onto_a_folder_is_one_line(where, tmp_path, capsys):
    emit = tmp_path / "nope" / "plan.toml" if where == "missing-folder" else tmp_path
    code = planner.main(["--config", LLAMA_7B, "--gpus", "64", "--gpu-memory", "80GiB", "--emit", str(emit)])
    one_line(capsys, code, "--emit", str(emit.parent if where == "missing-folder" else emit))
    assert not (tmp_path / "nope").exists()


# ---- foreign configs -----------------------------------------------------------------------------------------------

MALFORMED = {
    "list": (None, b"[]", ["config.json", "JSON object", "list"]),
    "binary": (None, bytes(range(256)) * 4, ["config.json", "not text"]),
    "missing-key": ({k: v for k, v in SMALL_HF.items() if k != "hidden_size"}, None, ["config.json", "hidden_size"]),
    "two": (SMALL_HF | {"num_attention_heads": "two"}, None, ["config.json", "num_attention_heads", "'two'"]),
    "float-layers": (SMALL_HF | {"num_hidden_layers": 2.5}, None, ["config.json", "num_hidden_layers", "2.5"]),
    "architectures-string": (SMALL_HF | {"architectures": "Llama"}, None, ["config.json", "architectures"]),
    "rope-string": (SMALL_HF | {"rope_parameters": "yarn"}, None, ["config.json", "rope_parameters"]),
}


@pytest.mark.parametrize("case", [*MALFORMED, "index-without-weight_map", "index-escaping-the-folder"])
def test_a_malformed_hf_config_or_index_is_one_line_naming_the_file_and_field(case, tmp_path, tokenizer_json, capsys):
    if case.startswith("index"):
        folder = hf_folder(tmp_path, tokenizer_json, SMALL_HF)
        index = {"metadata": {}} if case == "index-without-weight_map" else {"weight_map": {"w": "../secret"}}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
        words = ["model.safetensors.index.json", "weight_map"]
    else:
        config, raw, words = MALFORMED[case]
        folder = hf_folder(tmp_path, tokenizer_json, config, raw)
    one_line(capsys, dry_run(folder, tmp_path), "train.init_from", str(folder), *words)
    assert hf_import.main(["--hf", str(folder), "--out", str(tmp_path / "imp"), "--no-start"]) == 2
    one_line(capsys, 2, str(folder), *words)


# ---- tokenizer folders naming custom code --------------------------------------------------------------------------

AUTO_MAP = {"AutoTokenizer": [None, "custom_tokenizer.CustomTokenizer"]}


@pytest.mark.parametrize(
    "case", ["tokenizer.json+tokenizer_config", "tokenizer.json+config.json", "tokenizer.model+tokenizer_config"]
)
def test_a_tokenizer_folder_naming_custom_code_is_refused_whether_or_not_tokenizer_json_exists(
    case, tmp_path, tokenizer_json, capsys
):
    from data.tokenizer import load_tokenizer

    folder = tmp_path / "tok"
    folder.mkdir()
    if case.startswith("tokenizer.json"):
        (folder / "tokenizer.json").write_bytes(tokenizer_json)
    else:
        (folder / "tokenizer.model").write_bytes(b"not read: the folder is refused first")
    named_in = "config.json" if case.endswith("config.json") else "tokenizer_config.json"
    (folder / named_in).write_text(json.dumps({"model_type": "llama", "auto_map": AUTO_MAP}))
    args = ["--config", TINY, "--dry-run", "--set", f"data.tokenizer={folder}", "--set", f"run.dir={tmp_path}/run"]
    one_line(capsys, train.main(args), "data.tokenizer", str(folder), f"auto_map in {named_in}")
    for path in (folder, folder / "tokenizer.json"):
        if path.exists():
            with pytest.raises(Exception, match="names custom code"):
                load_tokenizer(path)


# issue 50: a tokenizer_config.json that starts with a UTF-8 byte-order mark, or is a link to a file outside its folder,
# was copied into the run (its auto_map and the outside content included)
FOLDER_CASES = {
    "bom-auto-map": ("auto_map in tokenizer_config.json",),
    "link-outside": ("is a link to", "outside the folder"),
    "not-json": ("is not valid JSON",),
}


@pytest.mark.parametrize("case", list(FOLDER_CASES))
def test_a_tokenizer_folder_with_a_bom_or_a_link_out_is_one_line(case, tmp_path, tokenizer_json, capsys):
    from data.tokenizer import load_tokenizer

    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes(tokenizer_json)
    config = folder / "tokenizer_config.json"
    if case == "bom-auto-map":
        config.write_bytes(b"\xef\xbb\xbf" + json.dumps({"auto_map": AUTO_MAP}).encode())
    elif case == "link-outside":
        secret = tmp_path / "secret.json"
        secret.write_text(json.dumps({"eos_token": "</s>", "note": "outside content"}))
        config.symlink_to(secret)
    else:
        config.write_text("{not json")
    args = ["--config", TINY, "--dry-run", "--set", f"data.tokenizer={folder}", "--set", f"run.dir={tmp_path}/run"]
    one_line(capsys, train.main(args), "data.tokenizer", str(folder), *FOLDER_CASES[case])
    with pytest.raises(ConfigError, match=FOLDER_CASES[case][0]):
        load_tokenizer(folder)
    assert not (tmp_path / "run").exists()


def test_a_bom_or_a_link_inside_the_folder_is_read_as_the_file(tmp_path, tokenizer_json):
    """What is allowed: a byte-order mark on a valid config, and a link to a file of the folder itself."""
    from data.tokenizer import load_tokenizer

    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes(tokenizer_json)
    (folder / "real.json").write_text(json.dumps({"model_type": "llama"}))
    (folder / "config.json").symlink_to(folder / "real.json")
    (folder / "tokenizer_config.json").write_bytes(b"\xef\xbb\xbf" + json.dumps({"model_max_length": 64}).encode())
    tok = load_tokenizer(folder)
    assert [p.name for p in tok.companions] == ["tokenizer_config.json"]
