"""``python -m eval.longbench_sample --data ../shared/data``: writes the LongBench-E sample the README runs offline.

``eval/longbench_samples/hotpotqa_e.jsonl`` holds three rows in the official LongBench-E schema (``input``,
``context``, ``answers``, ``length`` in words, ``dataset``, ``language``, ``all_classes``, ``_id``), one per
length range (0-4k, 4-8k, 8k+ words), made from the NQ-open oracle file of the offline bundle
(``lost_in_the_middle/nq-open-oracle.jsonl.gz``): a question, its gold Wikipedia passage among the gold passages
of other questions that contain none of its answers, numbered ``Passage i:`` as LongBench's multi-document QA
sets are. It is a stand-in with the real files' shape for trying ``--tasks longbench:FILE`` without a download;
the real LongBench / LongBench-E files go wherever you keep data (docs/eval.md). The file is committed; this
script rebuilds it byte for byte (a test checks that).
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import sys
from pathlib import Path

from core.errors import ConfigError, cli_errors
from eval.longbench_metrics import normalize_answer

SAMPLE = Path(__file__).resolve().parent / "longbench_samples" / "hotpotqa_e.jsonl"
SOURCE = Path("lost_in_the_middle") / "nq-open-oracle.jsonl.gz"
# (question row, context words at least, gold passage depth): one row per LongBench-E length range
ROWS = ((0, 1500, 0.5), (1, 4500, 0.0), (2, 8500, 1.0))


def _passage(ctx: dict) -> str:
    return f"{ctx['title']}\n{' '.join(str(ctx['text']).split())}"


def sample_rows(nq_file: Path) -> list[dict]:
    """The sample's rows, built deterministically from the NQ-open oracle file."""
    if not nq_file.is_file():
        raise ConfigError(f"--data: no {nq_file} (the offline bundle's {SOURCE})")
    with gzip.open(nq_file, "rt", encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    golds = [next(c for c in r["ctxs"] if c.get("isgold")) for r in records]
    out = []
    for index, min_words, depth in ROWS:
        record, rng = records[index], random.Random(f"longbench-sample:{index}")
        answers = [normalize_answer(a) for a in record["answers"]]
        others = [j for j in range(len(records)) if j != index]
        rng.shuffle(others)
        passages, words = [], 0
        for j in others:
            if words >= min_words:
                break
            text = _passage(golds[j])
            if not any(a in normalize_answer(text) for a in answers):
                passages.append(text)
                words += len(text.split())
        passages.insert(round(depth * len(passages)), _passage(golds[index]))
        context = "\n".join(f"Passage {i}:\n{p}" for i, p in enumerate(passages, start=1))
        out.append(
            {
                "input": record["question"],
                "context": context,
                "answers": list(record["answers"]),
                "length": len(context.split()),
                "dataset": "hotpotqa",
                "language": "en",
                "all_classes": None,
                "_id": f"nq-open-oracle-{index}",
            }
        )
    return out


def render(rows: list[dict]) -> str:
    return "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)


@cli_errors
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m eval.longbench_sample", description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True, help="the offline data bundle (../shared/data)")
    p.add_argument("--out", default=str(SAMPLE), help="where to write the jsonl (default: the shipped sample)")
    args = p.parse_args(argv)
    try:
        text = render(sample_rows(Path(args.data) / SOURCE))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    Path(args.out).write_text(text, encoding="utf-8")
    print(f"wrote {args.out} ({len(text.splitlines())} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
