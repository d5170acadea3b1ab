from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from core.rng import rng_state, set_rng_state
from pretrain import checkpoint as ckpt


def _writer(payload: bytes):
    def write(directory):
        (directory / "model.bin").write_bytes(payload)

    return write


def test_save_is_atomic_and_latest_ignores_incomplete(tmp_path):
    ckpt.save_checkpoint(tmp_path, 10, write_engine_state=_writer(b"a"), trainer_state={"step": 10}, keep=0)
    # an interrupted write by a dead process: temp dir with partial content, never "latest"
    stale = ckpt.checkpoint_root(tmp_path) / ".tmp-step_00000020-999999999"
    stale.mkdir()
    (stale / "model.bin").write_bytes(b"partial")
    # a step dir without its trainer state is not complete either
    (ckpt.checkpoint_root(tmp_path) / "step_00000030").mkdir()
    assert ckpt.latest_checkpoint(tmp_path).name == "step_00000010"
    ckpt.save_checkpoint(tmp_path, 40, write_engine_state=_writer(b"b"), trainer_state={"step": 40}, keep=0)
    assert ckpt.latest_checkpoint(tmp_path).name == "step_00000040"
    assert not stale.exists(), "leftovers of dead writers are cleaned on the next save"


def test_keep_last_n(tmp_path):
    for step in (5, 10, 15, 20):
        ckpt.save_checkpoint(tmp_path, step, write_engine_state=_writer(b"x"), trainer_state={"step": step}, keep=2)
    assert [s for s, _ in ckpt.complete_checkpoints(tmp_path)] == [15, 20]


def test_resaving_a_step_replaces_it(tmp_path):
    ckpt.save_checkpoint(tmp_path, 5, write_engine_state=_writer(b"old"), trainer_state={"step": 5}, keep=0)
    path = ckpt.save_checkpoint(tmp_path, 5, write_engine_state=_writer(b"new"), trainer_state={"step": 5}, keep=0)
    assert (path / "model.bin").read_bytes() == b"new"
    assert len(list(ckpt.checkpoint_root(tmp_path).iterdir())) == 1


def test_rng_state_round_trips_under_weights_only(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    state = rng_state()
    ckpt.save_checkpoint(tmp_path, 1, write_engine_state=_writer(b""), trainer_state={"rng": state}, keep=0)
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    loaded = ckpt.load_trainer_state(ckpt.latest_checkpoint(tmp_path))  # weights_only=True inside
    set_rng_state(loaded["rng"])
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


def test_trainer_state_rejects_arbitrary_objects(tmp_path):
    from fractions import Fraction  # any class outside torch's allowlist

    ckpt.save_checkpoint(tmp_path, 1, write_engine_state=_writer(b""), trainer_state={"x": Fraction(1, 3)}, keep=0)
    with pytest.raises(Exception, match="(?i)refused to unpickle.*allow-list"):
        ckpt.load_trainer_state(ckpt.latest_checkpoint(tmp_path))


def test_untie_keeps_one_name_per_tied_tensor():
    from torch import nn

    emb = nn.Embedding(5, 3)
    head = nn.Linear(3, 5, bias=False)
    head.weight = emb.weight
    model = nn.ModuleDict({"emb": emb, "head": head})
    copies = {
        "emb.weight": emb.weight.detach().clone(),
        "head.weight": emb.weight.detach().clone(),
    }  # a gathered state dict
    assert list(ckpt.untie(copies, model)) == ["emb.weight"]
    shared = {"a": emb.weight.detach(), "b": emb.weight.detach(), "c": torch.zeros(5, 3)}  # zero_to_fp32 style
    assert list(ckpt.untie(shared)) == ["a", "c"]
    assert list(ckpt.untie(copies)) == ["emb.weight", "head.weight"], "separate storage without a model: both kept"
