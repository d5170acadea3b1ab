"""LongBench metrics, loader and runner on hand-computed cases, with a fake generator (no model)."""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
from rouge_score import rouge_scorer

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
from model.errors import ConfigError

HAS_JIEBA = importlib.util.find_spec("jieba") is not None
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
    assert M.DATASET_METRIC["trec"] is M.classification_score and M.DATASET_METRIC["lsht"] is M.classification_score
    assert M.DATASET_METRIC["repobench-p"] is M.code_sim_score and M.DATASET_METRIC["vcsum"] is M.rouge_zh_score


# ---------------------------------------------------------------- metrics


def test_normalize_answer():
    # lower -> drop punctuation ("brown-fox" -> "brownfox") -> drop whole-word articles -> collapse spaces
    assert M.normalize_answer("  The  Quick, brown-fox   an Apple!\n") == "quick brownfox apple"
    assert M.normalize_answer("Theater A") == "theater"  # "the" inside a word stays


def test_qa_f1_hand_computed():
    # pred -> [cat, sat, on, mat], gold -> [cat, on, mat]: 3 common; P = 3/4, R = 3/3, F1 = 2*(3/4)/(7/4) = 6/7
    assert M.qa_f1_score("The cat sat on the mat.", "cat on mat") == pytest.approx(6 / 7)
    # multiset overlap: [paris, paris] vs [paris] -> 1 common; P = 1/2, R = 1, F1 = 2/3
    assert M.qa_f1_score("Paris, Paris", "paris") == pytest.approx(2 / 3)
    assert M.qa_f1_score("London", "Paris") == 0.0
    assert M.qa_f1_score("", "Paris") == 0.0


def test_rouge_l_matches_rouge_score_and_hand_lcs():
    pred, gold = "the cat sat on the mat today", "the cat is on the mat"
    # lower-case alphanumeric text: the default rouge_score tokenizer and whitespace splitting agree
    expected = rouge_scorer.RougeScorer(["rougeL"]).score(gold, pred)["rougeL"].fmeasure
    assert M.rouge_score(pred, gold) == pytest.approx(expected)
    # LCS("police arrested the suspect yesterday", "the police arrested a suspect") = police arrested suspect = 3
    # P = 3/5, R = 3/5, F = 0.6
    assert M.rouge_score("police arrested the suspect yesterday", "the police arrested a suspect") == pytest.approx(0.6)
    # LCS = [a, c, e] = 3 of 5 predicted and 4 gold tokens: P = 3/5, R = 3/4, F = 2PR/(P+R) = 2/3
    assert M.rouge_score("a b c d e", "a c e f") == pytest.approx(2 / 3)
    assert M.rouge_score("Paris", "paris") == 0.0  # whitespace tokens keep case, as the official scorer does
    assert M.rouge_score("", "a summary") == 0.0


def test_classification_substring_classes():
    classes = ["location", "other location", "city"]
    # "location" is inside the gold "other location" and not equal to it: dropped, one match left
    assert M.classification_score("other location", "other location", all_classes=classes) == 1.0
    # gold "location": both classes match, "other location" is not inside the gold, so 1/2
    assert M.classification_score("other location", "location", all_classes=classes) == 0.5
    assert M.classification_score("city or other location", "city", all_classes=classes) == pytest.approx(1 / 3)
    assert M.classification_score("no idea", "city", all_classes=classes) == 0.0
    abbrev = ["abbreviation", "abbreviation expansion", "animal"]
    assert M.classification_score("abbreviation expansion", "abbreviation expansion", all_classes=abbrev) == 1.0
    assert M.classification_score("abbreviation expansion", "abbreviation", all_classes=abbrev) == 0.5
    # two consecutive strict substrings of the gold are both dropped (official's in-loop remove keeps "y")
    assert M.classification_score("x y z", "x y z", all_classes=["x", "y", "x y z"]) == 1.0
    with pytest.raises(ConfigError, match="all_classes"):
        M.classification_score("city", "city", all_classes=None)


def test_retrieval_and_count():
    assert M.retrieval_score("Paragraph 12", "Paragraph 12") == 1.0
    assert M.retrieval_score("Paragraph 12 or Paragraph 3", "Paragraph 12") == 0.5
    assert M.retrieval_score("Paragraph 120", "Paragraph 12") == 0.0
    assert M.retrieval_score("I do not know", "Paragraph 12") == 0.0
    assert M.retrieval_zh_score("段落3", "段落3") == 1.0  # needs no jieba
    with pytest.raises(ConfigError, match="Paragraph"):
        M.retrieval_score("Paragraph 1", "the first one")
    assert M.count_score("There are 5 unique paragraphs", "5") == 1.0
    assert M.count_score("5 or 6", "5") == 0.5
    assert M.count_score("15", "5") == 0.0
    assert M.count_score("", "5") == 0.0


def test_code_sim():
    # skips the fence and the comment line, compares the first code line
    assert M.code_sim_score("```python\n# add them\nreturn a + b\n```", "return a + b") == 1.0
    assert M.code_sim_score("\n\nx = 1\ny = 2", "x = 1") == 1.0
    assert M.code_sim_score("x = 1  # set x\ny = 2", "y = 2") == 1.0  # official skips lines *containing* '#'
    # Indel ratio: "abcd" vs "abce" -> 2 edits over 8 chars -> 75
    assert M.code_sim_score("abcd", "abce") == 0.75
    assert M.code_sim_score("abc", "abd") == 0.67  # 66.67 rounded to fuzzywuzzy's integer 67
    assert M.code_sim_score("# only a comment", "x = 1") == 0.0


def test_first_line_rule_and_max_over_answers():
    assert score_example("triviaqa", "\n\nParis\nQuestion: what else", ["Paris"], None) == 100.0
    # hotpotqa keeps every line: [paris, question, what] vs [paris] -> P 1/3, R 1, F1 1/2
    assert score_example("hotpotqa", "Paris\nQuestion: what", ["Paris"], None) == pytest.approx(50.0)
    assert score_example("samsum", "Tom is late.\nDialogue: more", ["Tom is late."], None) == 100.0
    assert score_example("hotpotqa", "Paris", ["London", "Paris France", "Paris"], None) == 100.0
    # best of [london: 0, "paris france": P 1, R 1/2, F1 2/3]
    assert score_example("hotpotqa", "Paris", ["London", "Paris France"], None) == pytest.approx(200 / 3)
    with pytest.raises(ConfigError, match="not one of"):
        score_example("squad", "x", ["x"], None)


def test_chinese_metrics_need_jieba(monkeypatch):
    monkeypatch.setitem(sys.modules, "jieba", None)  # import fails as if not installed
    for metric in (M.qa_f1_zh_score, M.rouge_zh_score):
        with pytest.raises(ConfigError, match="pip install jieba") as err:
            metric("北京", "北京")
        assert "\n" not in str(err.value)


@pytest.mark.skipif(not HAS_JIEBA, reason="jieba is not installed")
def test_chinese_metrics_with_jieba():
    assert M.qa_f1_zh_score("北京。", "北京") == 1.0
    assert M.rouge_zh_score("今天天气很好", "今天天气很好") == 1.0
    assert M.qa_f1_zh_score("上海", "北京") == 0.0


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


def test_gold_generator_scores_100_and_empty_scores_0(tmp_path):
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


def test_prompt_is_filled_and_middle_truncated(tmp_path):
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


def test_no_room_for_prompt_and_missing_jieba_fail_before_generating(tmp_path, monkeypatch):
    path = write_jsonl(tmp_path / "g.jsonl", [row("gov_report", ["s"], key="g")])
    fake = FakeGenerator(lambda _: "s", max_context=512)
    with pytest.raises(ConfigError, match="max_context 512 leaves no room"):
        run_longbench(path, fake, progress=False)
    monkeypatch.setitem(sys.modules, "jieba", None)
    zh = write_jsonl(tmp_path / "zh.jsonl", [row("hotpotqa", ["a"], key="h"), row("dureader", ["北京"], key="d")])
    with pytest.raises(ConfigError, match="pip install jieba"):
        run_longbench(zh, fake, progress=False)
    assert fake.calls == []


def test_longbench_e_buckets(tmp_path):
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
