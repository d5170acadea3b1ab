"""LongBench scoring against lm-eval's copy of the official scorer (``lm_eval.tasks.longbench.metrics``).

- Every metric, fed seeded random English and Chinese prediction / answer pairs (``all_classes`` for the
  classification ones), equals lm-eval's to 1e-9.
- Every dataset scores as LongBench's ``eval.py`` does (first line of the few-shot datasets, best gold
  answer), with lm-eval's metrics picked by lm-eval's own task YAMLs.
- ``longbench_official.jsonl`` (summarisation, Chinese summarisation and code rows; each row's canned model
  output in ``pred``) scores the hand-checked official values, through ``run_longbench`` and through
  ``python -m eval.run --tasks longbench:FILE``.

lm-eval's LongBench metrics need its ``longbench`` extra (rouge, fuzzywuzzy, jieba); without it these tests
skip. ``metric_disagreements`` / ``dataset_disagreements`` take any scorer, so an older implementation can be
measured against lm-eval with the same cases.
"""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from eval import longbench_metrics as M
from eval.longbench import DATASETS, load_longbench, run_longbench, score_example
from tests.conftest import REPO
from tests.e2e.test_train_cli import overrides, train
from tests.eval.test_longbench import FakeGenerator

FIXTURE = Path(__file__).with_name("longbench_official.jsonl")
N_PER_METRIC = 300
N_PER_DATASET = 40
TOLERANCE = 1e-9
# LongBench eval.py: the datasets whose prediction is cut to its first line before scoring (written out here,
# not taken from eval.longbench, so the test checks that table too).
OFFICIAL_FIRST_LINE = ("trec", "triviaqa", "samsum", "lsht")


@pytest.fixture(scope="module")
def official():
    """lm-eval's LongBench metrics module, or a skip when lm-eval or its longbench extra is missing."""
    return pytest.importorskip(M.OFFICIAL_MODULE, exc_type=ImportError)


# ---------------------------------------------------------------- seeded random cases

EN_WORDS = (
    "the The a an A cat sat on mat agency reviewed grants found gaps in oversight storm hit coast killed two "
    "Tom will call Anna late later meeting budget was approved by committee Paris France 2019 12 3 it It and of"
).split()
EN_PUNCT = ("",) * 6 + (",", ".", ".", "!", "?", "'s", "-", ";")
ZH_WORDS = (
    "北京 上海 今天 天气 很好 我们 会议 讨论 了 项目 进展 的 是 在 问题 决定 下周 继续 公司 市场 增长 百分之 十 中国 "
    "经济 政策 研究 报告 认为"
).split()
ZH_PUNCT = ("",) * 6 + ("，", "。", "！", "？", "、", "“", "”", " ", ".", "：")
EN_CLASSES = (
    "Abbreviation", "Expression abbreviated", "Animal", "Organ of body", "Color", "City", "Other location",
    "location", "Country", "Individual", "Date", "Other number", "number", "Definition of something",
    "Description of something", "Manner of an action", "Reason",
)  # fmt: skip
ZH_CLASSES = (
    "农业、农村",
    "军事",
    "社会",
    "体育",
    "体育新闻",
    "国际",
    "国际经济",
    "经济",
    "教育",
    "文化",
    "科技",
    "医药、卫生",
)
CODE_LINES = (
    "    return a + b", "    j, i = i, j", "a, b = b, a", "self.assertEqual(expected, result)", "for i in range(n):",
    "        x = np.zeros((n, d))", "if x is None:", "    total += price * count", "return cache.get(key, default)",
    "out = model(x)[0]", "import numpy as np", "    def forward(self, x, mask=None):",
)  # fmt: skip
CODE_NOISE = ("```python", "```", "# the next line", "// done", "", "   ", "print(x)", "    pass")


def _words(rng: random.Random, vocab: Sequence[str], punct: Sequence[str], n: int) -> list[str]:
    return [rng.choice(vocab) + rng.choice(punct) for _ in range(n)]


def _mutate(rng: random.Random, words: list[str], vocab: Sequence[str]) -> list[str]:
    """Drops, inserts, swaps and re-cases a few words, so predictions overlap their gold answer partly."""
    words = list(words)
    for _ in range(rng.randint(0, 4)):
        op, i = rng.random(), rng.randrange(len(words) + 1)
        if op < 0.3 and words:
            words.pop(min(i, len(words) - 1))
        elif op < 0.6:
            words.insert(i, rng.choice(vocab))
        elif op < 0.8 and len(words) > 1:
            j, k = rng.randrange(len(words)), rng.randrange(len(words))
            words[j], words[k] = words[k], words[j]
        elif words:
            j = min(i, len(words) - 1)
            words[j] = words[j].swapcase()
    return words


def _text_pair(rng: random.Random, zh: bool) -> tuple[str, str]:
    vocab, punct, sep = (ZH_WORDS, ZH_PUNCT, "") if zh else (EN_WORDS, EN_PUNCT, " ")
    gold = _words(rng, vocab, punct, rng.randint(1, 16))
    pred = _mutate(rng, gold, vocab) if rng.random() < 0.75 else _words(rng, vocab, punct, rng.randint(0, 16))
    prediction = sep.join(pred)
    if rng.random() < 0.15:
        prediction = rng.choice((" ", "\n", "  ")) + prediction + rng.choice(("", " ", "\n", ". "))
    return prediction, sep.join(gold)


def _classification(rng: random.Random, zh: bool) -> tuple[str, str, list[str]]:
    pool = ZH_CLASSES if zh else EN_CLASSES
    classes = rng.sample(pool, rng.randint(4, len(pool)))
    # often a gold class that contains another listed class ("Other location" / "location"): the case the
    # official rule drops matches for
    nesting = [c for c in classes if any(d in c and d != c for d in classes)]
    gold = rng.choice(nesting if nesting and rng.random() < 0.5 else classes)
    named = rng.sample(classes, rng.randint(0, 3)) + ([gold] if rng.random() < 0.5 else [])
    filler = ZH_WORDS if zh else EN_WORDS
    parts = named + [rng.choice(filler) for _ in range(rng.randint(0, 3))]
    rng.shuffle(parts)
    return ("" if zh else " ").join(parts), gold, classes


def _numbers_answer(rng: random.Random, gold: int, template: Callable[[int], str]) -> str:
    shape = rng.randrange(5)
    if shape == 0:
        return template(gold)
    if shape == 1:
        return template(rng.randint(1, 30))
    if shape == 2:
        return f"{template(rng.randint(1, 30))} or {template(rng.choice((gold, gold + 10)))}"
    if shape == 3:
        return " ".join(str(rng.randint(0, 40)) for _ in range(rng.randint(0, 4)))
    return rng.choice(("I do not know", "", template(gold) + f" {rng.randint(1, 30)}"))


def _code_prediction(rng: random.Random, gold: str) -> str:
    chars = list(gold if rng.random() < 0.8 else rng.choice(CODE_LINES))
    for _ in range(rng.randint(0, 4)):
        i = rng.randrange(len(chars) + 1)
        op = rng.random()
        if op < 0.35 and chars:
            chars.pop(min(i, len(chars) - 1))
        elif op < 0.7:
            chars.insert(i, rng.choice("abijnxy(),. =+_1"))
        elif len(chars) > 1:
            j, k = rng.randrange(len(chars)), rng.randrange(len(chars))
            chars[j], chars[k] = chars[k], chars[j]
    lines = [rng.choice(CODE_NOISE) for _ in range(rng.randint(0, 2))] + ["".join(chars)]
    lines += [rng.choice(CODE_NOISE) for _ in range(rng.randint(0, 2))]
    return "\n" * rng.randint(0, 2) + "\n".join(lines)


def make_case(metric: str, rng: random.Random, *, zh: bool | None = None) -> tuple[str, str, list[str] | None]:
    """One (prediction, gold answer, all_classes) for ``metric``; ``zh`` picks the classification language."""
    if metric in ("qa_f1_score", "rouge_score", "qa_f1_zh_score", "rouge_zh_score"):
        return (*_text_pair(rng, zh=metric.endswith("zh_score")), None)
    if metric == "classification_score":
        return _classification(rng, zh=rng.random() < 0.5 if zh is None else zh)
    if metric == "retrieval_score":
        gold = rng.randint(1, 30)
        return _numbers_answer(rng, gold, lambda k: f"Paragraph {k}"), f"Paragraph {gold}", None
    if metric == "retrieval_zh_score":
        gold = rng.randint(1, 30)
        return _numbers_answer(rng, gold, lambda k: f"段落{k}"), f"段落{gold}", None
    if metric == "count_score":
        gold = rng.randint(1, 30)
        return _numbers_answer(rng, gold, lambda k: f"There are {k} unique paragraphs"), str(gold), None
    if metric == "code_sim_score":
        gold = rng.choice(CODE_LINES)
        return _code_prediction(rng, gold), gold, None
    raise AssertionError(metric)


def metric_cases(metric: str, n: int = N_PER_METRIC, seed: int = 20) -> list[tuple[str, str, list[str] | None]]:
    rng = random.Random(f"{seed}:{metric}")
    return [make_case(metric, rng) for _ in range(n)]


def metric_disagreements(ours: Callable[[str], Callable], official, n: int = N_PER_METRIC) -> dict[str, list]:
    """Per metric, the cases where ``ours(metric)(prediction, gold, all_classes=...)`` and lm-eval's differ."""
    bad: dict[str, list] = {}
    for metric in M.METRICS:
        mine, theirs = ours(metric), getattr(official, metric)
        bad[metric] = []
        for prediction, gold, classes in metric_cases(metric, n):
            a, b = mine(prediction, gold, all_classes=classes), theirs(prediction, gold, all_classes=classes)
            if abs(a - b) > TOLERANCE:
                bad[metric].append((prediction, gold, a, b))
    return bad


# ---------------------------------------------------------------- lm-eval's own view of each dataset


def lm_eval_dataset_metric(official) -> dict[str, str]:
    """dataset -> metric name, read from lm-eval's LongBench task YAMLs (``process_results: !function
    metrics.get_<metric>_with_score``); LongBench-E's ``<dataset>_e`` tasks must agree with ``<dataset>``."""
    table: dict[str, str] = {}
    for path in sorted(Path(official.__file__).parent.glob("*.yaml")):
        text = path.read_text(encoding="utf-8")
        name = re.search(r"^dataset_name:\s*(\S+)", text, re.M)
        fn = re.search(r"^process_results:\s*!function\s+metrics\.get_(\w+?)(?:_with)?_score\s*$", text, re.M)
        if name and fn:
            dataset = name.group(1).removesuffix("_e")
            assert table.setdefault(dataset, f"{fn.group(1)}_score") == f"{fn.group(1)}_score", path.name
    return table


def official_score(official, table: dict[str, str], dataset: str, prediction: str, answers, all_classes) -> float:
    """LongBench eval.py's ``scorer`` for one row, 0..1, on lm-eval's metrics."""
    if dataset in OFFICIAL_FIRST_LINE:
        prediction = prediction.lstrip("\n").split("\n")[0]
    score = 0.0
    for answer in answers:
        score = max(score, getattr(official, table[dataset])(prediction, answer, all_classes=all_classes))
    return score


def dataset_cases(dataset: str, n: int = N_PER_DATASET, seed: int = 20) -> list[tuple[str, list[str], list | None]]:
    """Rows of ``dataset``: 1-3 gold answers; few-shot predictions sometimes go on to a next example."""
    rng = random.Random(f"{seed}:{dataset}")
    metric, zh = M.DATASET_METRIC[dataset], dataset == "lsht"
    cases = []
    for _ in range(n):
        prediction, gold, classes = make_case(metric, rng, zh=zh)
        answers = [gold] + [make_case(metric, rng, zh=zh)[1] for _ in range(rng.randint(0, 2))]
        if classes is not None:
            answers = [gold]  # official classification rows have one gold class
        if dataset in OFFICIAL_FIRST_LINE and rng.random() < 0.5:
            prediction = rng.choice(("", "\n", "\n\n")) + prediction + "\nQuestion: " + make_case(metric, rng, zh=zh)[0]
        cases.append((prediction, answers, classes))
    return cases


def dataset_disagreements(score: Callable[..., float], official, n: int = N_PER_DATASET) -> dict[str, list]:
    """Per dataset, the rows where ``score(dataset, prediction, answers, all_classes)`` (0..100) is not
    eval.py's score on lm-eval's metrics."""
    table = lm_eval_dataset_metric(official)
    bad: dict[str, list] = {}
    for dataset in DATASETS:
        bad[dataset] = []
        for prediction, answers, classes in dataset_cases(dataset, n):
            mine = score(dataset, prediction, answers, classes) / 100
            ref = official_score(official, table, dataset, prediction, answers, classes)
            if abs(mine - ref) > TOLERANCE:
                bad[dataset].append((prediction, answers, mine, ref))
    return bad


# ---------------------------------------------------------------- the cross-checks


def test_dataset_table_is_lm_evals(official):
    assert lm_eval_dataset_metric(official) == M.DATASET_METRIC


def test_every_metric_equals_lm_eval_on_random_english_and_chinese_pairs(official):
    cases = {metric: metric_cases(metric) for metric in M.METRICS}
    # the cases exercise what they should: Chinese text, class lists with substring classes, partial scores
    assert any(re.search(r"[\u4e00-\u9fff]", pred) for pred, _, _ in cases["rouge_zh_score"])
    assert {c is not None for _, _, c in cases["classification_score"]} == {True}
    assert sum(any(c in g and c != g for c in classes) for _, g, classes in cases["classification_score"]) > 50
    for metric in M.METRICS:  # zero, full and partial scores
        scores = {getattr(official, metric)(p, g, all_classes=c) for p, g, c in cases[metric]}
        assert min(scores) == 0 and max(scores) > 0.99 and any(0.01 < x < 0.99 for x in scores), metric
    bad = metric_disagreements(M.official_metric, official)
    assert {metric: len(rows) for metric, rows in bad.items()} == dict.fromkeys(M.METRICS, 0), {
        metric: rows[:3] for metric, rows in bad.items() if rows
    }


def test_every_dataset_scores_as_eval_py_with_lm_evals_metrics(official):
    bad = dataset_disagreements(score_example, official)
    assert {dataset: len(rows) for dataset, rows in bad.items()} == dict.fromkeys(DATASETS, 0), {
        dataset: rows[:3] for dataset, rows in bad.items() if rows
    }


def test_normalize_answer_kept_for_synthetic_tasks_equals_lm_evals(official):
    rng = random.Random(20)
    texts = [" ".join(_words(rng, EN_WORDS + ZH_WORDS, EN_PUNCT + ZH_PUNCT, rng.randint(0, 12))) for _ in range(300)]
    assert [M.normalize_answer(t) for t in texts] == [official.normalize_answer(t) for t in texts]


# ---------------------------------------------------------------- the fixture, end to end

# Hand-checked official scores of longbench_official.jsonl (0..100, rounded to 2 decimals as eval.py does).
# rouge-L is pltrdy's summary-level union LCS: sentences split at ".", LCS hits counted as (word, position in
# the reference sentence) pairs, P and R over *distinct* words, F = 2PR / (P + R + 1e-8).
EXPECTED = {
    # pred "The agency found gaps in grants." / gold "The agency reviewed grants. It found gaps in oversight."
    # ref sentence 1 hits The agency grants, sentence 2 found gaps in: 6; R = 6/9 distinct, P = 6/6: F = 0.8
    "gov_report": {"score": 80.0, "n": 1},
    # pred "The storm hit the coast and killed two." / gold "The storm hit the coast. The storm killed two."
    # sentence 1: 5 hits; sentence 2's "The storm" repeat (The,1), (storm,2) of sentence 1, so it adds only
    # killed, two: 7 hits; R = 7/7 distinct (The and the differ), P = 7/8: F = 14/15
    "multi_news": {"score": 93.33, "n": 1},
    # first line "Tom is late. Tom will call Anna." / gold "Tom will call Anna later.": 4 hits (Tom will call
    # Anna), R = 4/5, P = 4/6 distinct: F = 8/11
    "samsum": {"score": 72.73, "n": 1},
    # prediction equal to the gold: F = 2 / (2 + 1e-8)
    "vcsum": {"score": 100.0, "n": 1},
    # first code line (fence and comment skipped) equals the gold: 100; "    i, j = j, i" vs "    j, i = i, j":
    # difflib's longest block " i, j" (5), then "   " left of it (3): 2*8/30 -> 53; mean (100 + 53) / 2
    "lcc": {"score": 76.5, "n": 2},
    # first code line "a, b = b, a" (leading newlines stripped, comment skipped) vs "b, a = a, b": difflib's
    # longest block "a, b" (4), nothing matches on either side of it: 2*4/22 -> 36
    "repobench-p": {"score": 36.0, "n": 1},
    "average": {"score": 76.43, "n": 7},
}


def canned_generator(path: str | Path) -> Callable[..., FakeGenerator]:
    """A ``TextGenerator`` stand-in answering each row of ``path`` with its ``pred`` (found by the
    ``<_id>`` marker its context starts with)."""
    rows = load_longbench(path)

    def reply(prompt: str) -> str:
        for r in rows:
            if f"<{r['_id']}>" in prompt:
                return r["pred"]
        raise AssertionError("no row marker in the prompt")

    return lambda *args, **kwargs: FakeGenerator(reply)


def test_fixture_scores_the_hand_checked_official_values(official):
    assert run_longbench(FIXTURE, canned_generator(FIXTURE)(), progress=False) == EXPECTED


# python -m eval.run with TextGenerator swapped for the canned one (the checkpoint is real, its model unused)
DRIVER = """
import runpy, sys
import eval.generation
from tests.eval.test_longbench_official import canned_generator
eval.generation.TextGenerator = canned_generator(sys.argv.pop(1))
runpy.run_module("eval.run", run_name="__main__", alter_sys=True)
"""


@pytest.mark.slow
def test_eval_run_longbench_file_gives_the_official_scores(official, tmp_path, cache_dir):
    run_dir = tmp_path / "run"
    proc = train(
        overrides(run_dir, cache_dir, **{"train.max_steps": 2, "checkpoint.every": 2, "eval.every": 0}), timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "results.json"
    cmd = [sys.executable, "-c", DRIVER, str(FIXTURE), "--run", str(run_dir), "--out", str(out), "--no-progress"]
    proc = subprocess.run(
        [*cmd, "--tasks", f"longbench:{FIXTURE}"], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(out.read_text())[f"longbench:{FIXTURE}"] == EXPECTED
    assert f"longbench:{FIXTURE}: average 76.43" in proc.stdout


# ---------------------------------------------------------------- without the extra

BLOCKED = """
import json, sys
for name in ("lm_eval", "rouge", "fuzzywuzzy", "jieba"):
    sys.modules[name] = None  # import fails as if not installed
import eval.longbench as lb
from eval.run import parse_tasks
from core.errors import ConfigError
from tests.eval.test_longbench_official import canned_generator
path = sys.argv[1]
out = {"rows": len(lb.load_longbench(path)), "tasks": parse_tasks("longbench:" + path)[0]}
try:
    lb.run_longbench(path, canned_generator(path)(), progress=False)
except ConfigError as err:
    out["error"] = str(err)
out["loaded"] = sorted(m for m in ("lm_eval", "rouge", "fuzzywuzzy", "jieba") if sys.modules.get(m))
print(json.dumps(out))
"""


@pytest.mark.slow
def test_loading_and_task_parsing_need_no_lm_eval_and_scoring_names_the_extra():
    proc = subprocess.run(
        [sys.executable, "-c", BLOCKED, str(FIXTURE)], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["rows"] == 7 and out["tasks"] == [f"longbench:{FIXTURE}"] and out["loaded"] == []
    assert out["error"].startswith("longbench: scoring uses lm-eval's LongBench metrics (missing lm-eval, rouge")
    assert "pip install -e '.[eval]'" in out["error"] and "\n" not in out["error"]
