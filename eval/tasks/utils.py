"""``custom_dataset`` and ``process_docs`` for the local task YAMLs: read the files of the offline data
bundle and turn them into the documents lm_eval's built-in tasks see, so the built-in prompts apply
unchanged.

``<task>_dataset(data_dir=None, **metadata)``: lm_eval passes the task's metadata (the YAML's, then
``--metadata`` / ``TaskManager(metadata=...)``, which win); the data directory is ``data_dir``, else
$FOCUSED_PRETRAIN_EVAL_DATA, else ~/.cache/focused-pretrain/eval_data (``eval.harness.local_dataset``).
``eval.harness.render_tasks`` copies this file next to copies of the YAMLs with ``data_dir`` filled in
(``!function utils.x`` resolves relative to the YAML). lm_eval calls process_docs each time it asks for
the documents; results are kept in memory per input dataset (its fingerprint) rather than in datasets'
cache files, which would pile up since the rendered folder is a new temporary path on every run.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable

import datasets
from lm_eval.tasks.hellaswag.utils import preprocess as hellaswag_preprocess

_DONE: dict[tuple[str, str], datasets.Dataset] = {}


def _memo(fn: Callable[[datasets.Dataset], datasets.Dataset]) -> Callable[[datasets.Dataset], datasets.Dataset]:
    @functools.wraps(fn)
    def wrapper(dataset: datasets.Dataset) -> datasets.Dataset:
        key = (fn.__name__, dataset._fingerprint)
        if key not in _DONE:
            _DONE[key] = fn(dataset)
        return _DONE[key]

    return wrapper


def _rows(fn: Callable[[dict], dict]) -> Callable[[dict], dict]:
    """A per-document function as a batched one: columns in, columns out (far fewer map calls)."""

    def batched(columns: dict) -> dict:
        docs = [dict(zip(columns, values)) for values in zip(*columns.values())]
        out = [fn(doc) for doc in docs]
        return {key: [row[key] for row in out] for key in out[0]} if out else {}

    return batched


# ---- hellaswag ---------------------------------------------------------------------------------


def _capitalize_ctx_b(ctx: str) -> str:
    """klosax's ``ctx`` is ``label: ctx_a ctx_b`` as in the source, but lm_eval builds
    ``ctx_a + " " + ctx_b.capitalize()``. ctx_b (ActivityNet items) is the unfinished last sentence
    after ctx_a's final ". "; it starts lower-case, and a finished sentence (WikiHow items, whose
    ctx_b is empty) ends with ".". Checked against the 998 HellaSwag docs OLMo's request files
    share with this file: the queries agree on all of them (OLMo's also turn lm_eval's ".." into ".")."""
    label, sep, body = ctx.partition(": ")
    cut = body.rfind(". ")
    head, tail = (body[: cut + 2], body[cut + 2 :]) if cut >= 0 else ("", body)
    if tail[:1].islower() and not tail.rstrip().endswith("."):
        tail = tail.capitalize()
    return label + sep + head + tail


def _hellaswag_doc(doc: dict) -> dict:
    return {
        "query": hellaswag_preprocess(_capitalize_ctx_b(doc["ctx"])),
        "choices": [hellaswag_preprocess(ending) for ending in doc["endings"]],
        "gold": int(doc["label"]),
    }


@_memo
def hellaswag_docs(dataset: datasets.Dataset) -> datasets.Dataset:
    """klosax rows ``{idx, ctx, label, endings}`` -> lm_eval's ``{query, choices, gold}`` (label kept).

    One known difference: a WikiHow ending that began with a "[step]"-style tag keeps a leading
    space in lm_eval (it strips before removing tags); klosax stripped it, and which endings had a
    tag is not recoverable, so those choices are scored without the extra space."""
    return dataset.map(_rows(_hellaswag_doc), batched=True, keep_in_memory=True)


# ---- arc ---------------------------------------------------------------------------------------

_LETTERS = "ABCDEFGH"


def _arc_from_olmes(doc: dict) -> dict:
    # OLMES rows hold the rendered lm_eval query "Question: {question}\nAnswer:"; take the question back out.
    question = doc["query"].removeprefix("Question: ").removesuffix("\nAnswer:")
    labels = list(_LETTERS[: len(doc["choices"])])
    return {
        "question": question,
        "choices": {"text": doc["choices"], "label": labels},
        "answerKey": labels[doc["gold"]],
    }


@_memo
def arc_docs(dataset: datasets.Dataset) -> datasets.Dataset:
    """OLMo's ARC test docs ``{query, choices, gold}`` -> the ai2_arc fields; ai2_arc rows pass through."""
    if "query" not in dataset.column_names:
        return dataset
    return dataset.map(_rows(_arc_from_olmes), batched=True, remove_columns=dataset.column_names, keep_in_memory=True)


# ---- wikitext ----------------------------------------------------------------------------------


def _is_heading(line: str) -> bool:
    return re.fullmatch(r"\s*(= )+.*?( =)+\s*", line) is not None


def _is_title(line: str) -> bool:
    # An article title "= Name =" (not "= = Section = ="), as EleutherAI/wikitext_document_level splits pages.
    flat = line.replace("= = =", "===").replace("= =", "==").strip()
    return flat.startswith("= ") and flat.endswith(" =")


@_memo
def wikitext_pages(dataset: datasets.Dataset) -> datasets.Dataset:
    """The raw WikiText-2 test file (one 'document' row) -> one ``{page}`` per article, as in
    EleutherAI/wikitext_document_level: the article's lines joined by "\\n", from its title to the
    next title. The bundle's file is the HF line split with empty rows dropped, so the " " blank
    lines around headings are put back; paragraphs follow each other without one."""
    text = "".join(dataset["text"]).replace("\r\n", "\n")
    lines: list[str] = []
    for line in (raw for raw in text.split("\n") if raw.strip()):
        lines += [" ", line, " "] if _is_heading(line) else [line]
    pages: list[str] = []
    current: list[str] = []
    for line in lines:
        if _is_title(line) and "".join(current).strip():
            pages.append("\n".join(current))
            current = []
        elif _is_title(line):
            current = []
        current.append(line)
    pages.append("\n".join(current + [""]))  # the file ends with a newline
    return datasets.Dataset.from_dict({"page": pages})


# ---- the datasets (custom_dataset) ---------------------------------------------------------------


def _local(task: str, data_dir: str | None = None, **_metadata: object) -> datasets.DatasetDict:
    from eval.harness import local_dataset

    return local_dataset(task, data_dir)


# ``custom_dataset: !function utils.<task>_dataset`` in each task's YAML
hellaswag_dataset = functools.partial(_local, "hellaswag")
arc_easy_dataset = functools.partial(_local, "arc_easy")
arc_challenge_dataset = functools.partial(_local, "arc_challenge")
piqa_dataset = functools.partial(_local, "piqa")
winogrande_dataset = functools.partial(_local, "winogrande")
boolq_dataset = functools.partial(_local, "boolq")
social_iqa_dataset = functools.partial(_local, "social_iqa")
lambada_openai_dataset = functools.partial(_local, "lambada_openai")
wikitext_dataset = functools.partial(_local, "wikitext")
