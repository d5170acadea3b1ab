"""HELMET-style RAG: NQ-open questions with the gold passage among distractors."""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from core.errors import ConfigError
from eval.generation import Generator
from eval.longbench_metrics import normalize_answer  # SQuAD normalisation, as HELMET uses
from eval.synthetic.common import (
    DEFAULT_DEPTHS,
    RAG_DEMO,
    RAG_NEW_TOKENS,
    RAG_PASSAGE,
    RAG_STOP,
    RAG_TEMPLATE,
    Case,
    Encode,
    Sample,
    _check_common,
    _insert,
    _pick,
    _read_jsonl,
    fitted_samples,
    run_samples,
)

# ------------------------------------------------------------------ HELMET RAG (NQ-open oracle passages)


@dataclass(frozen=True)
class _QA:
    question: str
    answers: tuple[str, ...]
    title: str
    text: str
    norm: str  # normalised passage text, to keep passages that hold an answer out of the distractors
    words: tuple[str, ...]


@lru_cache(maxsize=2)
def _nq_file(data_file: str) -> tuple[_QA, ...]:
    rows = _read_jsonl(data_file, ("question", "answers", "ctxs"), "an NQ-open oracle")
    out = []
    for r in rows:
        if not isinstance(r["answers"], list) or not isinstance(r["ctxs"], list):
            raise ConfigError(f"--data-file: {data_file} has a row whose answers or ctxs is not a list")
        answers = tuple(str(a) for a in r["answers"] if normalize_answer(str(a)))
        ctxs = [c for c in r["ctxs"] if isinstance(c, dict) and "text" in c]
        gold = next((c for c in ctxs if c.get("isgold")), ctxs[0] if ctxs else None)
        # An answer that normalises to nothing matches every prediction: such rows are left out.
        if gold is None or not answers or len(answers) != len(r["answers"]):
            continue
        text = str(gold["text"])
        out.append(
            _QA(
                str(r["question"]),
                answers,
                str(gold.get("title", "")),
                text,
                normalize_answer(text),
                tuple(text.split()),
            )
        )
    if not out:
        raise ConfigError(f"--data-file: {data_file} holds no usable NQ-open oracle rows")
    return tuple(out)


def _passage(qa: _QA, words: Sequence[str] | None = None) -> str:
    return RAG_PASSAGE.format(title=qa.title, text=qa.text if words is None else " ".join(words))


def _rag_prompt(
    qa: _QA, demos: Sequence[_QA], pool: Sequence[_QA], ends: Sequence[int], n_words: int, depth: float
) -> str:
    """Distractors holding the first ``n_words`` words of ``pool`` (the last one cut short to fill the
    length exactly), the gold passage at ``depth``."""
    passages = []
    for p, end in zip(pool, ends):
        start = end - len(p.words)
        if start >= n_words:
            break
        passages.append(_passage(p) if end <= n_words else _passage(p, p.words[: n_words - start]))
    docs = _insert(passages, [(depth, _passage(qa))])
    demo_text = "".join(
        RAG_DEMO.format(documents=_passage(d), question=d.question, answer=d.answers[0]) + "\n\n" for d in demos
    )
    return RAG_TEMPLATE.format(demos=demo_text, context="\n\n".join(docs), question=qa.question)


def rag_samples(
    encode: Encode, *, data_file: str | Path, lengths: Sequence[int], depths: Sequence[float] = DEFAULT_DEPTHS,
    samples: int = 1, seed: int = 0, shots: int = 2, max_new_tokens: int = RAG_NEW_TOKENS,
) -> list[Sample]:  # fmt: skip
    """HELMET-style RAG prompts from the NQ-open oracle file: the question's gold passage at ``depth`` among
    gold passages of other questions (none containing an answer), filling the length; ``shots`` demos."""
    lengths, depths = _check_common(lengths, depths, samples, max_new_tokens, shots)
    rows = _nq_file(str(data_file))
    task = "rag_nq"
    if len(rows) < shots + 2:
        raise ConfigError(
            f"--data-file: {data_file} holds {len(rows)} usable rows, too few for {shots} shots and distractors"
        )

    def case(qa: _QA, demos: list[_QA], pool: list[_QA]) -> Case:
        ends = list(itertools.accumulate(len(p.words) for p in pool))
        return Case(lambda n, depth: _rag_prompt(qa, demos, pool, ends, n, depth), qa.answers, ends[-1] if ends else 0)

    cases = []
    for i, index in enumerate(_pick(len(rows), samples, f"{seed}:{task}", data_file)):
        qa, rng = rows[index], random.Random(f"{seed}:{task}:{i}")
        others = [j for j in range(len(rows)) if j != index]
        demo_ids = rng.sample(others, shots)
        answers = [normalize_answer(a) for a in qa.answers]
        pool = [
            rows[j]
            for j in others
            if j not in demo_ids and rows[j].text != qa.text and not any(a in rows[j].norm for a in answers)
        ]
        rng.shuffle(pool)
        cases.append(case(qa, [rows[j] for j in demo_ids], pool))
    return fitted_samples(
        task, encode, lengths, depths, cases, what=f"{task} with {shots} shots", metric="substring_exact_match",
        new=max_new_tokens, data_file=data_file, unit="distractor passages",
    )  # fmt: skip


def run_rag(
    generator: Generator, *, data_file: str | Path, lengths: Sequence[int] | None = None,
    depths: Sequence[float] = DEFAULT_DEPTHS, samples: int = 1, seed: int = 0, shots: int = 2,
    max_new_tokens: int = RAG_NEW_TOKENS, progress: bool = True,
) -> dict:  # fmt: skip
    """HELMET-style RAG on NQ-open over lengths x depths (gold passage depth), substring_exact_match of any answer.
    Generation stops at the first newline, as HELMET does for RAG."""
    return run_samples(
        rag_samples, generator, lengths, max_new_tokens=max_new_tokens, progress=progress, stop=RAG_STOP,
        data_file=data_file, depths=depths, samples=samples, seed=seed, shots=shots,
    )  # fmt: skip
