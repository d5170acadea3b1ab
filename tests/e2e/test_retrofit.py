"""The Focus retrofit recipe of docs/retrofit.md end to end, at toy scale, through the real CLIs and the shipped
configs: a full-attention model trained on novels, out to a Hugging Face directory and back in, Focus added
and only its own parameters (``*.core.*``) trained on Shakespeare, the same budget spent on full fine-tuning,
then the centroid file: exported alone, applied back onto the base, refused (one line) where it does not fit.

Reads ../shared/data (a few novels and tiny Shakespeare); skips without it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO
from tests.e2e.test_train_cli import toy_args

CONFIGS = REPO / "launch" / "configs"
NOVELS = "english_novels/Burnett_*.txt"  # two novels, about 0.75 MB


def toy(run_dir: Path, cache_dir: Path, **extra) -> list[str]:
    """--set overrides shrinking a shipped config to seconds (the shapes stay those of one family)."""
    steps = {"train.max_steps": 3, "train.warmup_steps": 1, "train.log_every": 1}
    return toy_args(run_dir, cache_dir, **{**steps, "eval.batches": 2, "eval.sample_tokens": 0, **extra})


def cli(*args: str, ok: bool = True, timeout: int = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"},
    )
    if ok:
        assert proc.returncode == 0, f"{' '.join(args[:2])}: {proc.stderr[-3000:]}"
    return proc


def weights(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    from run.checkpoint import MODEL_FILE, resolve_checkpoint

    return load_file(str(resolve_checkpoint(directory) / MODEL_FILE))


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


@pytest.fixture(scope="module")
def journey(tmp_path_factory, cache_dir, shared_data) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("retrofit")
    lines = (shared_data / "tinyshakespeare" / "input.txt").read_text(encoding="utf-8").splitlines(keepends=True)
    (root / "train.txt").write_text("".join(lines[:3000]), encoding="utf-8")
    (root / "heldout.txt").write_text("".join(lines[-400:]), encoding="utf-8")
    paths = {name: root / name for name in ("novels", "novels_hf", "base", "focus", "full_ft")}
    paths |= {"imported": paths["base"] / "hf_import", "file": root / "shakespeare.safetensors", "root": root}

    novels = toy(paths["novels"], cache_dir, **{"data.path": str(shared_data / NOVELS), "train.max_steps": 6})
    cli("pretrain.train", "--config", str(CONFIGS / "tiny_novels.toml"), *novels)
    cli("pretrain.export", "--run", str(paths["novels"]), "--format", "hf", "--out", str(paths["novels_hf"]))
    cli("pretrain.hf_import", "--hf", str(paths["novels_hf"]), "--out", str(paths["base"]), "--no-start")
    # as docs/retrofit.md runs it: the configs start from the HF folder itself (hf:PATH: its shape, its tokenizer)
    domain = {"data.path": str(root / "train.txt"), "train.init_from": f"hf:{paths['novels_hf']}"}
    focus = toy(paths["focus"], cache_dir, **domain, **{"model.attention.focus.window": 8})
    cli("pretrain.train", "--config", str(CONFIGS / "tiny_retrofit_focus.toml"), *focus)
    cli(
        "pretrain.train",
        "--config",
        str(CONFIGS / "tiny_retrofit_full.toml"),
        *toy(paths["full_ft"], cache_dir, **domain),
    )
    cli("pretrain.export", "--run", str(paths["focus"]), "--only", "*.core.*", "--out", str(paths["file"]))
    return paths


def test_centroid_only_retrofit_leaves_the_backbone_bitwise_unchanged(journey):
    base, retrofit, full_ft = weights(journey["imported"]), weights(journey["focus"]), weights(journey["full_ft"])
    core = sorted(k for k in retrofit if ".core." in k)
    assert core and not any(".core." in k for k in base)
    assert set(retrofit) - set(core) == set(base)
    unchanged = [k for k in base if bitwise_equal(base[k], retrofit[k])]
    assert unchanged == list(base), "a frozen tensor changed"
    assert not any(bitwise_equal(base[k], full_ft[k]) for k in base if k.endswith(".weight")), "full fine-tuning froze"
    # the same check from the command line: exit 0 when every shared tensor is bitwise the base's, 1 otherwise
    same = cli("pretrain.adapters", "compare", "--base", str(journey["imported"]), "--run", str(journey["focus"]))
    assert f"{len(base)} of {len(base)} shared tensors bitwise equal" in same.stdout
    moved = cli(
        "pretrain.adapters", "compare", "--base", str(journey["imported"]), "--run", str(journey["full_ft"]), ok=False
    )
    assert moved.returncode == 1 and "changed:" in moved.stdout


def test_the_centroid_file_round_trips(journey, cache_dir):
    from pretrain.adapters import read_adapter

    retrofit = weights(journey["focus"])
    adapter = read_adapter(journey["file"])
    assert sorted(adapter.tensors) == sorted(k for k in retrofit if ".core." in k)
    assert all(bitwise_equal(t, retrofit[k]) for k, t in adapter.tensors.items())
    assert adapter.attention["kind"] == "focus" and adapter.attention["focus"]["window"] == 8
    assert journey["file"].stat().st_size < 64 * 1024  # the centroids alone, not the model

    applied = journey["root"] / "applied"
    cli(
        "pretrain.adapters",
        "apply",
        "--base",
        str(journey["base"] / "hf_import"),
        "--adapter",
        str(journey["file"]),
        "--out",
        str(applied),
    )
    merged = weights(applied)
    assert sorted(merged) == sorted(retrofit) and all(bitwise_equal(merged[k], retrofit[k]) for k in retrofit)
    # what eval.run scores is the retrofitted model itself, on held-out Shakespeare
    scores = []
    for name, where in (("retrofit", ["--run", str(journey["focus"])]), ("applied", ["--checkpoint", str(applied)])):
        out = journey["root"] / f"{name}.json"
        heldout = str(journey["root"] / "heldout.txt")
        cli("eval.run", *where, "--tasks", "ppl", "--ppl-data", heldout, "--out", str(out), "--no-progress")
        scores.append(json.loads(out.read_text())["ppl"]["loss"])
    assert scores[0] == scores[1]
    # and training continues from it (train.init_from reads it like any checkpoint)
    again = toy(
        journey["root"] / "again",
        cache_dir,
        **{
            "data.path": str(journey["root"] / "train.txt"),
            "data.tokenizer": str(applied),
            "train.init_from": str(applied),
            "model.attention.focus.window": 8,
            "train.max_steps": 1,
        },
    )
    proc = cli("pretrain.train", "--config", str(CONFIGS / "tiny_retrofit_focus.toml"), *again)
    assert f"initialised weights from {applied}" in proc.stdout


def test_a_centroid_file_that_does_not_fit_is_one_line(journey, tmp_path, capsys):
    from safetensors import safe_open
    from safetensors.torch import save_file

    from core.errors import ConfigError
    from pretrain.adapters import apply_adapter

    def refused(base: Path, file: Path) -> str:
        with pytest.raises(ConfigError) as info:
            apply_adapter(base, file, tmp_path / "out", log=lambda line: None)
        assert "\n" not in str(info.value)
        return str(info.value)

    imported, file = journey["imported"], journey["file"]
    assert "other backbone weights" in refused(journey["full_ft"], file)
    assert "another tokenizer" in refused(journey["novels"], file)  # same ids, but another tokenizer file
    with safe_open(str(file), framework="pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    backbone = json.loads(meta["backbone"])
    save_file(
        tensors,
        str(tmp_path / "deeper.safetensors"),
        metadata={**meta, "backbone": json.dumps({**backbone, "n_layers": 9})},
    )
    assert "another model shape: n_layers=9 (base: 2)" in refused(imported, tmp_path / "deeper.safetensors")
    save_file(tensors, str(tmp_path / "bare.safetensors"))
    assert "not a centroid file" in refused(imported, tmp_path / "bare.safetensors")
    (tmp_path / "text.safetensors").write_text("not weights")
    assert "not a readable safetensors file" in refused(imported, tmp_path / "text.safetensors")
    assert "no such file" in refused(imported, tmp_path / "absent.safetensors")
    # from the command line: exit 2, one line
    proc = cli(
        "pretrain.export", "--run", str(journey["novels"]), "--only", "*.core.*", "--out", str(tmp_path / "x"), ok=False
    )
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "matches no tensor" in proc.stderr
    proc = cli(
        "pretrain.adapters",
        "apply",
        "--base",
        str(imported),
        "--adapter",
        str(tmp_path / "bare.safetensors"),
        "--out",
        str(tmp_path / "y"),
        ok=False,
    )
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: --adapter:")
    from pretrain.export import main as export_main

    assert (
        export_main(
            ["--run", str(journey["focus"]), "--only", "*.core.*", "--format", "hf", "--out", str(tmp_path / "z")]
        )
        == 2
    )
    assert "--only: writes a centroid file" in capsys.readouterr().err and not (tmp_path / "z").exists()
