"""Synthetic long-context tasks (RULER needles, HELMET json_kv and RAG) and the eval plots, with fake
generators (no model). Tests that need ../shared (GPT-2 tokenizer, essays, lost-in-the-middle files) skip
without it; the rest use a word-level fake tokenizer and generated data."""

from __future__ import annotations

import gzip
import json
import re
from collections.abc import Callable, Sequence
from functools import lru_cache
from pathlib import Path

import pytest

from core.errors import ConfigError
from eval import synthetic as S
from eval.plots import plot_group_sizes, plot_loss_curves, plot_needle_heatmap

KINDS = S.NEEDLE_KINDS
WORD = re.compile(r"\w+|[^\w\s]")
NEEDLE_RE = re.compile(r"One of the special magic numbers for (\S+) is: (\d+)\.")
QUERY_RE = re.compile(r"What (?:is|are all) the special magic numbers? for (.+?) mentioned in the provided text\?")
UUID_RE = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$")
DEPTH_TOLERANCE = 0.05  # needle start as a fraction of the haystack's characters, at 2048 tokens


# ---------------------------------------------------------------- helpers


def word_encode(text: str) -> list[int]:
    """A fake tokenizer: one token per word or punctuation mark."""
    return [len(w) for w in WORD.findall(text)]


@lru_cache(maxsize=1)
def gpt2(shared: Path):
    from data.tokenizer import load_tokenizer

    return load_tokenizer(shared / "gpt2_bpe" / "gpt2_tokenizer.json")


class FakeGenerator:
    """The TextGenerator surface; replies through ``reply(prompt)`` and records the stop strings."""

    def __init__(
        self,
        reply: Callable[[str], str],
        *,
        encode: Callable[[str], list[int]] = word_encode,
        max_context: int = 1 << 20,
    ):
        self.reply, self.encode, self.max_context = reply, encode, max_context
        self.stops: list[tuple[str, ...]] = []

    def decode(self, ids: Sequence[int]) -> str:
        raise AssertionError("runners pass prompts as text")

    def generate(self, prompt, max_new_tokens: int, *, stop: Sequence[str] = (), temperature: float = 0.0) -> str:
        assert isinstance(prompt, str) and max_new_tokens > 0 and temperature == 0.0
        self.stops.append(tuple(stop))
        text = self.reply(prompt)
        cuts = [i for s in stop if (i := text.find(s)) >= 0]
        return text[: min(cuts)] if cuts else text


def needle_reply(prompt: str) -> str:
    """Reads the question's keys and answers every value of theirs found in the haystack."""
    found = NEEDLE_RE.findall(prompt)
    keys = re.split(r", and |, ", QUERY_RE.search(prompt).group(1))
    return " " + ", ".join(v for key in keys for k, v in found if k == key) + "."


def kv_reply(prompt: str) -> str:
    """Looks the last asked key (after the demos) up in the JSON object."""
    key = re.findall(r'Key: ("[^"]+")\nCorresponding value:', prompt)[-1]
    return " " + re.search(re.escape(key) + r': "([^"]+)"', prompt).group(1) + "\n\nKey:"


def one_line(exc: pytest.ExceptionInfo, option: str) -> None:
    message = str(exc.value)
    assert option in message and "\n" not in message, message


@pytest.fixture(params=["words", "gpt2"])
def encode(request) -> Callable[[str], list[int]]:
    if request.param == "words":
        return word_encode
    return gpt2(request.getfixturevalue("shared_data")).encode


@pytest.fixture
def essays(shared_data) -> Path:
    return shared_data / "paul_graham_essays_niah"


@pytest.fixture
def kv_file(shared_data) -> Path:
    return shared_data / "lost_in_the_middle" / "kv-retrieval-75_keys.jsonl.gz"


@pytest.fixture
def nq_file(shared_data) -> Path:
    return shared_data / "lost_in_the_middle" / "nq-open-oracle.jsonl.gz"


# ---------------------------------------------------------------- scoring


def test_ruler_string_match_scores():
    assert S.string_match_all(
        "The numbers are 1234567 and 7654321.", ["1234567", "7654321", "1111111"]
    ) == pytest.approx(2 / 3)
    assert S.string_match_all("KEY: Brave-Otter", ["brave-otter"]) == 1.0  # case-insensitive
    assert S.string_match_all("", ["1"]) == 0.0
    assert S.string_match_part("only 7654321", ["1234567", "7654321"]) == 1.0
    assert S.string_match_part("nothing here", ["1234567", "7654321"]) == 0.0


def test_helmet_normalisation_and_substring_exact_match():
    assert S.normalize_answer("The  Quick, Brown fox!") == "quick brown fox"
    assert S.normalize_answer("An apple a day") == "apple day"
    assert S.substring_exact_match("It was Wilhelm Conrad Röntgen, in 1901.", ["Wilhelm Conrad Röntgen"]) == 1.0
    assert S.substring_exact_match("the height: 1,149 feet", ["1149 feet"]) == 1.0  # punctuation goes on both sides
    assert (
        S.substring_exact_match("Paris", ["London", "the city of Paris"]) == 0.0
    )  # answer must sit inside the prediction
    assert S.substring_exact_match("london", "London") == 1.0
    assert S.substring_exact_match("", ["x"]) == 0.0


# ---------------------------------------------------------------- needles


@pytest.mark.parametrize("kind", KINDS)
def test_needle_prompts_hold_the_expected_needles(kind):
    shape = {"single": (1, 1), "multikey": (4, 1), "multivalue": (1, 4), "multiquery": (4, 4)}[kind]  # keys, answers
    items = S.needle_samples(word_encode, kind=kind, lengths=[1024], depths=[0.5], samples=3)
    assert len(items) == 3
    for item in items:
        found = NEEDLE_RE.findall(item.prompt)
        keys = {k for k, _ in found}
        values = [v for _, v in found]
        assert len(found) == (1 if kind == "single" else 4)
        assert len(keys) == shape[0] and len(set(values)) == len(values)
        assert all(re.fullmatch(r"[1-9]\d{6}", v) for v in values)
        assert len(item.answers) == shape[1] and set(item.answers) <= set(values)
        assert S.string_match_all(needle_reply(item.prompt), item.answers) == 1.0  # the gold answers are derivable
        if shape[1] == 1:
            assert item.prompt.startswith("A special magic number is hidden within the following text.")
            assert item.prompt.endswith(
                "The special magic number for "
                + QUERY_RE.search(item.prompt).group(1)
                + " mentioned in the provided text is"
            )
        else:
            assert item.prompt.startswith("Some special magic numbers are hidden within the following text.")
            assert item.prompt.endswith("mentioned in the provided text are")
        assert item.metric == "string_match_all" and item.task == f"niah_{kind}"


def test_needle_uuid_keys_and_essay_folder_parameter(tmp_path):
    (tmp_path / "a.txt").write_text("First essay. It has two sentences.", encoding="utf-8")
    (tmp_path / "b.txt").write_text("Second essay here! Short too?", encoding="utf-8")
    items = S.needle_samples(
        word_encode,
        kind="multikey",
        haystack="essay",
        haystack_dir=tmp_path,
        key_type="uuids",
        lengths=[512],
        depths=[0.5],
    )
    prompt = items[0].prompt
    assert all(UUID_RE.match(k) for k, _ in NEEDLE_RE.findall(prompt))
    assert prompt.count("First essay.") > 5  # tiny essays repeat to fill the length
    assert items[0].tokens >= 0.9 * 512


@pytest.mark.parametrize("length", [512, 2048])
@pytest.mark.parametrize("haystack", ["noise", "essay"])
def test_needle_prompt_fits_and_nearly_fills_the_length(encode, haystack, length, request):
    haystack_dir = request.getfixturevalue("essays") if haystack == "essay" else None
    for kind in KINDS:
        for item in S.needle_samples(
            encode, kind=kind, haystack=haystack, haystack_dir=haystack_dir, lengths=[length], depths=[0.0, 0.5, 1.0]
        ):
            assert item.tokens == len(encode(item.prompt))
            assert 0.9 * length <= item.tokens <= length - S.NEEDLE_NEW_TOKENS  # room left for the answer


@pytest.mark.parametrize("haystack", ["noise", "essay"])
def test_needle_lands_at_the_requested_depth(encode, haystack, request):
    haystack_dir = request.getfixturevalue("essays") if haystack == "essay" else None
    depths = [0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0]
    for item in S.needle_samples(encode, haystack=haystack, haystack_dir=haystack_dir, lengths=[2048], depths=depths):
        start, end = item.prompt.index("\n") + 1, item.prompt.rindex("\nWhat is")
        needle = NEEDLE_RE.search(item.prompt)
        at = (needle.start() - start) / (end - start - len(needle.group(0)))
        assert abs(at - item.depth) <= DEPTH_TOLERANCE, (item.depth, at)


def test_needle_samples_are_deterministic_by_seed():
    def make(seed):
        return S.needle_samples(
            word_encode, kind="multiquery", lengths=[512, 1024], depths=[0.0, 1.0], samples=2, seed=seed
        )

    first = make(0)
    assert first == make(0)
    assert [s.prompt for s in first] != [s.prompt for s in make(1)]
    # A sample keeps its needles across lengths and depths; only the placement changes.
    assert len({s.answers for s in first[::2]}) == 1 and first[0].answers != first[1].answers


# ---------------------------------------------------------------- json kv


def _kv_pair_tokens(encode) -> int:
    return len(encode(f'"{"0" * 8}-0000-4000-8000-{"0" * 12}": "{"1" * 8}-1111-4111-8111-{"1" * 12}",\n '))


@pytest.mark.parametrize("length", [512, 2048])
def test_kv_prompt_is_valid_json_sized_to_the_length(encode, length):
    for item in S.kv_samples(encode, lengths=[length], depths=[0.0, 0.5, 1.0], samples=2):
        body = item.prompt[len("JSON data:\n") : item.prompt.index("}\n\nExtract") + 1]
        records = json.loads(body)
        assert item.answers[0] in records.values()
        assert kv_reply(item.prompt).strip().startswith(item.answers[0])
        assert item.tokens == len(encode(item.prompt)) <= length - S.KV_NEW_TOKENS
        # Whole records only: the prompt is within one record of the budget (and >= 90% of long lengths).
        assert item.tokens >= length - S.KV_NEW_TOKENS - _kv_pair_tokens(encode) - 2
        if length >= 2048:
            assert item.tokens >= 0.9 * length


def test_kv_gold_record_sits_at_the_depth():
    for item in S.kv_samples(word_encode, lengths=[2048], depths=[0.0, 0.3, 0.5, 0.8, 1.0]):
        records = list(json.loads(item.prompt[len("JSON data:\n") : item.prompt.index("}\n\nExtract") + 1]).values())
        index, m = records.index(item.answers[0]), len(records) - 1
        assert abs(index / m - item.depth) <= 0.5 / m + 1e-9


def test_kv_from_lost_in_the_middle_file(kv_file):
    items = S.kv_samples(word_encode, lengths=[1024], depths=[0.5], data_file=kv_file, samples=3, seed=2)
    gold = {}
    with gzip.open(kv_file, "rt") as fh:
        for line in fh:
            row = json.loads(line)
            gold[row["key"]] = row["value"]
    for item in items:
        key = json.loads(re.findall(r'Key: ("[^"]+")\nCorresponding value:', item.prompt)[-1])
        assert gold[key] == item.answers[0]
    assert items == S.kv_samples(word_encode, lengths=[1024], depths=[0.5], data_file=kv_file, samples=3, seed=2)


# ---------------------------------------------------------------- rag


@pytest.mark.parametrize(("length", "shots"), [(512, 0), (2048, 2)])
def test_rag_prompt_sized_with_gold_passage_at_the_depth(encode, nq_file, length, shots):
    gold = {}
    with gzip.open(nq_file, "rt") as fh:
        for line in fh:
            row = json.loads(line)
            gold[row["question"]] = (row["answers"], next(c for c in row["ctxs"] if c["isgold"]))
    items = S.rag_samples(encode, data_file=nq_file, lengths=[length], depths=[0.0, 0.5, 1.0], samples=2, shots=shots)
    for item in items:
        question = item.prompt.rsplit("\nQuestion: ", 1)[1].removesuffix("\nAnswer:")
        answers, ctx = gold[question]
        assert tuple(answers) == item.answers
        assert 0.9 * length <= item.tokens == len(encode(item.prompt)) <= length - S.RAG_NEW_TOKENS
        assert item.prompt.count("\nAnswer: ") == shots + 1  # the format line and one per demo
        starts = [m.start() for m in re.finditer(r"Document \(Title: ", item.prompt)][
            shots:
        ]  # a passage per demo first
        index = starts.index(item.prompt.index(f"Document (Title: {ctx['title']}): {ctx['text']}"))
        assert abs(index / (len(starts) - 1) - item.depth) <= 0.5 / (len(starts) - 1) + 1e-9
    assert items == S.rag_samples(
        encode, data_file=nq_file, lengths=[length], depths=[0.0, 0.5, 1.0], samples=2, shots=shots
    )


# ---------------------------------------------------------------- runners: oracle 100, empty 0


@pytest.mark.parametrize("kind", KINDS)
def test_run_needle_oracle_scores_100_and_empty_scores_0(kind):
    args = {"kind": kind, "lengths": [512, 1024], "depths": [0, 0.5, 1], "samples": 2, "progress": False}
    result = S.run_needle(FakeGenerator(needle_reply, max_context=1024), **args)
    assert result["score"] == 100.0 and result["n"] == 12
    assert result["grid"] == {str(n): {"0.0": 100.0, "0.5": 100.0, "1.0": 100.0} for n in (512, 1024)}
    assert S.run_needle(FakeGenerator(lambda p: ""), **args)["score"] == 0.0


def test_run_needle_on_essays_with_gpt2(shared_data, essays):
    tok = gpt2(shared_data)
    args = {
        "kind": "multivalue",
        "haystack": "essay",
        "haystack_dir": essays,
        "lengths": [2048],
        "depths": [0.25, 0.75],
        "progress": False,
    }
    assert S.run_needle(FakeGenerator(needle_reply, encode=tok.encode, max_context=2048), **args)["score"] == 100.0

    def half(p):
        return needle_reply(p).split(",")[0]  # the first of four values

    assert S.run_needle(FakeGenerator(half, encode=tok.encode, max_context=2048), **args)["score"] == 25.0


def test_run_kv_retrieval_oracle_and_empty(capsys):
    args = {"lengths": [512, 1024], "depths": [0.0, 1.0], "samples": 2}
    result = S.run_kv_retrieval(FakeGenerator(kv_reply), **args)
    assert result["score"] == 100.0 and result["n"] == 8 and set(result["grid"]) == {"512", "1024"}
    assert "[json_kv] length 1024 depth 1: 100.0" in capsys.readouterr().err  # progress lines
    assert S.run_kv_retrieval(FakeGenerator(lambda p: ""), progress=False, **args)["score"] == 0.0


def test_run_kv_retrieval_from_file(kv_file):
    result = S.run_kv_retrieval(
        FakeGenerator(kv_reply), lengths=[2048], depths=[0.5], data_file=kv_file, samples=2, progress=False
    )
    assert result["score"] == 100.0


def test_run_rag_oracle_and_empty(nq_file):
    args = {"data_file": nq_file, "lengths": [1024, 2048], "depths": [0.0, 0.5], "samples": 2, "seed": 3}
    gold = {s.prompt: s.answers[0] for s in S.rag_samples(word_encode, **args)}  # side channel: prompt -> answer
    oracle = FakeGenerator(lambda p: " " + gold[p] + "\nQuestion: junk that mentions nothing")
    result = S.run_rag(oracle, progress=False, **args)
    assert result["score"] == 100.0 and result["n"] == 8 and set(oracle.stops) == {("\n",)}
    assert S.run_rag(FakeGenerator(lambda p: ""), progress=False, **args)["score"] == 0.0


# ---------------------------------------------------------------- errors


def test_lengths_beyond_the_model_context_are_rejected(tmp_path):
    small = FakeGenerator(needle_reply, max_context=1024)
    for run in (lambda: S.run_needle(small, lengths=[2048]), lambda: S.run_kv_retrieval(small, lengths=[512, 4096]),
                lambda: S.run_rag(small, data_file=tmp_path / "x.jsonl", lengths=[2048])):  # fmt: skip
        with pytest.raises(ConfigError) as exc:
            run()
        one_line(exc, "--context-lengths")
        assert "1024" in str(exc.value)


def test_bad_options_raise_one_line_config_errors(tmp_path):
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"question": "q"\n')
    wrong_schema = tmp_path / "wrong.jsonl"
    wrong_schema.write_text('{"key": "k"}\n')
    cases = [
        ("--kind", lambda: S.needle_samples(word_encode, kind="haystack", lengths=[512])),
        ("--haystack", lambda: S.needle_samples(word_encode, haystack="lorem", lengths=[512])),
        ("--depths", lambda: S.needle_samples(word_encode, lengths=[512], depths=[1.5])),
        ("--haystack-dir", lambda: S.needle_samples(word_encode, haystack="essay", lengths=[512])),
        (
            "--haystack-dir",
            lambda: S.needle_samples(word_encode, haystack="essay", haystack_dir=tmp_path / "none", lengths=[512]),
        ),
        ("--context-lengths", lambda: S.needle_samples(word_encode, lengths=[60])),
        ("--context-lengths", lambda: S.needle_samples(word_encode, lengths=[])),
        ("--samples", lambda: S.kv_samples(word_encode, lengths=[512], samples=0)),
        ("--data-file", lambda: S.rag_samples(word_encode, data_file=tmp_path / "missing.jsonl.gz", lengths=[512])),
        ("--data-file", lambda: S.rag_samples(word_encode, data_file=bad_json, lengths=[512])),
        ("--data-file", lambda: S.kv_samples(word_encode, data_file=wrong_schema, lengths=[512])),
    ]
    for option, call in cases:
        with pytest.raises(ConfigError) as exc:
            call()
        one_line(exc, option)


# ---------------------------------------------------------------- plots


def _is_png(path: Path) -> bool:
    return path.is_file() and path.stat().st_size > 1000 and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_needle_heatmap_png(tmp_path):
    result = S.run_needle(FakeGenerator(needle_reply), lengths=[512, 1024], depths=[0, 0.5, 1], progress=False)
    result["grid"]["1024"]["0.5"] = 37.5
    assert _is_png(plot_needle_heatmap(result["grid"], tmp_path / "plots" / "niah.png", "niah_single"))
    assert _is_png(plot_needle_heatmap(result, tmp_path / "whole.png", ""))  # the runner's whole result works too
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["niah.png", "plots", "whole.png"]  # no temporary files left
    with pytest.raises(ConfigError) as exc:
        plot_needle_heatmap({}, tmp_path / "empty.png", "")
    one_line(exc, "grid")


def test_loss_curve_and_group_size_pngs(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    lines = [
        {"step": s, "loss": 5.0 / s, "attn/focus/max_group_share": 0.2 + s / 100, "attn/focus/entropy": 1.0 / s}
        for s in range(1, 41)
    ]
    lines += [{"step": s, "val_loss": 4.0 / s * 2, "val_ppl": 2.0} for s in (10, 20, 30, 40)]
    metrics.write_text(
        "\n".join(map(json.dumps, lines)) + '\n{"step": 41, "lo', encoding="utf-8"
    )  # a half-written last line
    assert _is_png(plot_loss_curves(metrics, tmp_path / "loss.png"))
    assert _is_png(plot_group_sizes(metrics, tmp_path / "focus.png"))
    plain = tmp_path / "plain.jsonl"
    plain.write_text('{"step": 1, "loss": 3.0}\n', encoding="utf-8")
    with pytest.raises(ConfigError) as exc:
        plot_group_sizes(plain, tmp_path / "none.png")
    one_line(exc, "attn/focus/")
    with pytest.raises(ConfigError) as exc:
        plot_loss_curves(tmp_path / "absent.jsonl", tmp_path / "x.png")
    one_line(exc, "metrics_jsonl")
    assert not (tmp_path / "none.png").exists()


def _small_nq(tmp_path: Path) -> Path:
    rows = [
        {
            "question": f"what is item {i}",
            "answers": [f"answer{i}"],
            "ctxs": [{"title": f"T{i}", "text": f"item {i} is answer{i}. " + "filler words here " * 2, "isgold": True}],
        }
        for i in range(30)
    ]
    path = tmp_path / "nq.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_default_lengths_too_short_for_the_prompt_are_skipped_with_a_note(tmp_path, capsys):
    """A small model's default lengths (1/4, 1/2, 1 of its context) can start below what a prompt needs
    without filler: that length is skipped with one note, the others run."""
    nq = _small_nq(tmp_path)
    small = FakeGenerator(lambda p: "", max_context=256)
    for name, run in (
        ("niah_single", lambda: S.run_needle(small, depths=[0.5], progress=False)),
        ("json_kv", lambda: S.run_kv_retrieval(small, depths=[0.5], progress=False)),
        ("rag_nq", lambda: S.run_rag(small, data_file=nq, depths=[0.5], progress=False)),
    ):
        result = run()
        notes = capsys.readouterr().err.strip().splitlines()
        assert len(notes) >= 1 and all(
            n.startswith("note: --context-lengths: skipping ") and name in n for n in notes
        ), notes
        assert "256" in result["grid"] and "64" not in result["grid"], result["grid"]
        assert result["n"] == len(result["grid"])


def test_when_every_length_is_too_short_the_error_is_one_line(capsys):
    with pytest.raises(ConfigError) as exc:
        S.needle_samples(word_encode, lengths=[40, 60])
    one_line(exc, "--context-lengths")
    assert "60 is too short" in str(exc.value) and capsys.readouterr().err == ""
