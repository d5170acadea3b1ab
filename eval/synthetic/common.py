"""What every synthetic task shares: scores, the sample record, templates, option checks, prompt
sizing and the runner that generates and scores samples."""

from __future__ import annotations

import functools
import gzip
import itertools
import json
import random
import sys
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Protocol, TextIO

from core.errors import ConfigError, check_min, check_range
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
_ADJECTIVES = tuple(
    (
        "ancient bitter brave bright broad calm clever cold curious damp dark eager early empty fancy fierce "
        "gentle giant golden grumpy hidden hollow humble icy jolly kind lazy little lively loud lucky mellow "
        "misty narrow noisy odd pale plain proud quick quiet rapid rough rusty shiny silent silly sleepy "
        "smooth spicy steep sticky swift tame tiny vast wicked wild witty young"
    ).split()
)
_NOUNS = tuple(
    (
        "anchor apple badger basket beacon blanket bottle bridge candle canyon castle cherry cloud comet "
        "copper cottage crayon desert dragon engine falcon feather forest garden glacier hammer harbor helmet "
        "island jacket kettle ladder lantern lemon marble meadow mirror needle orchard otter pepper pillow "
        "planet pocket puzzle quarry rabbit ribbon saddle shadow spider statue teapot thunder tunnel valley "
        "velvet violin wagon walrus"
    ).split()
)

DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
NEEDLE_NEW_TOKENS = 32
KV_NEW_TOKENS = 64  # a uuid is ~25 GPT-2 tokens and ~40 for a digit-splitting SentencePiece vocabulary
RAG_NEW_TOKENS = 20  # HELMET's generation_max_length for RAG
RAG_STOP = ("\n",)  # HELMET stops RAG answers at the first newline


# ------------------------------------------------------------------ option checks


def check_lengths(lengths: Sequence[int] | None, max_context: int | None) -> list[int]:
    if lengths is None:
        if max_context is None:
            raise ConfigError("--context-lengths: give one or more prompt lengths in tokens, e.g. 1024,2048")
        # Without a choice: a quarter, half and all of the model's context.
        lengths = [max_context // 4, max_context // 2, max_context]
    out = _distinct_values(lengths, int, "--context-lengths", "prompt lengths in tokens, e.g. 1024,2048")
    for length in out:
        check_min("--context-lengths", length, 1)
        if max_context is not None and length > max_context:
            raise ConfigError(
                f"--context-lengths: {length} exceeds the generation context of {max_context} tokens; raise it with "
                f"--max-context {length} (default model.max_seq_len)"
            )
    return out


def _distinct_values(values: Iterable[object], kind: Callable[[Any], Any], option: str, what: str) -> list:
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


def _check_common(
    lengths: Sequence[int], depths: Sequence[float], samples: int, max_new_tokens: int, shots: int = 0
) -> tuple[list[int], list[float]]:
    """The options every task shares, checked; returns the grid (lengths, depths) as ``check_lengths`` and
    ``_check_depths`` give it."""
    lengths, depths = check_lengths(lengths, None), _check_depths(depths)
    check_min("--samples", samples, 1)
    check_min("--max-new-tokens", max_new_tokens, 1)
    check_min("--shots", shots, 0)
    return lengths, depths


# ------------------------------------------------------------------ sizing


class PromptTooShort(ConfigError):
    """A context length below what a task's prompt needs with no filler at all (``by_length`` skips it)."""

    def __init__(self, length: int, what: str, tokens: int, new: int):
        self.length = length
        self.need = f"{what}: its prompt needs {tokens} tokens without filler, plus {new} new tokens"
        super().__init__(
            f"--context-lengths: {length} is too short for {self.need}; give longer --context-lengths (past the "
            "model's context with --max-context)"
        )


def _too_short(length: int, what: str, tokens: int, new: int) -> PromptTooShort:
    return PromptTooShort(length, what, tokens, new)


def by_length(lengths: Sequence[int], samples_at: Callable[[int], list[Sample]]) -> list[Sample]:
    """``samples_at(length)`` for every length, in order. A length too short for the task's prompt is
    skipped with a one-line note on stderr (the default lengths, a quarter, half and all of a small
    model's context, can start below it); when every length is too short, the error says so."""
    out: list[Sample] = []
    skipped: list[PromptTooShort] = []
    for length in lengths:
        try:
            out.extend(samples_at(length))
        except PromptTooShort as exc:
            skipped.append(exc)
    if not out and skipped:
        raise skipped[-1]  # nothing left to run: one error line, no notes
    for short in skipped:
        print(
            f"note: --context-lengths: skipping {short.length}, too short for {short.need}", file=sys.stderr, flush=True
        )
    return out


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
        assert hi is not None  # set whenever lo is None
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


class BuildPrompt(Protocol):
    def __call__(self, n: int, depth: float) -> str: ...


class Case(NamedTuple):
    """One sample of a task: its prompt with ``n`` filler units and the gold item at ``depth``, its gold answers,
    and the most filler units its data holds (None: no limit)."""

    build: BuildPrompt
    answers: tuple[str, ...]
    limit: int | None = None


def fitted_samples(
    task: str, encode: Encode, lengths: Sequence[int], depths: Sequence[float], cases: Sequence[Case], *,
    what: str, metric: str, new: int, data_file: str | Path | None = None, unit: str = "",
) -> list[Sample]:  # fmt: skip
    """A ``Sample`` per (length, case, depth), sorted by (length, depth) (stable: cases stay in order within a cell).
    At each length a case's filler is fitted to ``length - new`` tokens at the first depth (``_fit``, then
    ``_check_filled`` for ``unit`` of ``data_file``) and shrunk from there at the others; ``by_length`` skips a
    length too short for the task (``what``)."""

    def at(length: int) -> list[Sample]:
        out: list[Sample] = []
        budget = length - new
        for case in cases:
            fill = None
            for depth in depths:
                build = functools.partial(case.build, depth=depth)
                if fill is None:
                    text, tokens, fill = _fit(
                        build, encode, budget, limit=case.limit, what=what, length=length, new=new
                    )
                    _check_filled(fill, case.limit, tokens, budget, data_file, unit, length)
                else:
                    text, tokens, _ = _shrink(build, encode, budget, fill, what=what, length=length, new=new)
                out.append(Sample(task, length, depth, text, case.answers, metric, tokens))
        return out

    return sorted(by_length(lengths, at), key=lambda s: (s.length, s.depth))


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
        self._it, self._items = items, list[Any]()

    def take(self, n: int) -> list:
        while len(self._items) < n:
            self._items.append(next(self._it))
        return self._items[:n]


def _open_text(path: Path) -> TextIO:
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


def _check_filled(
    n: int, limit: int | None, tokens: int, budget: int, data_file: str | Path | None, unit: str, length: int
) -> None:
    # A data file can run out of filler; a much shorter prompt than asked for would mislabel the grid.
    if limit is not None and n >= limit and tokens < 0.9 * budget:
        raise ConfigError(
            f"--context-lengths: {length} needs more {unit} than {data_file} holds (the prompt reached {tokens} tokens)"
        )


def _random_key(rng: random.Random, key_type: str) -> str:
    if key_type == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    return f"{rng.choice(_ADJECTIVES)}-{rng.choice(_NOUNS)}"


# ------------------------------------------------------------------ running samples


def run_samples(
    make: Callable[..., list[Sample]], generator: Generator, lengths: Sequence[int] | None, *, max_new_tokens: int,
    progress: bool, stop: Sequence[str] = (), **options: Any,
) -> dict:  # fmt: skip
    """``evaluate_samples`` on ``make(generator.encode, lengths=, max_new_tokens=, **options)`` (a task's samples);
    ``lengths`` defaults to a quarter, half and all of ``generator.max_context``, and none may exceed it."""
    lengths = check_lengths(lengths, generator.max_context)
    items = make(generator.encode, lengths=lengths, max_new_tokens=max_new_tokens, **options)
    return evaluate_samples(generator, items, max_new_tokens=max_new_tokens, stop=stop, progress=progress)


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
