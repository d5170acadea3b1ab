"""Shared fixtures. Tests run offline and on CPU; ../shared is optional (tests that read it skip without it)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")


@pytest.fixture(scope="session")
def shared_data() -> Path:
    path = SHARED / "data"
    if not path.is_dir():
        pytest.skip(f"{path} is absent (the shared data folder sits beside the repo in CI only)")
    return path


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """One tokenizer/token cache for the whole session, so a tokenizer is trained once."""
    return tmp_path_factory.mktemp("cache")


def small_model_config(family: str = "llama", **overrides):
    """A small model shape for unit tests (GPT-2: biases and a tied head, as the family has)."""
    from model.config import ModelConfig

    shape = dict(family=family, vocab_size=50, max_seq_len=16, d_model=32, n_layers=1, n_heads=4)
    if family == "gpt2":
        shape.update(bias=True, tie_embeddings=True)
    return ModelConfig(**{**shape, **overrides})


def run_cli(module: str, *args, timeout: int = 300, **kwargs):
    """``python -m <module> args`` from the repository root, output captured as text."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", module, *map(str, args)]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, **kwargs)


def reseal_checkpoint(checkpoint: Path) -> None:
    """Record the files of ``checkpoint`` as they now are in its ``meta.json`` (sizes and content checksums),
    as whoever rewrote them could: for tests whose subject is what a reader does with such files, not the
    integrity check that would otherwise stop them first."""
    import json

    from run import checksums

    meta_file = checkpoint / "meta.json"
    meta = json.loads(meta_file.read_text())
    names = sorted(p.relative_to(checkpoint).as_posix() for p in checkpoint.rglob("*") if p.is_file())
    names = [name for name in names if name != "meta.json"]
    if "files" in meta:
        meta["files"] = {name: (checkpoint / name).stat().st_size for name in names}
    if "checksums" in meta:
        meta["checksums"] = checksums.digests(checkpoint, names)
    meta_file.write_text(json.dumps(meta))
