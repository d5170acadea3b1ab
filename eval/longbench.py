"""LongBench / LongBench-E (v1): prompts, generation through any ``TextGenerator``-like object, scoring.

Follows THUDM/LongBench ``pred.py`` / ``eval.py``: the dataset's prompt template filled with the row's
``context`` and ``input``, the tokenised prompt cut in the middle when too long (its start and end hold the
instructions and the question), greedy decoding of ``MAX_NEW_TOKENS[dataset]`` tokens, then the dataset's
metric, max over gold answers, averaged as 0..100. LongBench-E also reports by ``length`` (words, or
characters for Chinese): 0-4k, 4-8k, 8k+.

The per-answer metrics are lm-eval's copy of the official ones (``eval/longbench_metrics.py``, imported when
scoring starts); this module is what lm-eval has no reusable form of: prompts, generation lengths, middle
truncation, the first-line rule, the max over answers, averaging and the length buckets. Scoring is
``eval.py``'s: the prediction is not stripped (lm-eval's own task wrappers strip it).

Differences from the official runner: the prompt budget is ``max_context - max_new_tokens`` (official
truncates to the model's context and lets generation overrun it); the truncated token ids go to the
generator as they are (official decodes both halves and re-tokenises); no chat template (base models);
generation stops at a newline on the few-shot datasets (official does so only on samsum), so a model whose
answer starts with a newline gets "" there; rows may mix datasets in one file.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from core.errors import ConfigError
from eval.generation import Generator
from eval.longbench_metrics import DATASET_METRIC, official_metric, official_metrics

DATASETS: tuple[str, ...] = tuple(DATASET_METRIC)

# config/dataset2prompt.json of THUDM/LongBench, verbatim (data, not code).
PROMPTS: dict[str, str] = {
    "narrativeqa": "You are given a story, which can be either a novel or a movie script, and a question. Answer the question as concisely as you can, using a single phrase if possible. Do not provide any explanation.\n\nStory: {context}\n\nNow, answer the question based on the story as concisely as you can, using a single phrase if possible. Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:",  # noqa: E501
    "qasper": 'You are given a scientific article and a question. Answer the question as concisely as you can, using a single phrase or sentence if possible. If the question cannot be answered based on the information in the article, write "unanswerable". If the question is a yes/no question, answer "yes", "no", or "unanswerable". Do not provide any explanation.\n\nArticle: {context}\n\n Answer the question based on the above article as concisely as you can, using a single phrase or sentence if possible. If the question cannot be answered based on the information in the article, write "unanswerable". If the question is a yes/no question, answer "yes", "no", or "unanswerable". Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:',  # noqa: E501
    "multifieldqa_en": "Read the following text and answer briefly.\n\n{context}\n\nNow, answer the following question based on the above text, only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",  # noqa: E501
    "multifieldqa_zh": "阅读以下文字并用中文简短回答：\n\n{context}\n\n现在请基于上面的文章回答下面的问题，只告诉我答案，不要输出任何其他字词。\n\n问题：{input}\n回答：",  # noqa: E501
    "hotpotqa": "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",  # noqa: E501
    "2wikimqa": "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",  # noqa: E501
    "musique": "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",  # noqa: E501
    "dureader": "请基于给定的文章回答下述问题。\n\n文章：{context}\n\n请基于上述文章回答下面的问题。\n\n问题：{input}\n回答：",  # noqa: E501
    "gov_report": "You are given a report by a government agency. Write a one-page summary of the report.\n\nReport:\n{context}\n\nNow, write a one-page summary of the report.\n\nSummary:",  # noqa: E501
    "qmsum": "You are given a meeting transcript and a query containing a question or instruction. Answer the query in one or more sentences.\n\nTranscript:\n{context}\n\nNow, answer the query based on the above meeting transcript in one or more sentences.\n\nQuery: {input}\nAnswer:",  # noqa: E501
    "multi_news": "You are given several news passages. Write a one-page summary of all news. \n\nNews:\n{context}\n\nNow, write a one-page summary of all the news.\n\nSummary:",  # noqa: E501
    "vcsum": "下面有一段会议记录，请你阅读后，写一段总结，总结会议的内容。\n会议记录：\n{context}\n\n会议总结：",
    "trec": "Please determine the type of the question below. Here are some examples of questions.\n\n{context}\n{input}",  # noqa: E501
    "triviaqa": "Answer the question based on the given passage. Only give me the answer and do not output any other words. The following are some examples.\n\n{context}\n\n{input}",  # noqa: E501
    "samsum": "Summarize the dialogue into a few short sentences. The following are some examples.\n\n{context}\n\n{input}",  # noqa: E501
    "lsht": "请判断给定新闻的类别，下面是一些例子。\n\n{context}\n{input}",
    "passage_count": "There are some paragraphs below sourced from Wikipedia. Some of them may be duplicates. Please carefully read these paragraphs and determine how many unique paragraphs there are after removing duplicates. In other words, how many non-repeating paragraphs are there in total?\n\n{context}\n\nPlease enter the final count of unique paragraphs after removing duplicates. The output format should only contain the number, such as 1, 2, 3, and so on.\n\nThe final answer is: ",  # noqa: E501
    "passage_retrieval_en": 'Here are 30 paragraphs from Wikipedia, along with an abstract. Please determine which paragraph the abstract is from.\n\n{context}\n\nThe following is an abstract.\n\n{input}\n\nPlease enter the number of the paragraph that the abstract is from. The answer format must be like "Paragraph 1", "Paragraph 2", etc.\n\nThe answer is: ',  # noqa: E501
    "passage_retrieval_zh": '以下是若干段落文字，以及其中一个段落的摘要。请确定给定的摘要出自哪一段。\n\n{context}\n\n下面是一个摘要\n\n{input}\n\n请输入摘要所属段落的编号。答案格式必须是"段落1"，"段落2"等格式\n\n答案是：',  # noqa: E501
    "lcc": "Please complete the code given below. \n{context}Next line of code:\n",
    "repobench-p": "Please complete the code given below. \n{context}{input}Next line of code:\n",
}

# config/dataset2maxlen.json of LongBench v1 (the v2-era file dropped a few of these keys).
MAX_NEW_TOKENS: dict[str, int] = {
    "narrativeqa": 128, "qasper": 128, "multifieldqa_en": 64, "multifieldqa_zh": 64,
    "hotpotqa": 32, "2wikimqa": 32, "musique": 32, "dureader": 128,
    "gov_report": 512, "qmsum": 512, "multi_news": 512, "vcsum": 512,
    "trec": 64, "triviaqa": 32, "samsum": 128, "lsht": 64,
    "passage_count": 32, "passage_retrieval_en": 32, "passage_retrieval_zh": 32,
    "lcc": 64, "repobench-p": 64,
}  # fmt: skip

# Few-shot datasets: the model would go on to write the next example, so only the first line counts.
FIRST_LINE_ONLY: frozenset[str] = frozenset({"trec", "triviaqa", "samsum", "lsht"})
CLASSIFICATION: frozenset[str] = frozenset(d for d, m in DATASET_METRIC.items() if m == "classification_score")
# The gold answer's paragraph number, which the retrieval metrics look for (and fail without).
RETRIEVAL_GOLD: dict[str, str] = {"passage_retrieval_en": r"Paragraph (\d+)", "passage_retrieval_zh": r"段落(\d+)"}
BUCKETS: tuple[str, ...] = ("0-4k", "4-8k", "8k+")


# ---------------------------------------------------------------- loading


def _check_row(row: Any, where: str) -> dict:
    """``row`` validated against the official schema; ``dataset`` without LongBench-E's ``_e``."""
    if not isinstance(row, dict):
        raise ConfigError(f"longbench: {where} must be a JSON object, got {type(row).__name__}")
    for field in ("input", "context", "answers", "length", "dataset", "all_classes", "_id"):
        if field not in row:
            raise ConfigError(f"longbench: {where} has no field {field!r}")
    for field in ("input", "context", "_id", "dataset"):
        if not isinstance(row[field], str):
            raise ConfigError(f"longbench: {where} field {field!r} must be a string, got {type(row[field]).__name__}")
    answers = row["answers"]
    if not isinstance(answers, list) or not answers or not all(isinstance(a, str) for a in answers):
        raise ConfigError(
            f"longbench: {where} field 'answers' must be a non-empty list of strings, got {answers!r:.80}"
        )
    length = row["length"]
    if not isinstance(length, int) or isinstance(length, bool) or length < 0:
        raise ConfigError(f"longbench: {where} field 'length' must be an integer >= 0, got {length!r:.80}")
    name = row["dataset"]
    dataset = name[:-2] if name.endswith("_e") and name[:-2] in DATASET_METRIC else name
    if dataset not in DATASET_METRIC:
        raise ConfigError(
            f"longbench: {where} field 'dataset' {row['dataset']!r:.80} is not one of {', '.join(DATASETS)}"
        )
    classes = row["all_classes"]
    if classes is not None and not (isinstance(classes, list) and all(isinstance(c, str) for c in classes)):
        raise ConfigError(
            f"longbench: {where} field 'all_classes' must be null or a list of strings, got {classes!r:.80}"
        )
    if dataset in CLASSIFICATION and not classes:
        raise ConfigError(f"longbench: {where} field 'all_classes' must be a non-empty list of strings for {dataset}")
    pattern = RETRIEVAL_GOLD.get(dataset)
    if pattern and not all(re.search(pattern, a) for a in answers):
        raise ConfigError(
            f"longbench: {where} field 'answers' must each match {pattern!r} for {dataset}, got {answers!r:.80}"
        )
    return {**row, "dataset": dataset}


def load_longbench(path: str | os.PathLike, limit: int = 0) -> list[dict]:
    """The rows of a LongBench jsonl file (the first ``limit`` when ``limit`` > 0), validated."""
    path = Path(path)
    if limit < 0:
        raise ConfigError(f"longbench: limit must be >= 0 (0 = all rows), got {limit}")
    if not path.is_file():
        raise ConfigError(f"longbench: {path} is not a file (want a LongBench .jsonl)")
    rows: list[dict] = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ConfigError(f"longbench: {where} is not valid JSON ({err.msg} at column {err.colno})") from None
            rows.append(_check_row(row, where))
            if limit and len(rows) == limit:
                break
    if not rows:
        raise ConfigError(f"longbench: {path} has no rows")
    return rows


# ---------------------------------------------------------------- prompting and scoring


def truncate_middle(ids: Sequence[int], max_len: int) -> list[int]:
    """``ids`` if they fit, else their first and last ``max_len // 2`` (official middle truncation)."""
    if max_len < 0:
        raise ConfigError(f"longbench: truncate_middle max_len must be >= 0, got {max_len}")
    ids = list(ids)
    if len(ids) <= max_len:
        return ids
    half = max_len // 2
    return ids[:half] + ids[len(ids) - half :]  # not ids[-half:], which is everything when half == 0


def build_prompt(row: dict) -> str:
    return PROMPTS[row["dataset"]].format(context=row["context"], input=row["input"])


def prompt_budget(generator: Generator, dataset: str) -> int:
    """Prompt tokens that fit in the generator's context beside the dataset's new tokens."""
    budget = generator.max_context - MAX_NEW_TOKENS[dataset]
    if budget < 1:
        raise ConfigError(
            f"longbench: a generation context of {generator.max_context} tokens leaves no room for a prompt beside "
            f"{dataset}'s {MAX_NEW_TOKENS[dataset]} new tokens; raise it with --max-context"
        )
    return budget


def predict(row: dict, generator: Generator) -> str:
    """The generator's greedy answer to one row."""
    dataset = row["dataset"]
    ids = truncate_middle(generator.encode(build_prompt(row)), prompt_budget(generator, dataset))
    stop = ("\n",) if dataset in FIRST_LINE_ONLY else ()
    return generator.generate(ids, MAX_NEW_TOKENS[dataset], stop=stop, temperature=0.0)


def score_example(dataset: str, prediction: str, answers: Sequence[str], all_classes: Sequence[str] | None) -> float:
    """The best score of ``prediction`` over the gold ``answers``, 0..100 (official ``eval.py`` ``scorer``)."""
    if dataset not in DATASET_METRIC:
        raise ConfigError(f"longbench: dataset {dataset!r} is not one of {', '.join(DATASETS)}")
    if dataset in FIRST_LINE_ONLY:
        prediction = prediction.lstrip("\n").split("\n")[0]
    metric = official_metric(DATASET_METRIC[dataset])
    return 100.0 * max((metric(prediction, answer, all_classes=all_classes) for answer in answers), default=0.0)


def length_bucket(length: int) -> str:
    """LongBench-E's length range of a row (official thresholds)."""
    return BUCKETS[0] if length < 4000 else BUCKETS[1] if length < 8000 else BUCKETS[2]


# ---------------------------------------------------------------- aggregation and the runner


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def _dataset_summary(scored: Sequence[tuple[int, float]], by_length: bool) -> dict[str, float]:
    """{"score", "n"} and, for LongBench-E, the mean of each non-empty length bucket."""
    out: dict[str, float] = {"score": _mean([s for _, s in scored]), "n": len(scored)}
    if by_length:
        for bucket in BUCKETS:
            values = [s for length, s in scored if length_bucket(length) == bucket]
            if values:
                out[bucket] = _mean(values)
    return out


def summarize(scored: dict[str, list[tuple[int, float]]], *, by_length: bool) -> dict[str, dict[str, float]]:
    """Per dataset summaries plus "average": the unweighted mean over datasets (of each bucket too)."""
    out = {dataset: _dataset_summary(rows, by_length) for dataset, rows in scored.items()}
    average: dict[str, float] = {
        "score": _mean([s["score"] for s in out.values()]),
        "n": sum(s["n"] for s in out.values()),
    }
    for bucket in BUCKETS if by_length else ():
        values = [s[bucket] for s in out.values() if bucket in s]
        if values:
            average[bucket] = _mean(values)
    out["average"] = average
    # rounded like the official eval.py, after averaging the unrounded means
    return {name: {k: v if k == "n" else round(v, 2) for k, v in entry.items()} for name, entry in out.items()}


def run_longbench(
    path: str | os.PathLike, generator: Generator, *, limit: int = 0, progress: bool = True, e: bool = False
) -> dict[str, dict[str, float]]:
    """Generate and score every row of a LongBench jsonl file.

    Returns ``{dataset: {"score": 0..100, "n": rows}, "average": {...}}``; LongBench-E files (stem ending in
    ``_e``, or ``e=True``) also get "0-4k" / "4-8k" / "8k+" scores where those ranges have rows.
    """
    rows = load_longbench(path, limit)
    datasets = dict.fromkeys(row["dataset"] for row in rows)
    official_metrics()  # fail before hours of generation, not after
    for dataset in datasets:
        prompt_budget(generator, dataset)
    scored: dict[str, list[tuple[int, float]]] = {dataset: [] for dataset in datasets}
    for row in tqdm(rows, desc=f"longbench {Path(path).name}", unit="row", disable=not progress):
        prediction = predict(row, generator)
        scored[row["dataset"]].append(
            (row["length"], score_example(row["dataset"], prediction, row["answers"], row["all_classes"]))
        )
    return summarize(scored, by_length=e or Path(path).stem.endswith("_e"))
