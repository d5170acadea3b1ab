"""Mixtures of streamed sources: weighted by documents or by tokens (the default), exact resume, per-source
token counts, checkpoints from before weightings existed, and world-size changes under token weighting."""

from __future__ import annotations

import collections
import itertools
import math
from dataclasses import replace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from core.errors import ConfigError
from data import stream_sources
from data.stream_resume import find_states
from data.streaming import StreamConfig, StreamDataset, build_stream_loader, token_counts
from tests.data.streams import EOS, ByteTokenizer, T, epoch_docs, make_corpus, stop_and_resume

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")  # torchdata's, on every loader


def mixture_fixture(tmp_path, weighting: str = "documents") -> tuple[StreamConfig, str, str]:
    a, b = tmp_path / "a", tmp_path / "b.parquet"
    make_corpus(a, sizes=(20, 20), alphabet="abcdefghijklm")
    rng = np.random.default_rng(1)
    pq.write_table(
        pa.table(
            {"text": ["".join(rng.choice(list("nopqrstuvwxyz"), size=int(rng.integers(3, 60)))) for _ in range(25)]}
        ),
        b,
    )
    cfg = StreamConfig(mixture={str(a): 0.7, str(b): 0.3}, shuffle_window=16, seed=11, mixture_weighting=weighting)
    return cfg, str(a), str(b)


def test_document_weighted_mixture_follows_the_weights_and_the_seed(tmp_path):
    cfg, a, _ = mixture_fixture(tmp_path, "documents")
    n, p = 3000, 0.7
    docs = [d for d, _ in zip(StreamDataset(cfg).documents(0, 1), range(n))]
    k = sum(d.source == a for d in docs)
    sigma = math.sqrt(n * p * (1 - p))  # binomial; 5 sigma: a false alarm ~ 1 in 1.7 million seeds
    assert abs(k - n * p) <= 5 * sigma, (k, n * p, sigma)
    again = [d.id for d, _ in zip(StreamDataset(cfg).documents(0, 1), range(300))]
    other = [d.id for d, _ in zip(StreamDataset(replace(cfg, seed=12)).documents(0, 1), range(300))]
    assert again == [d.id for d in docs[:300]] and other != again


@pytest.mark.parametrize("weighting", ["tokens", "documents"])
def test_mixture_resumes_exactly_and_counts_tokens_per_source(weighting, tmp_path, monkeypatch):
    monkeypatch.setattr(stream_sources, "READ_BATCH", 7)
    cfg, a, b = mixture_fixture(tmp_path, weighting)
    stop = 23
    run = stop_and_resume(cfg, stop=stop, steps=60, batch=4, num_workers=2)
    assert run.resumed_counts == run.counts
    assert all(torch.equal(x, y) for x, y in zip(run.out[stop:], run.after))
    loader, out = run.loader, run.out
    # attribute every target token: letters a-m come from source a, n-z from b, an EOS from its document
    expected, mixed = {a: 0, b: 0}, 0
    for seq in (s for batch in out for s in batch.tolist()):
        owners = {a if chr(prev if t == EOS else t) <= "m" else b for prev, t in itertools.pairwise(seq)}
        for prev, t in itertools.pairwise(seq):
            expected[a if chr(prev if t == EOS else t) <= "m" else b] += 1
        mixed += len(owners) > 1
    assert loader.token_counts() == token_counts(loader.state_dict()) == expected
    assert expected[a] > expected[b] > 0
    if weighting == "tokens":  # one source per sequence, each source within a sequence per worker of its weight
        assert mixed == 0
        assert abs(expected[a] - 0.7 * sum(expected.values())) <= 2 * T
    else:
        assert mixed > 0


def without_weighting(obj):
    """A loader state as written before data.mixture_weighting existed: no "weighting" in the worker states."""
    if isinstance(obj, dict):
        return {k: without_weighting(v) for k, v in obj.items() if k != "weighting"}
    if isinstance(obj, list):
        return [without_weighting(v) for v in obj]
    return obj


def test_a_document_weighted_state_from_before_weightings_resumes_as_it_was(tmp_path):
    """A checkpoint written before data.mixture_weighting existed continues its document-weighted stream exactly
    under today's default (tokens) and keeps its format; a state that records its weighting must match."""
    cfg, _, _ = mixture_fixture(tmp_path, "documents")
    stop, default = 11, replace(cfg, mixture_weighting="tokens")
    run = stop_and_resume(cfg, stop=stop, steps=30, batch=4, num_workers=2, resume_cfg=default, edit=without_weighting)
    assert all("weighting" not in s and "draws" in s for s in find_states(without_weighting(run.state)))
    assert all(torch.equal(x, y) for x, y in zip(run.out[stop:], run.after))
    assert all("weighting" not in s for s in find_states(run.resumed.state_dict()))  # that stream to the end
    with pytest.raises(
        ConfigError,
        match=r"^data\.mixture_weighting: the checkpoint's mixture weighted documents, this run tokens; "
        r"set data\.mixture_weighting = 'documents' to resume it$",
    ):
        build_stream_loader(default, ByteTokenizer(), seq_len=T, batch_size=4, num_workers=2).load_state_dict(run.state)


def test_token_weighted_positions_rederive_on_another_world_size(tmp_path):
    """2 loader workers -> 3: per source and epoch, the documents the old workers opened (half-packed ones
    included) and the rest on the new workers are each document once (worker 1 is into b's second epoch).
    The sources' shuffles are keyed by their names, here paths under tmp_path, so worker 1 runs until it
    reaches b's second epoch rather than a fixed count."""
    cfg, a, b = mixture_fixture(tmp_path, "tokens")
    tok, states, before = ByteTokenizer(), [], collections.defaultdict(list)
    for w, n in ((0, 9), (1, 400)):
        ds = StreamDataset(cfg, tok, seq_len=T)
        mixer = ds._begin(w, 2, tokenize=True)
        mixer.opened = []  # what packing opens, in order (documents() reads the same list)
        for _ in range(n):  # worker 1 runs until it opens a document of b's second epoch
            mixer.sequence(T)
            if w == 1 and any(d.source == b and d.epoch == 1 for d in mixer.opened):
                break
        states.append(mixer.state())
        for doc in mixer.opened:
            before[doc.source, doc.epoch].append(doc.id)
    assert before[b, 1] and not before[a, 1]
    new = StreamDataset(cfg, tok, seq_len=T, resume_from=[states])
    after = collections.defaultdict(list)
    for w in range(3):  # until every source is into its epoch 2 (sources run through epochs at their own pace)
        passed: set[str] = set()
        for doc in new.documents(w, 3):
            if doc.epoch < 2:
                after[doc.source, doc.epoch].append(doc.id)
                continue
            passed.add(doc.source)
            if len(passed) == 2:
                break
    for source in (a, b):
        ids = sorted(d.id for d in epoch_docs(StreamDataset(replace(cfg, mixture={source: 1.0})), 0))
        for epoch in (0, 1):
            assert sorted(before[source, epoch] + after[source, epoch]) == ids, (source, epoch)
    assert token_counts(new.state_dict()) == token_counts(states)
    assert next(new.sequences(2, 3)).shape == (T + 1,)
