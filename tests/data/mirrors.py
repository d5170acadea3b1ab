"""Local mirrors of the named hub datasets, in each repo's own file layout, compression and schema, filled with
real texts from the shared offline data (web pages, Wikipedia articles, novels). What each layout follows:

- cerebras/SlimPajama-627B: ``<split>/chunk<k>/example_<train|holdout>_<i>.jsonl.zst`` (validation and test
  files are "holdout"), zstd-compressed JSON lines ``{"text", "meta": {"redpajama_set_name"}}``, a README
  with no ``configs`` (datasets takes the splits from the folder names); as the repo's README and file URLs.
- HuggingFaceFW/fineweb-edu: ``data/<CC-MAIN dump>/train-<i>-of-<n>.parquet`` and
  ``sample/<10BT|100BT|350BT>/<i>_00000.parquet``, README ``configs`` (default = data/*/*, sample-10BT =
  sample/10BT/*, ..., one per dump), columns text, id, dump, url, date, file_path, language, language_score,
  token_count, score, int_score; as the repo's README.
- Skylion007/openwebtext: the repo was a loading script (subsets/urlsf_subset<nn>.tar), which datasets>=4
  refuses; its parquet form is config ``plain_text`` (``plain_text/train-<i>-of-<n>.parquet``), one column text.
- deepmind/pg19: also a loading script on the hub; its parquet form (as the parquet copies of the repo hold)
  is ``data/<split>-<i>-of-<n>.parquet`` with columns short_book_title, publication_date (int32), url, text.

Only the texts are real; ids, urls, dumps, scores and dates are made up in the real columns' types.
"""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq


def _clean(text: str) -> str:
    return text.replace("\r\n", "\n").replace("\r", "\n")


def web_pages(shared: Path) -> list[str]:
    """59 real web pages: OLMo's C4 samples, Dolma's CCNet and documents fixtures, a C4 theguardian.com shard."""
    folder = shared / "web_text_fixtures"
    files = [
        *sorted((folder / "olmo").glob("c4-sample.*.json.gz")),
        folder / "olmo" / "c4_100_domains_5_www.theguardian.com_00000000.jsonl.gz",
        *sorted((folder / "dolma").glob("multiple_files__*.jsonl")),
        folder / "dolma" / "provided__documents__000.json.gz",
    ]
    pages = []
    for f in files:
        opener = gzip.open if f.suffix == ".gz" else open
        with opener(f, "rt", encoding="utf-8") as fh:
            pages += [_clean(json.loads(line)["text"]) for line in fh if line.strip()]
    return [p for p in pages if p.strip()]


def wiki_articles(shared: Path, n: int = 24) -> list[str]:
    """The first ``n`` WikiText-2 test articles (split at their ' = Title = ' headings)."""
    text = _clean((shared / "wikitext2_raw_test" / "wiki.test.raw").read_text(encoding="utf-8"))
    parts = re.split(r"\n = ([^=\n]+) = \n", "\n" + text)
    return [f" = {title} = \n{body}" for title, body in zip(parts[1::2], parts[2::2])][:n]


def novels(shared: Path, n: int, chars: int) -> list[tuple[str, int, str]]:
    """(title, year, first ``chars`` characters) of the first ``n`` novels: books, far longer than web pages."""
    out = []
    for f in sorted((shared / "english_novels").glob("*_*_*.txt"))[:n]:
        _, title, year = f.stem.split("_")
        out.append((title, int(year), _clean(f.read_text(encoding="utf-8-sig"))[:chars]))
    return out


def _write_zst_jsonl(path: Path, rows: list[dict]) -> None:
    import zstandard

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(zstandard.ZstdCompressor().compress("".join(json.dumps(r) + "\n" for r in rows).encode()))


def _write_parquet(path: Path, columns: dict, schema: pa.Schema) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns, schema=schema), path)


def _readme(path: Path, configs: list[tuple[str, list[tuple[str, str]]]] | None, title: str) -> None:
    """A dataset card; ``configs``: [(config name, [(split, glob)])] as the hub's YAML header declares them."""
    lines = ["---", "language:", "- en", f"pretty_name: {title}"]
    if configs:
        lines.append("configs:")
        for name, files in configs:
            lines += [f"- config_name: {name}", "  data_files:"]
            lines += [f"  - split: {split}\n    path: {glob}" for split, glob in files]
    path.mkdir(parents=True, exist_ok=True)
    (path / "README.md").write_text("\n".join([*lines, "---", f"# {title} (local mirror)", ""]))


def _split(items: list, parts: int) -> list[list]:
    return [items[i::parts] for i in range(parts)]


def slimpajama(root: Path, shared: Path, train_files: int = 4) -> dict[str, list[str]]:
    """cerebras/SlimPajama-627B; returns {split: texts}."""
    pages, wiki = web_pages(shared), wiki_articles(shared)
    labelled = [(t, "RedPajamaC4") for t in pages[:40]] + [(t, "RedPajamaCommonCrawl") for t in pages[40:]]
    labelled += [(t, "RedPajamaWikipedia") for t in wiki[:18]]
    splits = {"train": labelled[::2] + labelled[1::4], "validation": labelled[3::8], "test": labelled[7::8]}
    for split, rows in splits.items():
        kind, n_files = ("train", train_files) if split == "train" else ("holdout", 1)
        for i, part in enumerate(_split(rows, n_files)):
            chunk = 1 + i // 2
            _write_zst_jsonl(
                root / split / f"chunk{chunk}" / f"example_{kind}_{i % 2}.jsonl.zst",
                [{"text": t, "meta": {"redpajama_set_name": label}} for t, label in part],
            )
    _readme(root, None, "SlimPajama-627B")
    return {split: [t for t, _ in rows] for split, rows in splits.items()}


FINEWEB_EDU_SCHEMA = pa.schema(
    [
        ("text", pa.string()),
        ("id", pa.string()),
        ("dump", pa.string()),
        ("url", pa.string()),
        ("date", pa.string()),
        ("file_path", pa.string()),
        ("language", pa.string()),
        ("language_score", pa.float64()),
        ("token_count", pa.int64()),
        ("score", pa.float64()),
        ("int_score", pa.int64()),
    ]
)
DUMP = "CC-MAIN-2013-20"


def _fineweb_rows(texts: list[str], start: int) -> dict:
    n = range(start, start + len(texts))
    scores = [2.5 + (i * 0.37) % 2.5 for i in n]
    return {
        "text": texts,
        "id": [f"<urn:uuid:00000000-0000-0000-0000-{i:012d}>" for i in n],
        "dump": [DUMP] * len(texts),
        "url": [f"http://example.org/page/{i}" for i in n],
        "date": ["2013-05-18T05:48:54Z"] * len(texts),
        "file_path": [f"s3://commoncrawl/crawl-data/{DUMP}/segments/{i}.warc.gz" for i in n],
        "language": ["en"] * len(texts),
        "language_score": [0.9 + (i % 10) / 100 for i in n],
        "token_count": [len(t.split()) for t in texts],
        "score": scores,
        "int_score": [round(s) for s in scores],
    }


def fineweb_edu(root: Path, shared: Path, sample_files: int = 3) -> dict[str, list[str]]:
    """HuggingFaceFW/fineweb-edu; returns {config: texts} (sample-10BT, and the dump's config = default)."""
    pages = web_pages(shared)
    sample, dump = pages[:45], pages[45:]
    for i, part in enumerate(_split(sample, sample_files)):
        start = sum(len(p) for p in _split(sample, sample_files)[:i])
        _write_parquet(
            root / "sample" / "10BT" / f"{i:03d}_00000.parquet", _fineweb_rows(part, start), FINEWEB_EDU_SCHEMA
        )
    for i, part in enumerate(_split(dump, 2)):
        name = f"train-{i:05d}-of-00002.parquet"
        _write_parquet(root / "data" / DUMP / name, _fineweb_rows(part, 1000 + 100 * i), FINEWEB_EDU_SCHEMA)
    configs = [("default", [("train", "data/*/*")]), ("sample-10BT", [("train", "sample/10BT/*")])]
    _readme(root, [*configs, (DUMP, [("train", f"data/{DUMP}/*")])], "FineWeb-Edu")
    return {"sample-10BT": sample, "default": dump}


def openwebtext(root: Path, shared: Path, files: int = 4) -> dict[str, list[str]]:
    """Skylion007/openwebtext (parquet form); returns {"train": texts}."""
    texts = web_pages(shared)[10:]
    schema = pa.schema([("text", pa.string())])
    for i, part in enumerate(_split(texts, files)):
        _write_parquet(root / "plain_text" / f"train-{i:05d}-of-{files:05d}.parquet", {"text": part}, schema)
    _readme(root, [("plain_text", [("train", "plain_text/train-*")])], "OpenWebText")
    return {"train": texts}


PG19_SCHEMA = pa.schema(
    [("short_book_title", pa.string()), ("publication_date", pa.int32()), ("url", pa.string()), ("text", pa.string())]
)


def pg19(root: Path, shared: Path, books: int = 8, chars: int = 40_000) -> dict[str, list[str]]:
    """deepmind/pg19 (parquet form) from novel openings; returns {split: texts}."""
    found = novels(shared, books, chars)
    splits = {"train": found[:-2], "validation": found[-2:-1], "test": found[-1:]}
    for split, rows in splits.items():
        parts = _split(rows, 2 if split == "train" else 1)
        for i, part in enumerate(parts):
            columns = {
                "short_book_title": [title for title, _, _ in part],
                "publication_date": [year for _, year, _ in part],
                "url": [f"http://www.gutenberg.org/ebooks/{10000 + j}" for j in range(len(part))],
                "text": [text for _, _, text in part],
            }
            _write_parquet(root / "data" / f"{split}-{i:05d}-of-{len(parts):05d}.parquet", columns, PG19_SCHEMA)
    splits_cfg = [(split, f"data/{split}-*") for split in splits]
    _readme(root, [("default", splits_cfg)], "PG-19")
    return {split: [text for _, _, text in rows] for split, rows in splits.items()}


BUILDERS = {"slimpajama": slimpajama, "fineweb-edu": fineweb_edu, "openwebtext": openwebtext, "pg19": pg19}
