"""RULER needles in a haystack (niah single / multikey / multivalue / multiquery)."""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from core.errors import ConfigError, check_choice
from eval.generation import Generator
from eval.synthetic.common import (
    _NEEDLE_SHAPES,
    DEFAULT_DEPTHS,
    HAYSTACKS,
    KEY_TYPES,
    NEEDLE,
    NEEDLE_KINDS,
    NEEDLE_NEW_TOKENS,
    NIAH_TEMPLATE,
    NOISE,
    Case,
    Encode,
    Sample,
    _check_common,
    _insert,
    _random_key,
    fitted_samples,
    run_samples,
)

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
    lengths, depths = _check_common(lengths, depths, samples, max_new_tokens)
    if haystack == "essay" and haystack_dir is None:
        raise ConfigError("--haystack-dir: required with --haystack essay (a folder of .txt essays)")
    words = _essay_words(str(haystack_dir)) if haystack == "essay" else None
    task = f"niah_{kind}"
    needles = [_make_needles(kind, key_type, random.Random(f"{seed}:{task}:{i}")) for i in range(samples)]

    def case(nd: _Needles) -> Case:
        return Case(lambda n, depth: _needle_prompt(nd, _haystack(haystack, words, n, nd.placed(depth))), nd.answers)

    return fitted_samples(
        task, encode, lengths, depths, [case(nd) for nd in needles], what=f"{task} ({haystack} haystack)",
        metric="string_match_all", new=max_new_tokens,
    )  # fmt: skip


def run_needle(
    generator: Generator, *, kind: str = "single", haystack: str = "noise", haystack_dir: str | Path | None = None,
    lengths: Sequence[int] | None = None, depths: Sequence[float] = DEFAULT_DEPTHS, samples: int = 1, seed: int = 0,
    max_new_tokens: int = NEEDLE_NEW_TOKENS, key_type: str = "words", progress: bool = True,
) -> dict:  # fmt: skip
    """RULER niah_{kind} over lengths x depths, scored with string_match_all. ``lengths`` defaults to a
    quarter, half and all of ``generator.max_context``; none may exceed it."""
    return run_samples(
        needle_samples, generator, lengths, max_new_tokens=max_new_tokens, progress=progress, kind=kind,
        haystack=haystack, haystack_dir=haystack_dir, depths=depths, samples=samples, seed=seed, key_type=key_type,
    )  # fmt: skip
