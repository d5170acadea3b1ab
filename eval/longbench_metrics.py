"""LongBench (v1) metrics: the official scorer, as lm-eval ships it.

Every per-answer score comes from ``lm_eval.tasks.longbench.metrics`` (lm-eval >= 0.4.9 with its
``longbench`` extra), lm-eval's copy of THUDM/LongBench's ``metrics.py``. Nothing here re-implements a
metric:

- ``qa_f1_score``: SQuAD-normalised bag-of-words F1 (lm-eval);
- ``qa_f1_zh_score``: the same over jieba words, Chinese punctuation dropped (lm-eval, jieba);
- ``rouge_score``: ``Rouge().get_scores(...)["rouge-l"]["f"]``, 0 when it raises (rouge, pltrdy's);
- ``rouge_zh_score``: that rouge-L on jieba words joined by spaces (rouge, jieba);
- ``classification_score``: 1 / (classes named) when the gold class is among them (lm-eval);
- ``retrieval_score`` / ``retrieval_zh_score``: share of the numbers in the prediction equal to the gold
  "Paragraph N" / "段落N" (lm-eval);
- ``count_score``: share of the numbers in the prediction equal to the gold count (lm-eval);
- ``code_sim_score``: ``fuzz.ratio`` of the first code line / 100 (fuzzywuzzy).

What this module keeps, because lm-eval has no importable form of it:

- ``DATASET_METRIC``: dataset -> metric name (LongBench's ``dataset2metric``; lm-eval has it only in its
  task YAMLs, which the tests read to check this table).
- ``official_metrics`` / ``official_metric``: lm-eval imported on first use, never at import time, so that
  ``eval.longbench`` loads and validates files without the extra; a missing package is one ``ConfigError``
  line naming it and the extra.
- ``normalize_answer``: SQuAD normalisation for the HELMET-style tasks in ``eval/synthetic.py``, which must
  run without the extra (lm-eval's module needs rouge, fuzzywuzzy and jieba just to import); the tests check
  it equals lm-eval's.

Prompt assembly, middle truncation, the first-line rule of the few-shot datasets, the max over gold answers,
averaging and LongBench-E's length buckets are LongBench's ``pred.py`` / ``eval.py``, not its ``metrics.py``,
and live in ``eval/longbench.py``.

Version notes: lm-eval 0.4.13's ``code_sim_score`` skips blank and whitespace-only lines when it picks the
first code line; THUDM's (and lm-eval 0.4.9-0.4.12's) only strips leading newlines, so there a blank line
after a skipped fence or comment line is the line scored (about 0). ``fuzz.ratio`` is difflib's
``SequenceMatcher`` ratio, or python-Levenshtein's when that is installed (they can differ by a point);
lm-eval's ``longbench`` extra does not install it. Scores equal whatever lm-eval is installed.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import string
import warnings
from collections.abc import Callable
from types import ModuleType

from core.errors import ConfigError

OFFICIAL_MODULE = "lm_eval.tasks.longbench.metrics"
# import name -> distribution: what lm-eval's LongBench metrics import (its ``longbench`` extra)
_PACKAGES = {"lm_eval": "lm-eval", "rouge": "rouge", "fuzzywuzzy": "fuzzywuzzy", "jieba": "jieba"}

# LongBench's dataset2metric: the name of the lm-eval metric function each dataset is scored with.
DATASET_METRIC: dict[str, str] = {
    "narrativeqa": "qa_f1_score",
    "qasper": "qa_f1_score",
    "multifieldqa_en": "qa_f1_score",
    "multifieldqa_zh": "qa_f1_zh_score",
    "hotpotqa": "qa_f1_score",
    "2wikimqa": "qa_f1_score",
    "musique": "qa_f1_score",
    "dureader": "rouge_zh_score",
    "gov_report": "rouge_score",
    "qmsum": "rouge_score",
    "multi_news": "rouge_score",
    "vcsum": "rouge_zh_score",
    "trec": "classification_score",
    "triviaqa": "qa_f1_score",
    "samsum": "rouge_score",
    "lsht": "classification_score",
    "passage_count": "count_score",
    "passage_retrieval_en": "retrieval_score",
    "passage_retrieval_zh": "retrieval_zh_score",
    "lcc": "code_sim_score",
    "repobench-p": "code_sim_score",
}
METRICS: tuple[str, ...] = tuple(sorted(set(DATASET_METRIC.values())))


def official_metrics() -> ModuleType:
    """lm-eval's LongBench metrics module, imported on first use; ConfigError (one line) when it cannot be."""
    try:
        with warnings.catch_warnings():
            # fuzzywuzzy without python-Levenshtein warns about speed; code lines are short, and difflib is
            # what lm-eval's longbench extra gives
            warnings.filterwarnings("ignore", message="Using slow pure-python SequenceMatcher")
            return importlib.import_module(OFFICIAL_MODULE)
    except ImportError:
        missing = [dist for name, dist in _PACKAGES.items() if importlib.util.find_spec(name) is None]
        what = f"missing {', '.join(missing)}" if missing else f"this lm-eval has no {OFFICIAL_MODULE} (needs >= 0.4.9)"
        raise ConfigError(
            f"longbench: scoring uses lm-eval's LongBench metrics ({what}): "
            "pip install -e '.[eval]' (it brings lm-eval[longbench]: rouge, fuzzywuzzy, jieba)"
        ) from None


def official_metric(name: str) -> Callable[..., float]:
    """The lm-eval metric ``name``: ``metric(prediction, ground_truth, all_classes=...)`` -> [0, 1]."""
    if name not in METRICS:
        raise ConfigError(f"longbench: metric {name!r} is not one of {', '.join(METRICS)}")
    return getattr(official_metrics(), name)


_EN_PUNCT = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(s: str) -> str:
    """SQuAD normalisation (lower case, drop punctuation, then articles, then collapse whitespace), for
    eval/synthetic.py; LongBench scoring uses lm-eval's own."""
    text = "".join(ch for ch in s.lower() if ch not in _EN_PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())
