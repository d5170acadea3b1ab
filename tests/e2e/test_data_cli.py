"""Data sources end to end through ``python -m pretrain.train``: a weighted mixture of two local
streamed sources (loader workers, per-source token counts, exact resume after a stop), and the
prepared-shard path (``python -m data.prepare`` -> ``data.source = prepared``, fingerprint checked
at resume)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.e2e.test_train_cli import losses, overrides, train


def _documents(shared_data: Path) -> list[str]:
    """Short documents: the speeches of tinyshakespeare (blank-line separated)."""
    text = (shared_data / "tinyshakespeare" / "input.txt").read_text()
    return [p.strip() for p in text.split("\n\n") if len(p.strip()) > 40]


@pytest.fixture(scope="module")
def two_sources(tmp_path_factory, shared_data) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp("sources")
    docs = _documents(shared_data)
    a, b, val = root / "a.jsonl", root / "b", root / "val.txt"
    a.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[:3000]))
    b.mkdir()
    for i, d in enumerate(docs[3000:4000]):  # the other source: one .txt file per document
        (b / f"{i:04d}.txt").write_text(d.upper())
    val.write_text("\n\n".join(docs[4000:4400]))
    return a, b, val


def _mixture(run_dir: Path, cache_dir: Path, sources, **extra) -> list[str]:
    a, b, val = sources
    args = overrides(
        run_dir,
        cache_dir,
        **{
            "data.source": "mixture",
            "data.val_path": str(val),
            "data.num_workers": 2,
            "data.tokenizer_sample_docs": 500,
            "train.max_steps": 12,
            "train.batch_size": 8,
            "train.micro_batch_size": 4,
            "checkpoint.every": 0,
            "eval.every": 6,
            **extra,
        },
    )
    args += [
        "--set",
        f'data.mixture=[{{source = "local", path = "{a}", weight = 3.0}}, '
        f'{{source = "local", path = "{b}", weight = 1.0}}]',
    ]
    return args


def test_mixture_of_two_local_sources_trains_counts_tokens_and_resumes_exactly(tmp_path, cache_dir, two_sources):
    whole = tmp_path / "whole"
    proc = train(_mixture(whole, cache_dir, two_sources))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = losses(whole)
    last = rows[12]
    counts = {k: v for k, v in last.items() if k.startswith("data/tokens/")}
    assert len(counts) == 2 and sum(counts.values()) == last["tokens"], counts
    share_a = counts[f"data/tokens/{two_sources[0]}"] / last["tokens"]
    assert 0.5 < share_a < 0.95, f"source a has 3/4 of the tokens drawn (documents differ in length): {share_a:.2f}"

    split = tmp_path / "split"
    first = train(_mixture(split, cache_dir, two_sources, **{"train.stop_at": 5}))
    assert first.returncode == 0, first.stderr[-3000:]
    second = train(_mixture(split, cache_dir, two_sources))
    assert second.returncode == 0 and "resumed from" in second.stdout, second.stderr[-3000:]
    again = losses(split)
    assert [again[s]["loss"] for s in range(6, 13)] == [rows[s]["loss"] for s in range(6, 13)], (
        "the stream continues where it stopped"
    )
    assert again[12]["data/tokens/" + str(two_sources[0])] == last["data/tokens/" + str(two_sources[0])]


def test_prepared_shards_train_and_a_changed_corpus_is_refused_at_resume(tmp_path, cache_dir, two_sources):
    a, b, _ = two_sources
    shards = tmp_path / "shards"
    prep = [
        sys.executable,
        "-m",
        "data.prepare",
        "--source",
        "local",
        "--path",
        str(b),
        "--out",
        str(shards),
        "--vocab-size",
        "512",
        "--cache-dir",
        str(cache_dir),
    ]
    proc = subprocess.run(prep, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    index = json.loads((shards / "index.json").read_text())
    assert index["dtype"] == "uint16" and index["splits"]["train"]["documents"] > 0

    run_dir = tmp_path / "run"
    settings = {
        "data.source": "prepared",
        "data.path": str(shards),
        "train.max_steps": 6,
        "checkpoint.every": 0,
        "eval.every": 3,
    }
    first = train(overrides(run_dir, cache_dir, **settings, **{"train.stop_at": 3}))
    assert first.returncode == 0, first.stderr[-3000:]
    assert "prepared shards" in first.stdout
    # the same directory rewritten from other documents with the same tokenizer: resuming must
    # refuse, not train on a different stream
    tokenizer = tmp_path / "tokenizer.model"
    tokenizer.write_bytes((shards / index["tokenizer"]["file"]).read_bytes())
    rewrite = [*prep[:6], str(a), "--out", str(shards), "--overwrite", "--tokenizer", str(tokenizer)]
    proc = subprocess.run(rewrite, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    second = train(overrides(run_dir, cache_dir, **settings))
    assert second.returncode == 2 and "changed since checkpoint" in second.stderr, second.stderr[-2000:]


def test_document_masking_trains_through_the_cli(tmp_path, cache_dir, two_sources):
    first = {}
    for masked in (False, True):
        run_dir = tmp_path / f"masked_{masked}"
        proc = train(
            overrides(
                run_dir,
                cache_dir,
                **{
                    "data.source": "local",
                    "data.path": str(two_sources[0]),
                    "data.document_masking": masked,
                    "train.max_steps": 2,
                    "checkpoint.every": 0,
                    "eval.every": 0,
                    "eval.sample_tokens": 0,
                },
            )
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        first[masked] = losses(run_dir)[1]["loss"]
    # short documents: most 64-token windows hold several, so masking changes the very first loss
    assert first[True] != first[False]
