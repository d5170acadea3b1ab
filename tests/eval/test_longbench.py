"""LongBench metrics, loader and runner on hand-computed cases, with a fake generator (no model).

The metrics are lm-eval's (``lm_eval.tasks.longbench.metrics``): tests that score take the ``official``
fixture and skip without lm-eval's longbench extra. test_longbench_official.py checks them against lm-eval
on random cases.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from core.errors import ConfigError
from eval import longbench_metrics as M
from eval.longbench import (
    DATASETS,
    FIRST_LINE_ONLY,
    MAX_NEW_TOKENS,
    PROMPTS,
    length_bucket,
    load_longbench,
    run_longbench,
    score_example,
    truncate_middle,
)

TREC_CLASSES = ["Abbreviation", "Expression abbreviated", "City", "Other location", "Individual"]


# ---------------------------------------------------------------- helpers


def row(
    dataset: str,
    answers: Sequence[str],
    *,
    key: str,
    length: int = 100,
    all_classes=None,
    context: str = "",
    input: str = "question?",
) -> dict:
    """A row in the official schema; ``key`` (unique) sits in the context so the fake can find the gold answer."""
    return {
        "input": input, "context": f"<{key}> {context}", "answers": list(answers), "length": length,
        "dataset": dataset, "language": "en", "all_classes": all_classes, "_id": key,
    }  # fmt: skip


def write_jsonl(path: Path, rows: Sequence[dict]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


class FakeGenerator:
    """One character per token; answers through ``reply(prompt_text)``; records every call."""

    def __init__(self, reply: Callable[[str], str], max_context: int = 100_000):
        self.reply, self.max_context = reply, max_context
        self.calls: list[tuple[list[int] | str, int, tuple[str, ...]]] = []

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(map(chr, ids))

    def generate(self, prompt, max_new_tokens: int, *, stop: Sequence[str] = (), temperature: float = 0.0) -> str:
        assert temperature == 0.0
        self.calls.append((prompt, max_new_tokens, tuple(stop)))
        text = self.reply(prompt if isinstance(prompt, str) else self.decode(prompt))
        cuts = [i for s in stop if (i := text.find(s)) >= 0]
        return text[: min(cuts)] if cuts else text


def gold_reply(rows: Sequence[dict], *, few_shot_tail: str = "") -> Callable[[str], str]:
    """Returns the first gold answer of the row whose key is in the prompt (few-shot ones with a junk next line)."""

    def reply(text: str) -> str:
        for r in rows:
            if f"<{r['_id']}>" in text:
                return r["answers"][0] + (few_shot_tail if r["dataset"] in FIRST_LINE_ONLY else "")
        raise AssertionError("no row key in the prompt")

    return reply


@pytest.fixture(scope="module")
def official():
    """lm-eval's LongBench metrics module, or a skip when lm-eval or its longbench extra is missing."""
    return pytest.importorskip(M.OFFICIAL_MODULE, exc_type=ImportError)


def score(dataset: str, prediction: str, gold: str, all_classes=None) -> float:
    """One row's score, 0..1."""
    return score_example(dataset, prediction, [gold], all_classes) / 100


# ---------------------------------------------------------------- configs


def test_configs_cover_every_dataset():
    assert set(PROMPTS) == set(MAX_NEW_TOKENS) == set(M.DATASET_METRIC) == set(DATASETS)
    assert len(DATASETS) == 21
    assert all("{context}" in p for p in PROMPTS.values())
    assert (
        MAX_NEW_TOKENS["gov_report"],
        MAX_NEW_TOKENS["samsum"],
        MAX_NEW_TOKENS["trec"],
        MAX_NEW_TOKENS["hotpotqa"],
    ) == (512, 128, 64, 32)
    assert PROMPTS["lcc"] == "Please complete the code given below. \n{context}Next line of code:\n"
    assert M.DATASET_METRIC["trec"] == M.DATASET_METRIC["lsht"] == "classification_score"
    assert M.DATASET_METRIC["repobench-p"] == "code_sim_score" and M.DATASET_METRIC["vcsum"] == "rouge_zh_score"
    assert set(M.DATASET_METRIC.values()) == set(M.METRICS)


# ---------------------------------------------------------------- metrics (lm-eval's), through the dataset table


def test_normalize_answer():
    # lower -> drop punctuation ("brown-fox" -> "brownfox") -> drop whole-word articles -> collapse spaces
    assert M.normalize_answer("  The  Quick, brown-fox   an Apple!\n") == "quick brownfox apple"
    assert M.normalize_answer("Theater A") == "theater"  # "the" inside a word stays


def test_qa_f1_hand_computed(official):
    # pred -> [cat, sat, on, mat], gold -> [cat, on, mat]: 3 common; P = 3/4, R = 3/3, F1 = 2*(3/4)/(7/4) = 6/7
    assert score("hotpotqa", "The cat sat on the mat.", "cat on mat") == pytest.approx(6 / 7)
    # multiset overlap: [paris, paris] vs [paris] -> 1 common; P = 1/2, R = 1, F1 = 2/3
    assert score("hotpotqa", "Paris, Paris", "paris") == pytest.approx(2 / 3)
    assert score("hotpotqa", "London", "Paris") == 0.0
    assert score("hotpotqa", "", "Paris") == 0.0


def test_rouge_l_hand_computed(official):
    # one sentence, no repeated word: LCS("police arrested the suspect yesterday", "the police arrested a
    # suspect") = police arrested suspect = 3; P = 3/5, R = 3/5, F = 0.6 (official adds 1e-8 to P + R)
    police = score("gov_report", "police arrested the suspect yesterday", "the police arrested a suspect")
    assert police == pytest.approx(0.6)
    # LCS = [a, c, e] = 3 of 5 predicted and 4 gold words: P = 3/5, R = 3/4, F = 2/3
    assert score("qmsum", "a b c d e", "a c e f") == pytest.approx(2 / 3)
    # sentences split at ".", union LCS over them, distinct words: hits The agency grants + found gaps in = 6,
    # R = 6/9, P = 6/6, F = 0.8 (whitespace-token rouge-L over the whole text gave 2/3)
    pred, gold = "The agency found gaps in grants.", "The agency reviewed grants. It found gaps in oversight."
    assert score("gov_report", pred, gold) == pytest.approx(0.8)
    assert score("multi_news", "Paris", "paris") == 0.0  # whitespace words keep their case
    assert score("gov_report", "", "a summary") == 0.0  # rouge raises on an empty hypothesis: 0


def test_classification_substring_classes(official):
    classes = ["location", "other location", "city"]
    # "location" is inside the gold "other location" and not equal to it: dropped, one match left
    assert score("trec", "other location", "other location", classes) == 1.0
    # gold "location": both classes match, "other location" is not inside the gold, so 1/2
    assert score("trec", "other location", "location", classes) == 0.5
    assert score("trec", "city or other location", "city", classes) == pytest.approx(1 / 3)
    assert score("trec", "no idea", "city", classes) == 0.0
    abbrev = ["abbreviation", "abbreviation expansion", "animal"]
    assert score("trec", "abbreviation expansion", "abbreviation expansion", abbrev) == 1.0
    assert score("trec", "abbreviation expansion", "abbreviation", abbrev) == 0.5
    # official removes from the list it iterates, so the item after a removed one stays: "y" counts, 1/2
    assert score("trec", "x y z", "x y z", ["x", "y", "x y z"]) == 0.5


def test_retrieval_and_count(official):
    assert score("passage_retrieval_en", "Paragraph 12", "Paragraph 12") == 1.0
    assert score("passage_retrieval_en", "Paragraph 12 or Paragraph 3", "Paragraph 12") == 0.5
    assert score("passage_retrieval_en", "Paragraph 120", "Paragraph 12") == 0.0
    assert score("passage_retrieval_en", "I do not know", "Paragraph 12") == 0.0
    assert score("passage_retrieval_zh", "段落3", "段落3") == 1.0
    assert score("passage_count", "There are 5 unique paragraphs", "5") == 1.0
    assert score("passage_count", "5 or 6", "5") == 0.5
    assert score("passage_count", "15", "5") == 0.0
    assert score("passage_count", "", "5") == 0.0


def test_code_sim(official):
    # skips the fence and the comment line, compares the first code line
    assert score("lcc", "```python\n# add them\nreturn a + b\n```", "return a + b") == 1.0
    assert score("lcc", "\n\nx = 1\ny = 2", "x = 1") == 1.0
    assert score("lcc", "x = 1  # set x\ny = 2", "y = 2") == 1.0  # official skips lines *containing* '#'
    # fuzz.ratio is difflib's ratio as an integer percentage: "abcd" / "abce" -> 2*3/8 = 75
    assert score("repobench-p", "abcd", "abce") == 0.75
    assert score("repobench-p", "abc", "abd") == 0.67  # 66.67 rounded to 67
    # difflib takes the longest block "a, b" first and finds nothing beside it: 2*4/22 -> 36 (an edit-distance
    # ratio finds 7 common characters: 64)
    assert score("lcc", "a, b = b, a", "b, a = a, b") == 0.36
    assert score("lcc", "# only a comment", "x = 1") == 0.0


def test_first_line_rule_and_max_over_answers(official):
    assert score_example("triviaqa", "\n\nParis\nQuestion: what else", ["Paris"], None) == 100.0
    # hotpotqa keeps every line: [paris, question, what] vs [paris] -> P 1/3, R 1, F1 1/2
    assert score_example("hotpotqa", "Paris\nQuestion: what", ["Paris"], None) == pytest.approx(50.0)
    assert score_example("samsum", "Tom is late\nDialogue: more", ["Tom is late"], None) == pytest.approx(100.0)
    assert score_example("hotpotqa", "Paris", ["London", "Paris France", "Paris"], None) == 100.0
    # best of [london: 0, "paris france": P 1, R 1/2, F1 2/3]
    assert score_example("hotpotqa", "Paris", ["London", "Paris France"], None) == pytest.approx(200 / 3)
    with pytest.raises(ConfigError, match="not one of"):
        score_example("squad", "x", ["x"], None)


def _without_lm_eval_metrics(monkeypatch, package: str) -> None:
    """Import of ``package`` fails as if it were not installed, and lm-eval's metrics module is imported afresh."""
    for name in [m for m in sys.modules if m == package or m.startswith(f"{package}.")] + [M.OFFICIAL_MODULE]:
        monkeypatch.delitem(sys.modules, name, raising=False)  # put back afterwards
    monkeypatch.setitem(sys.modules, package, None)


@pytest.mark.parametrize("package, dist", [("jieba", "jieba"), ("rouge", "rouge"), ("lm_eval", "lm-eval")])
def test_missing_scorer_package_is_one_line_naming_it_and_the_extra(monkeypatch, package, dist):
    _without_lm_eval_metrics(monkeypatch, package)
    for dataset, gold in (("hotpotqa", "Paris"), ("dureader", "北京")):
        with pytest.raises(ConfigError) as err:
            score_example(dataset, gold, [gold], None)
        message = str(err.value)
        assert f"missing {dist}" in message and "pip install -e '.[eval]'" in message and "\n" not in message


def test_chinese_metrics(official):
    assert score("multifieldqa_zh", "北京。", "北京") == 1.0
    assert score("vcsum", "今天天气很好", "今天天气很好") == pytest.approx(1.0)
    assert score("multifieldqa_zh", "上海", "北京") == 0.0


# ---------------------------------------------------------------- truncation and buckets


def test_truncate_middle_keeps_exact_head_and_tail():
    ids = list(range(10))
    assert truncate_middle(ids, 6) == [0, 1, 2, 7, 8, 9]
    assert truncate_middle(ids, 7) == [0, 1, 2, 7, 8, 9]  # half = 3, as official int(max_length / 2)
    assert truncate_middle(ids, 10) == ids and truncate_middle(ids, 50) == ids
    assert truncate_middle(ids, 1) == [] and truncate_middle(ids, 0) == []  # not ids[-0:] == everything
    with pytest.raises(ConfigError, match="max_len"):
        truncate_middle(ids, -1)


def test_length_buckets_boundaries():
    assert [length_bucket(n) for n in (0, 3999, 4000, 7999, 8000, 50_000)] == [
        "0-4k",
        "0-4k",
        "4-8k",
        "4-8k",
        "8k+",
        "8k+",
    ]


# ---------------------------------------------------------------- loader errors


GOOD = row("hotpotqa", ["Paris"], key="a")


@pytest.mark.parametrize(
    "bad, needle",
    [
        ({k: v for k, v in GOOD.items() if k != "answers"}, "has no field 'answers'"),
        ({**GOOD, "answers": "Paris"}, "field 'answers' must be a non-empty list of strings"),
        ({**GOOD, "answers": []}, "field 'answers' must be a non-empty list of strings"),
        ({**GOOD, "length": "100"}, "field 'length' must be an integer"),
        ({**GOOD, "dataset": "squad"}, "field 'dataset' 'squad' is not one of"),
        ({**GOOD, "context": None}, "field 'context' must be a string"),
        ({**GOOD, "all_classes": "City"}, "field 'all_classes' must be null or a list of strings"),
        (
            {**GOOD, "dataset": "trec", "all_classes": None},
            "field 'all_classes' must be a non-empty list of strings for trec",
        ),
        (
            {**GOOD, "dataset": "passage_retrieval_en", "answers": ["the first one"]},
            "field 'answers' must each match 'Paragraph (\\\\d+)' for passage_retrieval_en",
        ),
        ([1, 2], "must be a JSON object"),
    ],
)
def test_malformed_rows_name_file_line_and_field(tmp_path, bad, needle):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(GOOD) + "\n" + json.dumps(bad) + "\n", encoding="utf-8")
    with pytest.raises(ConfigError) as err:
        load_longbench(path)
    message = str(err.value)
    assert message.startswith(f"longbench: {path}:2 ") and needle in message and "\n" not in message


def test_loader_bad_json_missing_file_limit_and_e_suffix(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text(json.dumps(GOOD) + "\n\n{not json\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=rf"{path}:3 is not valid JSON"):
        load_longbench(path)
    assert len(load_longbench(path, limit=1)) == 1  # stops before the bad line
    with pytest.raises(ConfigError, match="is not a file"):
        load_longbench(tmp_path / "missing.jsonl")
    write_jsonl(path, [{**GOOD, "dataset": "hotpotqa_e"}])
    assert load_longbench(path)[0]["dataset"] == "hotpotqa"


# ---------------------------------------------------------------- the runner


def all_kinds_rows() -> list[dict]:
    return [
        row("hotpotqa", ["Paris", "City of Paris"], key="qa"),
        row("gov_report", ["The agency reviewed grants and found gaps in oversight."], key="sum", input=""),
        row("trec", ["Other location"], key="cls", all_classes=TREC_CLASSES, input="Question: Where is X?\nType:"),
        row("passage_retrieval_en", ["Paragraph 7"], key="ret"),
        row("passage_count", ["12"], key="cnt", input=""),
        row("lcc", ["    return a + b"], key="code", input=""),
        row("repobench-p", ["x = foo(y)"], key="repo"),
        row("triviaqa", ["Mount Everest"], key="tqa"),
        row("samsum", ["Amanda will bring cookies to Jerry tomorrow."], key="sam"),
    ]


def test_gold_generator_scores_100_and_empty_scores_0(tmp_path, official):
    rows = all_kinds_rows()
    path = write_jsonl(tmp_path / "mixed.jsonl", rows)
    fake = FakeGenerator(gold_reply(rows, few_shot_tail="\nQuestion: next example"))
    result = run_longbench(path, fake, progress=False)
    datasets = [r["dataset"] for r in rows]
    assert list(result) == [*datasets, "average"]
    for name in datasets:
        assert result[name] == {"score": 100.0, "n": 1}, name
    assert result["average"] == {"score": 100.0, "n": len(rows)}
    for (_, max_new, stop), r in zip(fake.calls, rows):
        assert max_new == MAX_NEW_TOKENS[r["dataset"]]
        assert stop == (("\n",) if r["dataset"] in FIRST_LINE_ONLY else ())

    empty = run_longbench(path, FakeGenerator(lambda _: ""), progress=False)
    assert all(empty[name]["score"] == 0.0 for name in [*datasets, "average"])


def test_prompt_is_filled_and_middle_truncated(tmp_path, official):
    short = row("hotpotqa", ["Paris"], key="s", context="tiny", input="Where?")
    long_row = row("hotpotqa", ["Paris"], key="l", context="x" * 2000, input="Capital of France?")
    path = write_jsonl(tmp_path / "trunc.jsonl", [short, long_row])
    fake = FakeGenerator(lambda _: "Paris", max_context=433)  # one char per token; the short prompt is ~290
    run_longbench(path, fake, progress=False)

    full_short = PROMPTS["hotpotqa"].format(context=short["context"], input="Where?")
    assert fake.calls[0][0] == fake.encode(full_short)  # fits: passed whole
    full = fake.encode(PROMPTS["hotpotqa"].format(context=long_row["context"], input="Capital of France?"))
    half = (433 - MAX_NEW_TOKENS["hotpotqa"]) // 2  # odd budget 401 -> 200 + 200 tokens
    received = fake.calls[1][0]
    assert len(full) > 2000 and received == full[:half] + full[-half:] and len(received) == 400
    assert fake.decode(received).startswith("Answer the question") and fake.decode(received).endswith("Answer:")


def test_no_room_for_prompt_and_missing_scorer_fail_before_generating(tmp_path, monkeypatch, official):
    path = write_jsonl(tmp_path / "g.jsonl", [row("gov_report", ["s"], key="g")])
    fake = FakeGenerator(lambda _: "s", max_context=512)
    with pytest.raises(ConfigError, match="context of 512 tokens leaves no room .* raise it with --max-context"):
        run_longbench(path, fake, progress=False)
    _without_lm_eval_metrics(monkeypatch, "jieba")
    en = write_jsonl(tmp_path / "en.jsonl", [row("hotpotqa", ["a"], key="h")])  # jieba is needed for any dataset
    assert len(load_longbench(en)) == 1  # loading needs no lm-eval
    with pytest.raises(ConfigError, match=r"missing jieba\): pip install -e '\.\[eval\]'"):
        run_longbench(en, fake, progress=False)
    assert fake.calls == []


def test_longbench_e_buckets(tmp_path, official):
    rows = [
        row("hotpotqa", ["Paris"], key="short", length=100),
        row("hotpotqa", ["Rome"], key="mid", length=5000),
        row("hotpotqa", ["Oslo"], key="long", length=9000),
        row("passage_count", ["3"], key="pc", length=100),
    ]
    reply = gold_reply(rows)
    fake = FakeGenerator(lambda text: "wrong" if "<mid>" in text else reply(text))
    result = run_longbench(write_jsonl(tmp_path / "mixed_e.jsonl", rows), fake, progress=False)
    assert result["hotpotqa"] == {"score": 66.67, "n": 3, "0-4k": 100.0, "4-8k": 0.0, "8k+": 100.0}
    assert result["passage_count"] == {"score": 100.0, "n": 1, "0-4k": 100.0}  # empty buckets omitted
    # unweighted over datasets: (200/3 + 100) / 2; each bucket over the datasets that have it
    assert result["average"] == {"score": 83.33, "n": 4, "0-4k": 100.0, "4-8k": 0.0, "8k+": 100.0}

    plain = write_jsonl(tmp_path / "mixed.jsonl", rows)
    assert "0-4k" not in run_longbench(plain, fake, progress=False)["hotpotqa"]
    assert run_longbench(plain, fake, progress=False, e=True)["hotpotqa"]["4-8k"] == 0.0
    assert run_longbench(plain, fake, progress=False, limit=1)["hotpotqa"] == {"score": 100.0, "n": 1}


def test_shipped_sample_is_what_its_script_builds_from_the_offline_data(shared_data):
    """eval/longbench_samples/hotpotqa_e.jsonl (the README's longbench:FILE) loads in the official schema with one
    row per LongBench-E length range, and eval.longbench_sample rebuilds it byte for byte from ../shared/data."""
    from eval.longbench_sample import SAMPLE, SOURCE, render, sample_rows

    rows = load_longbench(SAMPLE)
    assert [length_bucket(r["length"]) for r in rows] == ["0-4k", "4-8k", "8k+"]
    assert all(r["dataset"] == "hotpotqa" and r["answers"][0] in r["context"] for r in rows)
    assert render(sample_rows(shared_data / SOURCE)) == SAMPLE.read_text(encoding="utf-8")
