"""The LongBench (v1) metrics, one per dataset, each ``metric(prediction, ground_truth, *, all_classes)``
returning a score in [0, 1] for one gold answer (the caller takes the max over gold answers).

Rules follow THUDM/LongBench ``metrics.py``; where this module deviates it says so:

- ``rouge_score``: rouge-L F1 from ``rouge_score.RougeScorer(["rougeL"])`` on whitespace tokens, case and
  punctuation kept. Official uses the ``rouge`` package (pltrdy) on the same whitespace tokens, but as a
  summary-level union-LCS over sentences split at ``"."`` and counting *distinct* words, so multi-sentence
  summaries (gov_report, qmsum, multi_news, samsum, vcsum, dureader) score somewhat differently from the
  paper's numbers; single-sentence texts with no repeated words score the same. The rouge_score default
  tokenizer is not used because it drops every non-[a-z0-9] character (all of Chinese).
- ``classification_score``: official removes items from the match list while iterating over it, which skips
  the item after each removal; here every matched class that is a strict substring of the ground truth is
  dropped. Official's difflib fallback for "no class matched" is dead code (``list != 0`` is always true),
  so no match scores 0, as it does officially.
- ``code_sim_score``: fuzzywuzzy's ``fuzz.ratio`` is an integer; rapidfuzz's is a float, so it is rounded.
- Chinese metrics need ``jieba`` (imported on first use); ``retrieval_zh_score`` does not, as officially.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence
from functools import lru_cache
from typing import Protocol

from model.errors import ConfigError


class Metric(Protocol):
    def __call__(self, prediction: str, ground_truth: str, *, all_classes: Sequence[str] | None = None) -> float: ...


_ZH_PUNCTUATION = "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏."
_EN_PUNCT = frozenset(string.punctuation)
_ALL_PUNCT = frozenset(string.punctuation + _ZH_PUNCTUATION)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_NUMBER = re.compile(r"\d+")


def _jieba():
    """jieba, imported only when a Chinese dataset is scored (it is an optional dependency)."""
    try:
        import jieba
    except ImportError:
        raise ConfigError(
            "longbench: Chinese metrics (multifieldqa_zh, dureader, vcsum) need jieba: pip install jieba"
        ) from None
    return jieba


def _zh_words(text: str) -> list[str]:
    return list(_jieba().cut(text, cut_all=False))


# ---------------------------------------------------------------- normalisation and token F1


def normalize_answer(s: str) -> str:
    """SQuAD normalisation: lower case, drop punctuation, then articles, then collapse whitespace."""
    text = "".join(ch for ch in s.lower() if ch not in _EN_PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def normalize_zh_answer(s: str) -> str:
    """Lower case, drop English and Chinese punctuation and all whitespace (Chinese has no word spaces)."""
    return "".join(ch for ch in s.lower() if ch not in _ALL_PUNCT and not ch.isspace())


def token_f1(prediction: Sequence[str], ground_truth: Sequence[str]) -> float:
    """Bag-of-tokens F1 (multiset overlap)."""
    same = sum((Counter(prediction) & Counter(ground_truth)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(prediction), same / len(ground_truth)
    return 2 * precision * recall / (precision + recall)


def qa_f1_score(prediction: str, ground_truth: str, *, all_classes: Sequence[str] | None = None) -> float:
    return token_f1(normalize_answer(prediction).split(), normalize_answer(ground_truth).split())


def qa_f1_zh_score(prediction: str, ground_truth: str, *, all_classes: Sequence[str] | None = None) -> float:
    def tokens(text: str) -> list[str]:
        return [t for t in map(normalize_zh_answer, _zh_words(text)) if t]

    return token_f1(tokens(prediction), tokens(ground_truth))


# ---------------------------------------------------------------- rouge-L


class _WhitespaceTokenizer:
    """Official LongBench tokenises rouge input on whitespace, keeping case and punctuation."""

    def tokenize(self, text: str) -> list[str]:
        return text.split()


@lru_cache(maxsize=1)
def _rouge_l():
    rouge_scorer = _optional("rouge_score.rouge_scorer", "rouge-score")
    return rouge_scorer.RougeScorer(["rougeL"], tokenizer=_WhitespaceTokenizer())


def _optional(module: str, package: str):
    """The eval extra's scorers load on first use: the needle / RAG tasks share this module's
    normalisation without needing them."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise ConfigError(f"longbench: the metric needs {package} (pip install -e '.[eval]')") from None


def rouge_score(prediction: str, ground_truth: str, *, all_classes: Sequence[str] | None = None) -> float:
    """Rouge-L F1 over whitespace tokens (0 when either side is empty, as officially)."""
    return float(_rouge_l().score(ground_truth, prediction)["rougeL"].fmeasure)


def rouge_zh_score(prediction: str, ground_truth: str, *, all_classes: Sequence[str] | None = None) -> float:
    return rouge_score(" ".join(_zh_words(prediction)), " ".join(_zh_words(ground_truth)))


# ---------------------------------------------------------------- classification, retrieval, count, code


def classification_score(prediction: str, ground_truth: str, *, all_classes: Sequence[str] | None = None) -> float:
    """1/len(matches) if the ground truth is among the classes named in the prediction, else 0.

    A matched class that is a strict substring of the ground truth is dropped, so predicting
    "Other location" is not also counted as "location" (which would halve the score).
    """
    if not all_classes:
        raise ConfigError("longbench: classification needs all_classes (a non-empty list of class names)")
    matches = [c for c in all_classes if c in prediction]
    matches = [c for c in matches if not (c in ground_truth and c != ground_truth)]
    return 1.0 / len(matches) if ground_truth in matches else 0.0


def _id_fraction(prediction: str, gold_id: str) -> float:
    """Fraction of the numbers in the prediction that equal ``gold_id`` (0 when it names none)."""
    numbers = _NUMBER.findall(prediction)
    return sum(n == gold_id for n in numbers) / len(numbers) if numbers else 0.0


def _retrieval(pattern: str, prediction: str, ground_truth: str) -> float:
    found = re.findall(pattern, ground_truth)
    if not found:
        raise ConfigError(f"longbench: retrieval answer {ground_truth!r} does not match {pattern!r}")
    return _id_fraction(prediction, found[0])


def retrieval_score(prediction: str, ground_truth: str, *, all_classes: Sequence[str] | None = None) -> float:
    return _retrieval(r"Paragraph (\d+)", prediction, ground_truth)


def retrieval_zh_score(prediction: str, ground_truth: str, *, all_classes: Sequence[str] | None = None) -> float:
    return _retrieval(r"段落(\d+)", prediction, ground_truth)


def count_score(prediction: str, ground_truth: str, *, all_classes: Sequence[str] | None = None) -> float:
    return _id_fraction(prediction, str(ground_truth))


def first_code_line(prediction: str) -> str:
    """The first generated line that is code: official skips lines containing a backtick, '#' or '//'."""
    for line in prediction.lstrip("\n").split("\n"):
        if "`" not in line and "#" not in line and "//" not in line:
            return line
    return ""


def code_sim_score(prediction: str, ground_truth: str, *, all_classes: Sequence[str] | None = None) -> float:
    line = first_code_line(prediction)
    if line == ground_truth:
        return 1.0
    if not line or not ground_truth:  # fuzzywuzzy scores an empty side 0
        return 0.0
    return (
        round(_optional("rapidfuzz.fuzz", "rapidfuzz").ratio(line, ground_truth)) / 100
    )  # fuzzywuzzy returns an integer percentage


DATASET_METRIC: dict[str, Metric] = {
    "narrativeqa": qa_f1_score,
    "qasper": qa_f1_score,
    "multifieldqa_en": qa_f1_score,
    "multifieldqa_zh": qa_f1_zh_score,
    "hotpotqa": qa_f1_score,
    "2wikimqa": qa_f1_score,
    "musique": qa_f1_score,
    "dureader": rouge_zh_score,
    "gov_report": rouge_score,
    "qmsum": rouge_score,
    "multi_news": rouge_score,
    "vcsum": rouge_zh_score,
    "trec": classification_score,
    "triviaqa": qa_f1_score,
    "samsum": rouge_score,
    "lsht": classification_score,
    "passage_count": count_score,
    "passage_retrieval_en": retrieval_score,
    "passage_retrieval_zh": retrieval_zh_score,
    "lcc": code_sim_score,
    "repobench-p": code_sim_score,
}

_NEEDS_JIEBA = frozenset({qa_f1_zh_score, rouge_zh_score})


def check_metric_available(dataset: str) -> None:
    """Fail before any generation when ``dataset``'s metric needs a missing optional package."""
    if DATASET_METRIC[dataset] in _NEEDS_JIEBA:
        _jieba()
