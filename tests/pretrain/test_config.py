from __future__ import annotations

import pytest

from core import configlib
from core.errors import ConfigError
from run.config import load_run_config, run_config_from_dict
from tests.conftest import REPO

TINY = REPO / "launch" / "configs" / "tiny.toml"


def test_tiny_config_loads_with_preset_and_overrides():
    cfg = load_run_config(
        TINY, ["model.n_layers=2", "train.max_steps=7", "model.attention.full.backend=sdpa", "run.dir=/tmp/x"]
    )
    assert (
        cfg.model.preset == "tiny" and cfg.model.n_layers == 2 and cfg.model.d_model == 256
    )  # preset kept, override wins
    assert cfg.train.max_steps == 7 and cfg.model.attention.variant.backend == "sdpa"
    assert str(cfg.run_dir) == "/tmp/x"


def test_resolved_config_round_trips_through_toml():
    cfg = load_run_config(TINY, ["model.qk_norm=true", "train.lr=0.01"])
    again = run_config_from_dict(configlib.tomllib.loads(cfg.to_toml()))
    assert again.to_dict() == cfg.to_dict()
    assert "[model.attention.full]" in cfg.to_toml()


@pytest.mark.parametrize(
    "override,needle",
    [
        ("model.n_head=8", "model.n_head: unknown key; did you mean 'n_heads'?"),
        ("train.max_step=8", "train.max_step: unknown key; did you mean 'max_steps'?"),
        ("trian.max_steps=8", "trian: unknown key; did you mean 'train'?"),
        ("model.attention.focuss.window=8", "model.attention.focuss: unknown key"),
        ("train.max_steps=abc", "train.max_steps: expected an integer, got 'abc'"),
        ("train.lr=true", "train.lr: expected a number"),
        ("model.qk_norm=1", "model.qk_norm: expected true or false"),
        ("model.n_heads=7", "model.n_heads: 7 does not divide model.d_model=256"),
        ("model.preset=gpt5", "model.preset: 'gpt5' is not one of"),
        ("model.attention.kind=sparse", "model.attention.kind: 'sparse' is not one of"),
        (
            'data.mixture=[{source = "local", path = "x", weight = 1.0}]',
            "data.mixture: set data.source = 'mixture' to use it",
        ),
        ("data.source=mixture", "data.mixture: data.source = 'mixture' needs [[data.mixture]] tables"),
        ('data.mixture=[{source = "c4", weigth = 1.0}]', "data.mixture[0].weigth: unknown key; did you mean 'weight'?"),
        ("data.source=prepared", "data.path: '' is not a prepared shard directory"),
        ("data.document_masking=true", None),
        ("train.activation_checkpointing=some", "train.activation_checkpointing: 'some' is not one of"),
        ("eval.tasks=hellaswag,mmlu", "eval.tasks: mmlu not available"),
        ("train.schedule=step", "train.schedule: 'step' is not one of cosine, linear, constant, wsd"),
        ("train.stop_at=999", "train.stop_at: 999 is past train.max_steps=200"),
        ("data.seq_len=1024", "data.seq_len: 1024 exceeds model.max_seq_len=256"),
        ("log.wandb=maybe", "log.wandb: 'maybe' is not one of"),
    ],
)
def test_bad_input_is_one_line_naming_the_field(override, needle):
    if needle is None:  # the variant's counterpart below must then fail
        load_run_config(TINY, [override])
        override, needle = (
            "model.attention.kind=lazy",
            "data.document_masking: not supported by model.attention.kind = 'lazy'; supported: full",
        )
        with pytest.raises(ConfigError) as info:
            load_run_config(TINY, ["data.document_masking=true", override])
        assert needle in str(info.value)
        return
    with pytest.raises(ConfigError) as info:
        load_run_config(TINY, [override])
    message = str(info.value)
    assert needle in message and "\n" not in message


def test_override_values_parse_as_toml_or_fall_back_to_strings():
    data: dict = {}
    configlib.apply_override(data, "a.b=3")
    configlib.apply_override(data, "a.c=0.5")
    configlib.apply_override(data, "a.d=runs/x")
    configlib.apply_override(data, 'a.e="7"')
    assert data == {"a": {"b": 3, "c": 0.5, "d": "runs/x", "e": "7"}}
    with pytest.raises(ConfigError, match="expected key=value"):
        configlib.apply_override(data, "a.b")


def test_missing_config_file():
    with pytest.raises(ConfigError, match="--config: no such file"):
        load_run_config("/nonexistent/run.toml")


def test_a_resolved_config_without_a_preset_loads_back():
    from core.configlib import tomllib
    from run.config import run_config_from_dict

    cfg = run_config_from_dict({"model": {"d_model": 64, "n_layers": 2, "n_heads": 4, "vocab_size": 128}})
    assert cfg.model.preset == ""
    again = run_config_from_dict(tomllib.loads(cfg.to_toml()))
    assert again.model.d_model == 64 and again.model.preset == ""


def test_hub_sources_validate_offline_and_check_their_configs():
    cfg = load_run_config(TINY, ["data.source=fineweb-edu", "data.name=sample-100BT"])
    assert cfg.data.is_streaming and cfg.data.stream_config(seed=1).config_name == "sample-100BT"
    with pytest.raises(ConfigError, match="sample-1T"):
        load_run_config(TINY, ["data.source=fineweb-edu", "data.name=sample-1T"])


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["model.max_seq_len=1000000000"], r"^model.max_seq_len: 1,000,000,000 is beyond 16,777,216 positions"),
        (
            ['model.preset="gpt2-124m"', "model.max_seq_len=1000000"],
            r"^model.max_seq_len: a learned position table of 1,000,000 x 768 \(2.86 GiB in float32\) would outweigh",
        ),
    ],
    ids=["rope-positions", "learned-table"],
)
def test_an_impossible_max_seq_len_is_one_line(overrides, message):
    """Issue 30: GPT-2 tried to allocate 1 TB for max_seq_len=1e9; LLaMA trained on with it."""
    with pytest.raises(ConfigError, match=message):
        load_run_config(REPO / "launch" / "configs" / "tiny.toml", overrides)


def test_warmup_longer_than_the_run_is_one_warning_line():
    """Runs (a smoke test may want it) but says so: the learning rate never reaches train.lr."""
    assert load_run_config(TINY, ["train.max_steps=200"]).train.warnings() == []
    (line,) = load_run_config(TINY, ["train.max_steps=5"]).train.warnings()  # tiny.toml: warmup_steps = 20
    assert line.startswith("train.warmup_steps=20 exceeds train.max_steps=5") and "25%" in line and "\n" not in line
