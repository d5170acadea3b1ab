"""HELMET json_kv: key-value retrieval from a JSON object of uuid pairs."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator, Sequence
from functools import lru_cache
from pathlib import Path

from core.errors import ConfigError
from eval.generation import Generator
from eval.synthetic.common import (
    DEFAULT_DEPTHS,
    KV_DEMO,
    KV_NEW_TOKENS,
    KV_TEMPLATE,
    Case,
    Encode,
    Sample,
    _check_common,
    _Lazy,
    _pick,
    _random_key,
    _read_jsonl,
    fitted_samples,
    run_samples,
)

# ------------------------------------------------------------------ HELMET json_kv


@lru_cache(maxsize=2)
def _kv_file(data_file: str) -> tuple[tuple[tuple[str, str], tuple[tuple[str, str], ...]], ...]:
    """((gold key, value), all records) per lost-in-the-middle kv-retrieval row."""
    rows = _read_jsonl(data_file, ("ordered_kv_records", "key", "value"), "a lost-in-the-middle kv-retrieval")
    try:
        return tuple(
            ((str(r["key"]), str(r["value"])), tuple((str(k), str(v)) for k, v in r["ordered_kv_records"]))
            for r in rows
        )
    except (TypeError, ValueError):
        raise ConfigError(f"--data-file: {data_file} has ordered_kv_records that are not [key, value] pairs") from None


def _uuid_pairs(rng: random.Random) -> Iterator[tuple[str, str]]:
    while True:
        yield _random_key(rng, "uuids"), _random_key(rng, "uuids")


def _file_pairs(
    rows: Sequence[tuple[tuple[str, str], Sequence[tuple[str, str]]]], start: int, gold_key: str
) -> list[tuple[str, str]]:
    # The example's own records first, then the following examples' (wrapping), keys kept distinct.
    seen = {gold_key}
    out = []
    for j in range(len(rows)):
        for k, v in rows[(start + j) % len(rows)][1]:
            if k not in seen:
                seen.add(k)
                out.append((k, v))
    return out


def _kv_prompt(gold: tuple[str, str], distractors: list[tuple[str, str]], depth: float, shots: int) -> str:
    m = len(distractors)
    demos = [distractors[(j + 1) * m // (shots + 1)] for j in range(shots)]  # spread through the object
    rows = list(distractors)
    rows.insert(round(depth * m), gold)
    # lost-in-the-middle's layout: one record per line, valid JSON.
    context = "JSON data:\n{" + ",\n ".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in rows) + "}"
    demo_text = "\n\n".join(KV_DEMO.format(key=json.dumps(k), value=" " + v) for k, v in demos) + (
        "\n\n" if shots else ""
    )
    return KV_TEMPLATE.format(context=context, demos=demo_text, question=json.dumps(gold[0]))


def kv_samples(
    encode: Encode, *, lengths: Sequence[int], depths: Sequence[float] = DEFAULT_DEPTHS,
    data_file: str | Path | None = None, samples: int = 1, seed: int = 0, shots: int = 2,
    max_new_tokens: int = KV_NEW_TOKENS,
) -> list[Sample]:  # fmt: skip
    """HELMET json_kv prompts: a JSON object of uuid pairs sized to the length, the gold pair at ``depth``.

    Pairs are generated from the seed, or drawn from a lost-in-the-middle kv-retrieval file (``data_file``:
    the example's gold pair and records, topped up with the next examples' records for long prompts).
    ``shots`` demonstration pairs (HELMET uses 2) are taken from the object itself.
    """
    lengths, depths = _check_common(lengths, depths, samples, max_new_tokens, shots)
    task = "json_kv"

    def case(gold: tuple[str, str], pairs: Iterator[tuple[str, str]], limit: int | None) -> Case:
        pool = _Lazy(pairs)
        return Case(lambda n, depth: _kv_prompt(gold, pool.take(n + shots), depth, shots), (gold[1],), limit)

    cases = []
    if data_file is not None:
        rows = _kv_file(str(data_file))
        for index in _pick(len(rows), samples, f"{seed}:{task}", data_file):
            gold = rows[index][0]
            pairs = _file_pairs(rows, index, gold[0])
            if len(pairs) < shots:
                raise ConfigError(f"--shots: {shots} exceeds the {len(pairs)} key-value pairs in {data_file}")
            cases.append(case(gold, iter(pairs), len(pairs) - shots))
    else:
        for i in range(samples):
            rng = random.Random(f"{seed}:{task}:{i}")
            cases.append(case((_random_key(rng, "uuids"), _random_key(rng, "uuids")), _uuid_pairs(rng), None))
    return fitted_samples(
        task, encode, lengths, depths, cases, what=task, metric="substring_exact_match", new=max_new_tokens,
        data_file=data_file, unit="key-value pairs",
    )  # fmt: skip


def run_kv_retrieval(
    generator: Generator, *, lengths: Sequence[int] | None = None, depths: Sequence[float] = DEFAULT_DEPTHS,
    data_file: str | Path | None = None, samples: int = 1, seed: int = 0, shots: int = 2,
    max_new_tokens: int = KV_NEW_TOKENS, progress: bool = True,
) -> dict:  # fmt: skip
    """HELMET json_kv over lengths x depths, scored with substring_exact_match of the gold value."""
    return run_samples(
        kv_samples, generator, lengths, max_new_tokens=max_new_tokens, progress=progress, depths=depths,
        data_file=data_file, samples=samples, seed=seed, shots=shots,
    )  # fmt: skip
