from __future__ import annotations

import numpy as np
import pytest
import torch

from data.packing import PackedDataset, pack_documents, token_dtype


class CharTokenizer:
    vocab_size, eos_id = 300, 0

    def encode_batch(self, texts):
        return [[ord(c) for c in t] for t in texts]


def test_packing_puts_eos_after_every_document():
    tokens = pack_documents(["ab", "", "c"], CharTokenizer(), chunk=2)
    assert tokens.tolist() == [97, 98, 0, 0, 99, 0]
    assert tokens.dtype == np.uint16
    assert pack_documents([], CharTokenizer()).size == 0


def test_token_dtype_fits_the_vocabulary():
    assert token_dtype(512) == np.uint16 and token_dtype(65535) == np.uint16
    assert token_dtype(65536) == np.uint16  # ids 0..65535 still fit
    assert token_dtype(65537) == np.uint32 and token_dtype(128_256) == np.uint32


def test_windows_overlap_by_one_token():
    ds = PackedDataset(np.arange(11, dtype=np.uint16), seq_len=4)
    assert len(ds) == 2  # (11 - 1) // 4
    assert ds[0].tolist() == [0, 1, 2, 3, 4] and ds[1].tolist() == [4, 5, 6, 7, 8]
    assert ds[0].dtype == torch.int64 and ds[0].shape == (5,)
    assert ds[0][1:].tolist() == ds[0].tolist()[1:]  # targets = inputs shifted by one
    with pytest.raises(IndexError):
        ds[2]
    assert len(PackedDataset(np.arange(4, dtype=np.uint16), seq_len=4)) == 0
