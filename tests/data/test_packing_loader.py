from __future__ import annotations

import numpy as np
import pytest
import torch

from data.build import build_corpus, split_documents, unigram_entropy
from data.config import DataConfig
from data.loader import BatchLoader, eval_batches
from data.packing import PackedDataset, pack_documents, token_dtype
from data.sources import Document
from model.errors import ConfigError


class CharTokenizer:
    vocab_size, eos_id = 300, 0

    def encode_batch(self, texts):
        return [[ord(c) for c in t] for t in texts]


def test_packing_puts_eos_after_every_document():
    tokens = pack_documents(["ab", "", "c"], CharTokenizer(), chunk=2)
    assert tokens.tolist() == [97, 98, 0, 0, 99, 0] and tokens.dtype == np.uint16
    assert token_dtype(70000) == np.uint32


def test_windows_overlap_by_one_token():
    ds = PackedDataset(np.arange(11, dtype=np.uint16), seq_len=4)
    assert len(ds) == 2
    assert ds[0].tolist() == [0, 1, 2, 3, 4] and ds[1].tolist() == [4, 5, 6, 7, 8]
    assert ds[0].dtype == torch.int64
    with pytest.raises(IndexError):
        ds[2]


def dataset(n=40, t=3):
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
    assert ranks[0].accum_steps == 2


def test_epochs_cover_every_sequence_once_with_a_new_order():
    ds = dataset(n=16)
    loader = BatchLoader(ds, batch_size=4, micro_batch_size=4, seed=0)
    firsts = [b[:, 0].tolist() for b in global_batches(loader, 8)]
    epoch0, epoch1 = sum(firsts[:4], []), sum(firsts[4:], [])
    assert sorted(epoch0) == sorted(epoch1) == [3 * i for i in range(16)]
    assert epoch0 != epoch1


def test_state_dict_resume_is_exact_and_weights_only_safe(tmp_path):
    ds = dataset()
    a = BatchLoader(ds, batch_size=6, micro_batch_size=3, seed=7)
    global_batches(a, 9)
    torch.save(a.state_dict(), tmp_path / "s.pt")
    b = BatchLoader(ds, batch_size=6, micro_batch_size=3, seed=7)
    b.load_state_dict(torch.load(tmp_path / "s.pt", weights_only=True))
    for x, y in zip(global_batches(a, 10), global_batches(b, 10)):
        assert torch.equal(x, y)
    with pytest.raises(ConfigError, match="the data or data.seq_len changed"):
        BatchLoader(dataset(n=41), batch_size=6, micro_batch_size=3, seed=7).load_state_dict(a.state_dict())


def test_batch_divisibility_error_names_the_fields():
    with pytest.raises(ConfigError, match=r"^train\.batch_size: 12 is not divisible by train\.micro_batch_size \(5\) x world size \(1\)$"):
        BatchLoader(dataset(), batch_size=12, micro_batch_size=5)


def test_eval_batches_are_the_first_sequences_in_order():
    got = torch.cat(list(eval_batches(dataset(), batch_size=4, max_batches=2)))
    assert got[:, 0].tolist() == [0, 3, 6, 9, 12, 15, 18, 21]


def test_split_is_by_document_and_deterministic():
    docs = [Document(f"d{i}", "x") for i in range(200)]
    train, val = split_documents(docs, 0.1)
    assert {d.id for d in train}.isdisjoint({d.id for d in val}) and len(train) + len(val) == 200
    assert 8 <= len(val) <= 35
    assert split_documents(list(reversed(docs)), 0.1)[1] == sorted(val, key=lambda d: -int(d.id[1:]))
    two_train, two_val = split_documents(docs[:2], 0.01)
    assert len(two_train) == len(two_val) == 1


def test_unigram_entropy_by_hand():
    tokens = np.array([0, 0, 1, 2], dtype=np.uint16)  # p = 1/2, 1/4, 1/4
    assert unigram_entropy(tokens, 5) == pytest.approx(0.5 * np.log(2) + 2 * 0.25 * np.log(4))


def test_build_corpus_on_the_embedded_plays(cache_dir):
    cfg = DataConfig(seq_len=128, vocab_size=512, cache_dir=str(cache_dir))
    logs = []
    a = build_corpus(cfg, vocab_size=512, log=logs.append)
    b = build_corpus(cfg, vocab_size=512, log=logs.append)
    assert a.fingerprint == b.fingerprint and np.array_equal(a.train.tokens, b.train.tokens)
    assert "(cached)" in logs[-1]
    assert a.num_documents[0] + a.num_documents[1] == 42 and a.num_documents[1] >= 1
    assert (a.train.tokens == a.tokenizer.eos_id).sum() == a.num_documents[0]
    assert 0 < a.unigram_entropy < np.log(512)
    assert a.unigram_entropy == pytest.approx(unigram_entropy(a.train.tokens, 512))
    assert build_corpus(DataConfig(seq_len=64, vocab_size=512, cache_dir=str(cache_dir)), vocab_size=512, log=logs.append).fingerprint != a.fingerprint
