from __future__ import annotations

import numpy as np
import pytest
import torch

from core.errors import ConfigError
from data.loader import BatchLoader, eval_batches
from data.packing import PackedDataset


def dataset(n=40, t=3):
    """n sequences of length t whose first token identifies them (3 * index)."""
    return PackedDataset(np.arange(n * t + 1, dtype=np.uint32), seq_len=t)


def global_batches(loader, steps):
    return [torch.cat(loader.next_step()) for _ in range(steps)]


def test_global_batch_is_the_same_for_any_world_size_and_micro_batch():
    ds = dataset()
    single = global_batches(BatchLoader(ds, batch_size=8, micro_batch_size=8, seed=3), 12)
    accum = global_batches(BatchLoader(ds, batch_size=8, micro_batch_size=2, seed=3), 12)
    ranks = [BatchLoader(ds, batch_size=8, micro_batch_size=2, rank=r, world_size=2, seed=3) for r in range(2)]
    two = [torch.cat([torch.cat(r.next_step()) for r in ranks]) for _ in range(12)]
    for a, b, c in zip(single, accum, two):
        assert torch.equal(a, b) and torch.equal(a, c)
    step = ranks[0].next_step()
    assert ranks[0].accum_steps == 2 and len(step) == 2 and step[0].shape == (2, 4)


def test_seed_changes_the_order():
    a = global_batches(BatchLoader(dataset(), batch_size=8, micro_batch_size=8, seed=0), 1)[0]
    b = global_batches(BatchLoader(dataset(), batch_size=8, micro_batch_size=8, seed=1), 1)[0]
    assert not torch.equal(a, b)


def test_epochs_cover_every_sequence_once_with_a_new_order():
    ds = dataset(n=16)
    loader = BatchLoader(ds, batch_size=4, micro_batch_size=4, seed=0)
    firsts = [b[:, 0].tolist() for b in global_batches(loader, 8)]
    flat = [x for batch in firsts for x in batch]
    epoch0, epoch1 = flat[:16], flat[16:]
    assert sorted(epoch0) == sorted(epoch1) == [3 * i for i in range(16)]
    assert epoch0 != epoch1


def test_a_step_may_straddle_two_epochs():
    ds = dataset(n=5)
    firsts = [b[:, 0].tolist() for b in global_batches(BatchLoader(ds, batch_size=2, micro_batch_size=1, seed=4), 5)]
    flat = [x for batch in firsts for x in batch]
    assert sorted(flat[:5]) == sorted(flat[5:]) == [0, 3, 6, 9, 12]


def test_unshuffled_order_is_sequential():
    loader = BatchLoader(dataset(n=6), batch_size=4, micro_batch_size=2, shuffle=False)
    assert [b[:, 0].tolist() for b in global_batches(loader, 2)] == [[0, 3, 6, 9], [12, 15, 0, 3]]


def test_state_dict_resume_is_exact_and_weights_only_safe(tmp_path):
    ds = dataset()
    a = BatchLoader(ds, batch_size=6, micro_batch_size=3, seed=7)
    global_batches(a, 9)
    torch.save(a.state_dict(), tmp_path / "s.pt")
    state = torch.load(tmp_path / "s.pt", weights_only=True)
    assert state["consumed"] == 54 and all(isinstance(v, (int, str)) for v in state.values())
    b = BatchLoader(ds, batch_size=6, micro_batch_size=3, seed=7)
    b.load_state_dict(state)
    for x, y in zip(global_batches(a, 10), global_batches(b, 10)):
        assert torch.equal(x, y)


def test_resume_on_a_different_world_size():
    ds = dataset()
    a = BatchLoader(ds, batch_size=8, micro_batch_size=4, seed=2)
    global_batches(a, 7)
    ranks = [BatchLoader(ds, batch_size=8, micro_batch_size=2, rank=r, world_size=2, seed=2) for r in range(2)]
    for r in ranks:
        r.load_state_dict(a.state_dict())
    for _ in range(6):
        assert torch.equal(torch.cat(a.next_step()), torch.cat([torch.cat(r.next_step()) for r in ranks]))


def test_resume_refuses_a_different_dataset():
    a = BatchLoader(dataset(), batch_size=6, micro_batch_size=3, seed=7)
    with pytest.raises(
        ConfigError, match=r"^data\.seq_len: the training split has 41 sequences but the checkpoint's loader had 40"
    ):
        BatchLoader(dataset(n=41), batch_size=6, micro_batch_size=3, seed=7).load_state_dict(a.state_dict())


def test_batch_divisibility_error_names_the_fields():
    with pytest.raises(
        ConfigError,
        match=r"^train\.batch_size: 12 is not divisible by train\.micro_batch_size \(5\) x world size \(1\)$",
    ):
        BatchLoader(dataset(), batch_size=12, micro_batch_size=5)
    with pytest.raises(
        ConfigError,
        match=r"^train\.batch_size: 8 is not divisible by train\.micro_batch_size \(2\) x world size \(3\)$",
    ):
        BatchLoader(dataset(), batch_size=8, micro_batch_size=2, world_size=3)
    with pytest.raises(ConfigError, match=r"^train\.micro_batch_size: must be >= 1, got 0$"):
        BatchLoader(dataset(), batch_size=8, micro_batch_size=0)


def test_eval_batches_are_the_first_sequences_in_order():
    got = list(eval_batches(dataset(), batch_size=4, max_batches=2))
    assert [b[:, 0].tolist() for b in got] == [[0, 3, 6, 9], [12, 15, 18, 21]]
    short = list(eval_batches(dataset(n=5), batch_size=4, max_batches=3))
    assert [len(b) for b in short] == [4, 1]
