"""Offline synthetic long-context evaluations: RULER-style needles in a haystack, HELMET-style JSON
key-value retrieval and RAG question answering with distractor passages.

Every prompt is generated locally and seeded, then sized with the model's own tokenizer so that the
prompt plus ``max_new_tokens`` fits the requested length (RULER's convention: the length counts the
answer, so generation never truncates the prompt). Data folders and files are parameters.

Scores follow the benchmarks: RULER's ``string_match_all`` (needles), HELMET's
``substring_exact_match`` (kv retrieval, RAG), reported 0..100 per task and per (length, depth).

Runners take any object with ``encode(text)``, ``max_context`` and
``generate(prompt, max_new_tokens, *, stop=())`` (``eval.generation.TextGenerator`` or a test fake).
"""

from __future__ import annotations

import gzip
import itertools
import json
import random
import re
import sys
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from core.errors import ConfigError, check_choice, check_min, check_range
from eval.generation import Generator
from eval.longbench_metrics import normalize_answer  # SQuAD normalisation, as HELMET uses

Encode = Callable[[str], Sequence[int]]


# ------------------------------------------------------------------ scoring


def string_match_all(pred: str, refs: Sequence[str]) -> float:
    """RULER: the fraction of references that occur in the prediction (case-insensitive)."""
    if not refs:
        return 0.0
    low = pred.lower()
    return sum(r.lower() in low for r in refs) / len(refs)


def string_match_part(pred: str, refs: Sequence[str]) -> float:
    """RULER: 1 if any reference occurs in the prediction (case-insensitive)."""
    low = pred.lower()
    return float(any(r.lower() in low for r in refs))


def substring_exact_match(pred: str, answers: str | Sequence[str]) -> float:
    """HELMET: 1 if any normalised answer is a substring of the normalised prediction."""
    answers = [answers] if isinstance(answers, str) else answers
    norm = normalize_answer(pred)
    return float(any(normalize_answer(a) in norm for a in answers))


METRICS: dict[str, Callable[[str, Sequence[str]], float]] = {
    "string_match_all": string_match_all,
    "string_match_part": string_match_part,
    "substring_exact_match": substring_exact_match,
}


@dataclass(frozen=True)
class Sample:
    """One generated prompt with its gold answers; ``tokens`` is the prompt's length in tokens."""

    task: str
    length: int
    depth: float
    prompt: str
    answers: tuple[str, ...]
    metric: str
    tokens: int


# ------------------------------------------------------------------ templates (data, as the benchmarks define them)

# RULER scripts/data/synthetic/constants.py ('niah' template + answer_prefix, concatenated for base models).
NIAH_TEMPLATE = (
    "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the {type_needle_v} afterwards.\n{context}\n"
    "What are all the special magic {type_needle_v} for {query} mentioned in the provided text?"
    " The special magic {type_needle_v} for {query} mentioned in the provided text are"
)
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE_KINDS = ("single", "multikey", "multivalue", "multiquery")
HAYSTACKS = ("noise", "essay")
KEY_TYPES = ("words", "uuids")
# (keys in the haystack, values per key, keys queried): RULER's niah_single / multikey_1 / multivalue / multiquery.
_NEEDLE_SHAPES = {"single": (1, 1, 1), "multikey": (4, 1, 1), "multivalue": (1, 4, 1), "multiquery": (4, 1, 4)}

# HELMET json_kv (prompt from lost-in-the-middle kv_retrieval.prompt), 'Key: "..."' as lost-in-the-middle quotes it.
KV_TEMPLATE = (
    "{context}\n\nExtract the value corresponding to the specified key in the JSON object below.\n\n"
    "{demos}Key: {question}\nCorresponding value:"
)
KV_DEMO = "Key: {key}\nCorresponding value:{value}"

# HELMET RAG (kilt_nq): instruction, passages, demos.
RAG_TEMPLATE = (
    "Use the given documents to write a concise and short answer to the question. "
    "Write your answer in the following format:\nAnswer: [answer]\n\n{demos}{context}\n\nQuestion: {question}\nAnswer:"
)
RAG_PASSAGE = "Document (Title: {title}): {text}"
RAG_DEMO = "{documents}\n\nQuestion: {question}\nAnswer: {answer}"

# Stand-ins for RULER's wonderwords adjective-noun keys (that list is not shipped offline).
_ADJECTIVES = (
    "ancient",
    "bitter",
    "brave",
    "bright",
    "broad",
    "calm",
    "clever",
    "cold",
    "curious",
    "damp",
    "dark",
    "eager",
    "early",
    "empty",
    "fancy",
    "fierce",
    "gentle",
    "giant",
    "golden",
    "grumpy",
    "hidden",
    "hollow",
    "humble",
    "icy",
    "jolly",
    "kind",
    "lazy",
    "little",
    "lively",
    "loud",
    "lucky",
    "mellow",
    "misty",
    "narrow",
    "noisy",
    "odd",
    "pale",
    "plain",
    "proud",
    "quick",
    "quiet",
    "rapid",
    "rough",
    "rusty",
    "shiny",
    "silent",
    "silly",
    "sleepy",
    "smooth",
    "spicy",
    "steep",
    "sticky",
    "swift",
    "tame",
    "tiny",
    "vast",
    "wicked",
    "wild",
    "witty",
    "young",
)
_NOUNS = (
    "anchor",
    "apple",
    "badger",
    "basket",
    "beacon",
    "blanket",
    "bottle",
    "bridge",
    "candle",
    "canyon",
    "castle",
    "cherry",
    "cloud",
    "comet",
    "copper",
    "cottage",
    "crayon",
    "desert",
    "dragon",
    "engine",
    "falcon",
    "feather",
    "forest",
    "garden",
    "glacier",
    "hammer",
    "harbor",
    "helmet",
    "island",
    "jacket",
    "kettle",
    "ladder",
    "lantern",
    "lemon",
    "marble",
    "meadow",
    "mirror",
    "needle",
    "orchard",
    "otter",
    "pepper",
    "pillow",
    "planet",
    "pocket",
    "puzzle",
    "quarry",
    "rabbit",
    "ribbon",
    "saddle",
    "shadow",
    "spider",
    "statue",
    "teapot",
    "thunder",
    "tunnel",
    "valley",
    "velvet",
    "violin",
    "wagon",
    "walrus",
)

DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
NEEDLE_NEW_TOKENS = 32
KV_NEW_TOKENS = 64  # a uuid is ~25 GPT-2 tokens and ~40 for a digit-splitting SentencePiece vocabulary
RAG_NEW_TOKENS = 20  # HELMET's generation_max_length for RAG


# ------------------------------------------------------------------ option checks


def _check_lengths(lengths: Sequence[int] | None, max_context: int | None) -> list[int]:
    if lengths is None:
        if max_context is None:
            raise ConfigError("--context-lengths: give one or more prompt lengths in tokens, e.g. 1024,2048")
        # Without a choice: a quarter, half and all of the model's context.
        lengths = [max_context // 4, max_context // 2, max_context]
    out = _distinct_values(lengths, int, "--context-lengths", "prompt lengths in tokens, e.g. 1024,2048")
    for length in out:
        check_min("--context-lengths", length, 1)
        if max_context is not None and length > max_context:
            raise ConfigError(f"--context-lengths: {length} exceeds the model's context of {max_context} tokens")
    return out


def _distinct_values(values, kind: type, option: str, what: str) -> list:
    """``values`` as ``kind``, duplicates dropped in order; one-line errors naming ``option``."""
    try:
        out = list(dict.fromkeys(kind(x) for x in values))
    except (TypeError, ValueError):
        raise ConfigError(f"{option}: {values!r} is not a list of {what}") from None
    if not out:
        raise ConfigError(f"{option}: empty; give one or more {what}")
    return out


def _check_depths(depths: Sequence[float]) -> list[float]:
    out = _distinct_values(depths, float, "--depths", "fractions in [0, 1], e.g. 0,0.5,1")
    for depth in out:
        check_range("--depths", depth, 0.0, 1.0)
    return out


def _check_common(samples: int, max_new_tokens: int, shots: int = 0) -> None:
    check_min("--samples", samples, 1)
    check_min("--max-new-tokens", max_new_tokens, 1)
    check_min("--shots", shots, 0)


# ------------------------------------------------------------------ sizing


def _too_short(length: int, what: str, tokens: int, new: int) -> ConfigError:
    return ConfigError(
        f"--context-lengths: {length} is too short for {what}: its prompt needs {tokens} tokens without filler, plus "
        f"{new} new tokens"
    )


def _fit(
    build: Callable[[int], str], encode: Encode, budget: int, *, limit: int | None, what: str, length: int, new: int
) -> tuple[str, int, int]:
    """(prompt, tokens, n) for the largest filler count n (<= limit) whose prompt fits ``budget`` tokens.

    Token counts are nearly, not exactly, monotone in n, so only prompts measured to fit are returned.
    """
    cap = limit if limit is not None else 1 << 40
    measured: dict[int, tuple[str, int]] = {}

    def size(n: int) -> int:
        if n not in measured:
            text = build(n)
            measured[n] = (text, len(encode(text)))
        return measured[n][1]

    base = size(0)
    if base > budget:
        raise _too_short(length, what, base, new)
    # Two estimates of tokens per unit (a short probe, then one near the target) give a close guess,
    # so long prompts need a dozen encodes rather than a bisection from scratch.
    guess = min(cap, 16)
    for _ in range(2):
        grown = size(guess) - base
        if guess == 0 or grown <= 0:
            break
        guess = min(cap, max(1, int(guess * (budget - base) / grown)))
    # Within 0.2% of the budget is close enough: each encode of a long prompt costs most of a second.
    tol = budget // 500
    lo: int | None = guess if size(guess) <= budget else None
    hi: int | None = None if lo is not None else guess
    step = max(1, guess // 256)
    while lo is None:  # gallop down to a prompt that fits
        n = max(0, hi - step)
        if size(n) <= budget:
            lo = n
        else:
            hi, step = n, step * 2
    while hi is None and lo < cap and size(lo) < budget - tol:  # gallop up to one that does not
        n = min(cap, lo + step)
        if size(n) <= budget:
            lo, step = n, step * 2
        else:
            hi = n
    while hi is not None and hi - lo > 1 and size(lo) < budget - tol:
        mid = (lo + hi) // 2
        if size(mid) <= budget:
            lo = mid
        else:
            hi = mid
    return (*measured[lo], lo)


def _shrink(
    build: Callable[[int], str], encode: Encode, budget: int, n: int, *, what: str, length: int, new: int
) -> tuple[str, int, int]:
    """The prompt with ``n`` filler units, or fewer until it fits (another depth may tokenize a token longer)."""
    while True:
        text = build(n)
        tokens = len(encode(text))
        if tokens <= budget:
            return text, tokens, n
        if n == 0:
            raise _too_short(length, what, tokens, new)
        n -= 1


def _insert(pieces: Sequence[str], placed: Sequence[tuple[float, str]]) -> list[str]:
    """``pieces`` with each (depth, text) inserted at the boundary nearest ``depth * len(pieces)``."""
    slots = sorted((round(depth * len(pieces)), order, text) for order, (depth, text) in enumerate(placed))
    out: list[str] = []
    prev = 0
    for pos, _, text in slots:
        out.extend(pieces[prev:pos])
        out.append(text)
        prev = pos
    out.extend(pieces[prev:])
    return out


class _Lazy:
    """A prefix-stable list drawn on demand from an iterator, so longer prompts extend shorter ones."""

    def __init__(self, items: Iterator):
        self._it, self._items = items, []

    def take(self, n: int) -> list:
        while len(self._items) < n:
            self._items.append(next(self._it))
        return self._items[:n]


def _open_text(path: Path):
    return gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else path.open(encoding="utf-8")


def _read_jsonl(data_file: str | Path, required: tuple[str, ...], what: str) -> list[dict]:
    path = Path(data_file).expanduser()
    if not path.is_file():
        raise ConfigError(f"--data-file: no such file {str(path)!r} (expected {what} .jsonl or .jsonl.gz)")
    rows = []
    try:
        with _open_text(path) as fh:
            for number, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                row = json.loads(line)
                if not isinstance(row, dict) or any(k not in row for k in required):
                    raise ConfigError(f"--data-file: {path} line {number} is not {what} (needs {', '.join(required)})")
                rows.append(row)
    except (OSError, EOFError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(
            f"--data-file: {path} is not readable {what} JSON lines ({str(exc).splitlines()[0][:100]})"
        ) from None
    if not rows:
        raise ConfigError(f"--data-file: {path} holds no {what} rows")
    return rows


def _pick(n_rows: int, samples: int, seed: str, data_file: str | Path) -> list[int]:
    if samples > n_rows:
        raise ConfigError(f"--samples: {samples} exceeds the {n_rows} usable examples in {data_file}")
    return random.Random(seed).sample(range(n_rows), samples)


# ------------------------------------------------------------------ RULER needles


_NOISE_SENTENCES = tuple(re.split(r"(?<=\.) ", NOISE))
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|(?<=[.!?][\"')\]])\s+")


def _singular(template: str) -> str:
    # RULER's rewrite when a single value is asked for (num_needle_q * num_needle_v == 1).
    return template.replace("Some", "A").replace("are all", "is").replace("are", "is").replace("answers", "answer")


NIAH_TEMPLATE_SINGLE = _singular(NIAH_TEMPLATE)


@lru_cache(maxsize=4)
def _essay_words(directory: str) -> tuple[str, ...]:
    path = Path(directory).expanduser()
    if not path.is_dir():
        raise ConfigError(f"--haystack-dir: no such directory {directory!r} (expected a folder of .txt essays)")
    text = " ".join(f.read_text(encoding="utf-8", errors="replace") for f in sorted(path.glob("*.txt")))
    if not text.split():
        raise ConfigError(f"--haystack-dir: {directory!r} holds no non-empty .txt files")
    return tuple(text.split())  # RULER collapses all whitespace of the concatenated essays


@dataclass(frozen=True)
class _Needles:
    keys: tuple[str, ...]  # queried keys first
    values: tuple[tuple[str, ...], ...]  # per key
    queried: int
    others: tuple[float, ...]  # fixed depths of every needle but the first, per sample

    @property
    def sentences(self) -> list[str]:
        return [
            NEEDLE.format(type_needle_v="numbers", key=k, value=v) for k, vs in zip(self.keys, self.values) for v in vs
        ]

    @property
    def answers(self) -> tuple[str, ...]:
        return tuple(v for vs in self.values[: self.queried] for v in vs)

    def placed(self, depth: float) -> list[tuple[float, str]]:
        # The first queried needle sits at the requested depth; the rest at their own seeded depths.
        first, *rest = self.sentences
        return [(depth, first), *zip(self.others, rest)]


def _random_key(rng: random.Random, key_type: str) -> str:
    if key_type == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    return f"{rng.choice(_ADJECTIVES)}-{rng.choice(_NOUNS)}"


def _distinct(draw: Callable[[], str], n: int) -> tuple[str, ...]:
    seen: dict[str, None] = {}
    while len(seen) < n:
        seen[draw()] = None
    return tuple(seen)


def _make_needles(kind: str, key_type: str, rng: random.Random) -> _Needles:
    n_keys, n_values, n_query = _NEEDLE_SHAPES[kind]
    keys = _distinct(lambda: _random_key(rng, key_type), n_keys)
    flat = _distinct(lambda: str(rng.randint(10**6, 10**7 - 1)), n_keys * n_values)  # 7-digit values
    values = tuple(flat[i * n_values : (i + 1) * n_values] for i in range(n_keys))
    others = tuple(rng.random() for _ in range(n_keys * n_values - 1))
    return _Needles(keys, values, n_query, others)


def _haystack(kind: str, words: tuple[str, ...] | None, n: int, placed: Sequence[tuple[float, str]]) -> str:
    """``n`` filler units (noise sentences or essay words) with the needles inserted at sentence boundaries."""
    if kind == "noise":
        # RULER repeats the noise paragraph one per line and puts each needle on a line of its own.
        sentences = [_NOISE_SENTENCES[j % len(_NOISE_SENTENCES)] for j in range(n)]
        lines = [" ".join(sentences[j : j + len(_NOISE_SENTENCES)]) for j in range(0, n, len(_NOISE_SENTENCES))]
        return "\n".join(_insert(lines, placed))
    assert words is not None
    text = " ".join((words * (n // len(words) + 1))[:n])  # essays repeat when a length needs more words
    sentences = _SENTENCE_END.split(text) if text else []
    return " ".join(_insert(sentences, placed))


def _needle_prompt(needles: _Needles, context: str) -> str:
    keys = needles.keys[: needles.queried]
    query = keys[0] if len(keys) == 1 else ", ".join(keys[:-1]) + ", and " + keys[-1]
    single = len(needles.answers) == 1
    template = NIAH_TEMPLATE_SINGLE if single else NIAH_TEMPLATE
    return template.format(type_needle_v="number" if single else "numbers", context=context, query=query)


def needle_samples(
    encode: Encode, *, kind: str = "single", haystack: str = "noise", haystack_dir: str | Path | None = None,
    lengths: Sequence[int], depths: Sequence[float] = DEFAULT_DEPTHS, samples: int = 1, seed: int = 0,
    key_type: str = "words", max_new_tokens: int = NEEDLE_NEW_TOKENS,
) -> list[Sample]:  # fmt: skip
    """RULER niah prompts for every (length, depth, sample), each sized to ``length - max_new_tokens`` tokens.

    A sample keeps its needles (and the depths of the needles not asked about) across lengths and depths,
    so a grid row differs only in where the first queried needle sits.
    """
    check_choice("--kind", kind, NEEDLE_KINDS)
    check_choice("--haystack", haystack, HAYSTACKS)
    check_choice("--key-type", key_type, KEY_TYPES)
    lengths, depths = _check_lengths(lengths, None), _check_depths(depths)
    _check_common(samples, max_new_tokens)
    if haystack == "essay" and haystack_dir is None:
        raise ConfigError("--haystack-dir: required with --haystack essay (a folder of .txt essays)")
    words = _essay_words(str(haystack_dir)) if haystack == "essay" else None
    task = f"niah_{kind}"
    needles = [_make_needles(kind, key_type, random.Random(f"{seed}:{task}:{i}")) for i in range(samples)]
    out: list[Sample] = []
    for length in lengths:
        budget, what = length - max_new_tokens, f"{task} ({haystack} haystack)"
        for nd in needles:
            fill = None
            for depth in depths:

                def build(n, nd=nd, depth=depth):
                    return _needle_prompt(nd, _haystack(haystack, words, n, nd.placed(depth)))

                if fill is None:
                    text, tokens, fill = _fit(
                        build, encode, budget, limit=None, what=what, length=length, new=max_new_tokens
                    )
                else:
                    text, tokens, _ = _shrink(build, encode, budget, fill, what=what, length=length, new=max_new_tokens)
                out.append(Sample(task, length, depth, text, nd.answers, "string_match_all", tokens))
    return sorted(out, key=lambda s: (s.length, s.depth))  # stable: samples stay in order within a cell


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


def _file_pairs(rows, start: int, gold_key: str) -> list[tuple[str, str]]:
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
    lengths, depths = _check_lengths(lengths, None), _check_depths(depths)
    _check_common(samples, max_new_tokens, shots)
    task = "json_kv"
    golds, pools, limits = [], [], []
    if data_file is not None:
        rows = _kv_file(str(data_file))
        for index in _pick(len(rows), samples, f"{seed}:{task}", data_file):
            gold = rows[index][0]
            pairs = _file_pairs(rows, index, gold[0])
            if len(pairs) < shots:
                raise ConfigError(f"--shots: {shots} exceeds the {len(pairs)} key-value pairs in {data_file}")
            golds.append(gold)
            pools.append(_Lazy(iter(pairs)))
            limits.append(len(pairs) - shots)
    else:
        for i in range(samples):
            rng = random.Random(f"{seed}:{task}:{i}")
            golds.append((_random_key(rng, "uuids"), _random_key(rng, "uuids")))
            pools.append(_Lazy(_uuid_pairs(rng)))
            limits.append(None)
    out: list[Sample] = []
    for length in lengths:
        budget = length - max_new_tokens
        for gold, pool, limit in zip(golds, pools, limits):
            fill = None
            for depth in depths:

                def build(n, gold=gold, pool=pool, depth=depth):
                    return _kv_prompt(gold, pool.take(n + shots), depth, shots)

                if fill is None:
                    text, tokens, fill = _fit(
                        build, encode, budget, limit=limit, what=task, length=length, new=max_new_tokens
                    )
                    _check_filled(fill, limit, tokens, budget, data_file, "key-value pairs", length)
                else:
                    text, tokens, _ = _shrink(build, encode, budget, fill, what=task, length=length, new=max_new_tokens)
                out.append(Sample(task, length, depth, text, (gold[1],), "substring_exact_match", tokens))
    return sorted(out, key=lambda s: (s.length, s.depth))


def _check_filled(n: int, limit: int | None, tokens: int, budget: int, data_file, unit: str, length: int) -> None:
    # A data file can run out of filler; a much shorter prompt than asked for would mislabel the grid.
    if limit is not None and n >= limit and tokens < 0.9 * budget:
        raise ConfigError(
            f"--context-lengths: {length} needs more {unit} than {data_file} holds (the prompt reached {tokens} tokens)"
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
    lengths, depths = _check_lengths(lengths, None), _check_depths(depths)
    _check_common(samples, max_new_tokens, shots)
    rows = _nq_file(str(data_file))
    task = "rag_nq"
    if len(rows) < shots + 2:
        raise ConfigError(
            f"--data-file: {data_file} holds {len(rows)} usable rows, too few for {shots} shots and distractors"
        )
    setups = []
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
        setups.append((qa, [rows[j] for j in demo_ids], pool, list(itertools.accumulate(len(p.words) for p in pool))))
    out: list[Sample] = []
    for length in lengths:
        budget = length - max_new_tokens
        for qa, demos, pool, ends in setups:
            limit = ends[-1] if ends else 0
            fill = None
            for depth in depths:

                def build(n, qa=qa, demos=demos, pool=pool, ends=ends, depth=depth):
                    return _rag_prompt(qa, demos, pool, ends, n, depth)

                if fill is None:
                    text, tokens, fill = _fit(
                        build,
                        encode,
                        budget,
                        limit=limit,
                        what=f"{task} with {shots} shots",
                        length=length,
                        new=max_new_tokens,
                    )
                    _check_filled(fill, limit, tokens, budget, data_file, "distractor passages", length)
                else:
                    text, tokens, _ = _shrink(
                        build,
                        encode,
                        budget,
                        fill,
                        what=f"{task} with {shots} shots",
                        length=length,
                        new=max_new_tokens,
                    )
                out.append(Sample(task, length, depth, text, qa.answers, "substring_exact_match", tokens))
    return sorted(out, key=lambda s: (s.length, s.depth))


# ------------------------------------------------------------------ runners


def evaluate_samples(
    generator: Generator,
    items: Sequence[Sample],
    *,
    max_new_tokens: int,
    stop: Sequence[str] = (),
    progress: bool = True,
) -> dict:
    """{"score": 0..100 over all samples, "grid": {str(length): {str(depth): 0..100}}, "n": samples}."""
    grid: dict[str, dict[str, float]] = {}
    scores: list[float] = []
    for (length, depth), group in itertools.groupby(items, key=lambda s: (s.length, s.depth)):
        cell = [METRICS[s.metric](generator.generate(s.prompt, max_new_tokens, stop=stop), s.answers) for s in group]
        grid.setdefault(str(length), {})[str(depth)] = 100.0 * sum(cell) / len(cell)
        scores.extend(cell)
        if progress:
            print(
                f"[{items[0].task}] length {length} depth {depth:g}: {grid[str(length)][str(depth)]:.1f} ({len(cell)} "
                "samples)",
                file=sys.stderr,
                flush=True,
            )
    return {"score": 100.0 * sum(scores) / len(scores) if scores else 0.0, "grid": grid, "n": len(scores)}


def run_needle(
    generator: Generator, *, kind: str = "single", haystack: str = "noise", haystack_dir: str | Path | None = None,
    lengths: Sequence[int] | None = None, depths: Sequence[float] = DEFAULT_DEPTHS, samples: int = 1, seed: int = 0,
    max_new_tokens: int = NEEDLE_NEW_TOKENS, key_type: str = "words", progress: bool = True,
) -> dict:  # fmt: skip
    """RULER niah_{kind} over lengths x depths, scored with string_match_all. ``lengths`` defaults to a
    quarter, half and all of ``generator.max_context``; none may exceed it."""
    lengths = _check_lengths(lengths, generator.max_context)
    items = needle_samples(
        generator.encode, kind=kind, haystack=haystack, haystack_dir=haystack_dir, lengths=lengths, depths=depths,
        samples=samples, seed=seed, key_type=key_type, max_new_tokens=max_new_tokens,
    )  # fmt: skip
    return evaluate_samples(generator, items, max_new_tokens=max_new_tokens, progress=progress)


def run_kv_retrieval(
    generator: Generator, *, lengths: Sequence[int] | None = None, depths: Sequence[float] = DEFAULT_DEPTHS,
    data_file: str | Path | None = None, samples: int = 1, seed: int = 0, shots: int = 2,
    max_new_tokens: int = KV_NEW_TOKENS, progress: bool = True,
) -> dict:  # fmt: skip
    """HELMET json_kv over lengths x depths, scored with substring_exact_match of the gold value."""
    lengths = _check_lengths(lengths, generator.max_context)
    items = kv_samples(
        generator.encode, lengths=lengths, depths=depths, data_file=data_file, samples=samples, seed=seed,
        shots=shots, max_new_tokens=max_new_tokens,
    )  # fmt: skip
    return evaluate_samples(generator, items, max_new_tokens=max_new_tokens, progress=progress)


def run_rag(
    generator: Generator, *, data_file: str | Path, lengths: Sequence[int] | None = None,
    depths: Sequence[float] = DEFAULT_DEPTHS, samples: int = 1, seed: int = 0, shots: int = 2,
    max_new_tokens: int = RAG_NEW_TOKENS, progress: bool = True,
) -> dict:  # fmt: skip
    """HELMET-style RAG on NQ-open over lengths x depths (gold passage depth), substring_exact_match of any answer.
    Generation stops at the first newline, as HELMET does for RAG."""
    lengths = _check_lengths(lengths, generator.max_context)
    items = rag_samples(
        generator.encode, data_file=data_file, lengths=lengths, depths=depths, samples=samples, seed=seed,
        shots=shots, max_new_tokens=max_new_tokens,
    )  # fmt: skip
    return evaluate_samples(generator, items, max_new_tokens=max_new_tokens, stop=("\n",), progress=progress)
