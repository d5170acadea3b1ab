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

from eval.synthetic.common import *  # noqa: F403
from eval.synthetic.kv import kv_samples, run_kv_retrieval  # noqa: F401
from eval.synthetic.needle import needle_samples, run_needle  # noqa: F401
from eval.synthetic.rag import rag_samples, run_rag  # noqa: F401
