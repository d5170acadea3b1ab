from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from core.errors import ConfigError
from data.config import DataConfig
from data.embedded import iter_embedded
from data.sources import iter_documents, iter_local, resolve_paths


def test_bom_and_crlf_are_normalised(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"\xef\xbb\xbfFirst line\r\nsecond\rthird\r\n\r\n")
    (doc,) = list(iter_local(str(tmp_path / "a.txt")))
    assert doc.text == "First line\nsecond\nthird\n\n" and doc.id == "a.txt"


def test_jsonl_parquet_and_folders(tmp_path):
    sub = tmp_path / "corpus" / "part"
    sub.mkdir(parents=True)
    (sub / "b.jsonl").write_text(
        json.dumps({"text": "one\r\n", "meta": 1}) + "\n\n" + json.dumps({"text": "two"}) + "\n"
    )
    pq.write_table(pa.table({"text": ["three", None, "four"], "id": [1, 2, 3]}), sub / "c.parquet")
    (tmp_path / "corpus" / "a.txt").write_text("zero")
    (tmp_path / "corpus" / "ignored.md").write_text("not data")
    docs = list(iter_documents(DataConfig(source="local", path=str(tmp_path / "corpus"))))
    assert [d.text for d in docs] == ["zero", "one\n", "two", "three", "four"]
    assert [d.id for d in docs] == ["a.txt", "part/b.jsonl:1", "part/b.jsonl:3", "part/c.parquet:0", "part/c.parquet:2"]


def test_text_field_selects_the_column(tmp_path):
    (tmp_path / "a.jsonl").write_text(json.dumps({"body": "x", "text": "ignored"}) + "\n")
    pq.write_table(pa.table({"body": ["y"]}), tmp_path / "b.parquet")
    docs = list(iter_documents(DataConfig(source="local", path=str(tmp_path), text_field="body")))
    assert [d.text for d in docs] == ["x", "y"]


def test_globs_resolve_sorted_with_ids_relative_to_the_fixed_prefix(tmp_path):
    for name in ("z/b.txt", "a/c.txt", "a/deep/d.txt", "a/e.jsonl"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text('{"text": "t"}' if name.endswith("jsonl") else name)
    pattern = str(tmp_path / "**" / "*.txt")
    assert resolve_paths(pattern) == [tmp_path / "a/c.txt", tmp_path / "a/deep/d.txt", tmp_path / "z/b.txt"]
    assert [d.id for d in iter_local(pattern)] == [
        "a/c.txt",
        "a/deep/d.txt",
        "z/b.txt",
    ]  # not absolute: the split survives a move
    assert resolve_paths(str(tmp_path / "a" / "*")) == [tmp_path / "a/c.txt", tmp_path / "a/e.jsonl"]
    assert resolve_paths(str(tmp_path / "a")) == [
        tmp_path / "a/c.txt",
        tmp_path / "a/deep/d.txt",
        tmp_path / "a/e.jsonl",
    ]


def test_bad_paths_name_data_path(tmp_path):
    allowed = r"expected a file, folder or glob of \.txt, \.jsonl or \.parquet$"
    with pytest.raises(ConfigError, match=rf"^data\.path: .*nope' does not exist; {allowed}"):
        DataConfig(source="local", path=str(tmp_path / "nope")).validate()
    with pytest.raises(ConfigError, match=rf"^data\.path: .* matches no data files; {allowed}"):
        DataConfig(source="local", path=str(tmp_path / "*.txt")).validate()
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"^data\.path: .*empty' matches no data files"):
        DataConfig(source="local", path=str(tmp_path / "empty")).validate()
    (tmp_path / "notes.md").write_text("x")
    with pytest.raises(ConfigError, match=r"^data\.path: .*notes\.md' is not a \.txt, \.jsonl or \.parquet file$"):
        DataConfig(source="local", path=str(tmp_path / "notes.md")).validate()
    with pytest.raises(ConfigError, match=r"^data\.path: required"):
        DataConfig(source="local").validate()


def test_other_config_checks():
    with pytest.raises(
        ConfigError,
        match=r"^data\.source: 'hub' is not one of embedded, local, prepared, "
        r"slimpajama, fineweb-edu, openwebtext, pg19, mixture$",
    ):
        DataConfig(source="hub").validate()
    with pytest.raises(ConfigError, match=r"^data\.seq_len: must be >= 1, got 0$"):
        DataConfig(seq_len=0).validate()
    for bad in (0.0, 1.0, -0.1):
        with pytest.raises(ConfigError, match=r"^data\.val_fraction: must be in \(0\.0, 1\.0\)"):
            DataConfig(val_fraction=bad).validate()
    with pytest.raises(ConfigError, match=r"^data\.tokenizer: no such file 'missing\.model'"):
        DataConfig(tokenizer="missing.model").validate()
    with pytest.raises(ConfigError, match=r"^data\.vocab_size: 100 is too small for a trained tokenizer"):
        DataConfig(vocab_size=100).validate()
    DataConfig().validate()


def test_malformed_records_name_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": broken\n')
    with pytest.raises(ConfigError, match=r"^data\.path: .*bad\.jsonl:2 is not valid JSON"):
        list(iter_local(str(bad)))
    bad.write_text('{"text": "ok"}\n\n{"body": "no text field"}\n')
    with pytest.raises(ConfigError, match=r"^data\.text_field: .*bad\.jsonl:3 has no string field 'text'$"):
        list(iter_local(str(bad)))
    bad.write_text('["a list"]\n')
    with pytest.raises(ConfigError, match=r"bad\.jsonl:1 has no string field"):
        list(iter_local(str(bad)))
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"^data\.path: .*latin1\.txt is not UTF-8 text"):
        list(iter_local(str(tmp_path / "latin1.txt")))


def test_malformed_parquet(tmp_path):
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "a.parquet")
    with pytest.raises(ConfigError, match=r"^data\.text_field: .*a\.parquet has no column 'text' \(columns: body\)$"):
        list(iter_local(str(tmp_path / "a.parquet")))
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "a.parquet")
    with pytest.raises(
        ConfigError, match=r"^data\.text_field: column 'text' of .*a\.parquet holds int64, not strings$"
    ):
        list(iter_local(str(tmp_path / "a.parquet")))
    (tmp_path / "a.parquet").write_bytes(b"not parquet")
    with pytest.raises(ConfigError, match=r"^data\.path: .*a\.parquet is not a readable parquet file"):
        list(iter_local(str(tmp_path / "a.parquet")))


def test_embedded_corpus_ships_42_plays():
    docs = list(iter_embedded())
    assert len(docs) == 42 and len({d.id for d in docs}) == 42
    assert [d.id for d in docs] == sorted(d.id for d in docs) and all(d.id.endswith("_gut") for d in docs)
    assert sum(len(d.text) for d in docs) > 4_500_000
    hamlet = next(d for d in docs if d.id == "hamlet_gut")
    assert hamlet.text.startswith("HAMLET, PRINCE OF DENMARK") and "\r" not in hamlet.text


def test_real_novels_with_bom_and_crlf(shared_data):
    folder = shared_data / "english_novels"
    files = sorted(folder.glob("Ford_*.txt"))
    assert len(files) == 2
    docs = list(iter_documents(DataConfig(source="local", path=str(folder / "Ford_*.txt"))))
    assert [d.id for d in docs] == [f.name for f in files]
    for f, doc in zip(files, docs):
        raw = f.read_bytes()
        assert raw.startswith(b"\xef\xbb\xbf") and b"\r\n" in raw
        assert "\r" not in doc.text and "\ufeff" not in doc.text
        assert doc.text == raw[3:].decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")
        assert doc.text.count("\n") == raw.count(b"\r\n") + raw.replace(b"\r\n", b"").count(b"\r") + raw.replace(
            b"\r\n", b""
        ).count(b"\n")
    jane = next(iter_local(str(folder / "Cbronte_Jane_1847.txt")))
    assert jane.text.startswith(" Jane Eyre\nby Charlotte Bronte\n")
