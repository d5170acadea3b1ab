from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data.config import DataConfig
from data.embedded import iter_embedded
from data.sources import iter_local, resolve_paths
from model.errors import ConfigError


def test_bom_and_crlf_are_normalised(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"\xef\xbb\xbfFirst line\r\nsecond\rthird\r\n")
    (doc,) = list(iter_local(str(tmp_path / "a.txt")))
    assert doc.text == "First line\nsecond\nthird\n" and doc.id == "a.txt"


def test_jsonl_parquet_and_folders(tmp_path):
    sub = tmp_path / "corpus" / "part"
    sub.mkdir(parents=True)
    (sub / "b.jsonl").write_text(json.dumps({"text": "one\r\n", "meta": 1}) + "\n\n" + json.dumps({"text": "two"}) + "\n")
    pq.write_table(pa.table({"text": ["three", None, "four"], "id": [1, 2, 3]}), sub / "c.parquet")
    (tmp_path / "corpus" / "a.txt").write_text("zero")
    (tmp_path / "corpus" / "ignored.md").write_text("not data")
    docs = list(iter_local(str(tmp_path / "corpus")))
    assert [d.text for d in docs] == ["zero", "one\n", "two", "three", "four"]
    assert [d.id for d in docs] == ["a.txt", "part/b.jsonl:1", "part/b.jsonl:3", "part/c.parquet:0", "part/c.parquet:2"]
    assert resolve_paths(str(tmp_path / "corpus" / "**" / "*.jsonl")) == [sub / "b.jsonl"]


def test_missing_path_and_bad_records(tmp_path):
    with pytest.raises(ConfigError, match=r"^data\.path: .* does not exist; expected a file, folder or glob of \.txt, \.jsonl or \.parquet$"):
        DataConfig(source="local", path=str(tmp_path / "nope")).validate()
    with pytest.raises(ConfigError, match=r"^data\.path: .* matches no data files; expected"):
        DataConfig(source="local", path=str(tmp_path / "*.txt")).validate()
    with pytest.raises(ConfigError, match=r"^data\.path: required"):
        DataConfig(source="local").validate()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": broken\n')
    with pytest.raises(ConfigError, match=r"bad\.jsonl:2 is not valid JSON"):
        list(iter_local(str(bad)))
    bad.write_text('{"body": "no text field"}\n')
    with pytest.raises(ConfigError, match=r"^data\.text_field: .*bad\.jsonl:1 has no string field 'text'"):
        list(iter_local(str(bad)))


def test_embedded_corpus_ships_42_plays():
    docs = list(iter_embedded())
    assert len(docs) == 42
    assert len({d.id for d in docs}) == 42
    assert sum(len(d.text) for d in docs) > 4_500_000
    hamlet = next(d for d in docs if d.id.startswith("hamlet"))
    assert hamlet.text.startswith("HAMLET, PRINCE OF DENMARK") and "\r" not in hamlet.text


def test_real_novels_with_bom_and_crlf(shared_data):
    novel = shared_data / "english_novels" / "Cbronte_Jane_1847.txt"
    raw = novel.read_bytes()
    assert raw.startswith(b"\xef\xbb\xbf") and b"\r\n" in raw
    (doc,) = list(iter_local(str(novel)))
    assert doc.text.startswith(" Jane Eyre\nby Charlotte Bronte\n") and "\r" not in doc.text and "\ufeff" not in doc.text
    assert doc.text.count("\n") == raw.count(b"\r\n")
