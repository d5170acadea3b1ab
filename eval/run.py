"""``python -m eval.run --run DIR | --checkpoint DIR --tasks ppl,sample [--limit N] [--out FILE]``

Evaluates a checkpoint (``--run`` takes the run's latest complete one) and writes
``{task: {metric: value}}`` JSON, by default to ``<run>/eval/step_NNNNNNNN.json`` (checked writable before any task
runs). Results accumulate: a call adds its tasks to what earlier calls on the same checkpoint wrote there (a task run
again replaces only its own entry; a grid task run with other options, ``needle --needle-kind multikey`` say, has its
own: ``result_key``), and ``provenance`` records each task's time and command.

Tasks:
- ``ppl``: token-level loss and perplexity on the run's validation split (all of it, or ``--limit`` sequences).
- ``sample``: a seeded generated continuation of ``--prompt`` through the KV cache.
- ``attention_stats``: each variant's statistics (sink ratio, density, ...) averaged over layers, from the
  dense reference path on the first validation batch, so variants are measured the same way.
- ``ppl_length``: loss and perplexity at ``--lengths`` multiples of the training length on the same
  held-out tokens, plus a PNG plot beside the JSON.
- ``needle``: RULER-style needle in a haystack (``--needle-kind`` single / multikey / multivalue /
  multiquery; ``--haystack`` noise, or essay with ``--haystack-dir``) at ``--context-lengths`` x
  ``--depths``, substring scoring, plus a depth x length heatmap PNG.
- ``kv_retrieval``: HELMET-style JSON key-value retrieval (generated, or ``--kv-file``, the
  lost-in-the-middle kv-retrieval jsonl.gz).
- ``rag``: HELMET-style QA with distractor passages from ``--rag-file`` (NQ-open oracle jsonl.gz).
- ``longbench:<file>``: a LongBench / LongBench-E jsonl in the official schema.
- lm-eval tasks (hellaswag, arc_easy, arc_challenge, piqa, winogrande, boolq, social_iqa,
  lambada_openai, wikitext) from local files under ``--data-dir``.

Every task and length is checked against the model before any task runs (the grid tasks' prompts are built
and sized first); if a task still fails, the results of those that ran are written before the error. A
length beyond the run's ``data.seq_len`` gets one warning line. Generation tasks all decode through
``eval.generation.TextGenerator`` (KV cache, greedy). With
``--run``, the run's loss curves (and Focus group sizes, when logged) are plotted too.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import fcntl
import json
import math
import os
import re
import shlex
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from core.errors import ConfigError, cli_errors, install_hint
from core.files import atomic_write_text, file_kind, open_regular
from run import checkpoint as checkpoint_lib

if TYPE_CHECKING:
    from data.build import Corpus
    from data.tokenizer import Tokenizer
    from eval.generation import TextGenerator
    from model.transformer import Transformer
    from run.config import RunConfig

TASKS = ("ppl", "sample", "ppl_length", "attention_stats", "needle", "kv_retrieval", "rag")
LONGBENCH_PREFIX = "longbench:"


def resolve_checkpoint(run: str | None, checkpoint: str | None) -> Path:
    if checkpoint:
        return checkpoint_lib.resolve_checkpoint(checkpoint, key="--checkpoint")
    return checkpoint_lib.resolve_checkpoint(str(run), key="--run")


def json_safe(value: Any) -> Any:
    """``value`` with every non-finite float as the string ``"nan"``, ``"inf"`` or ``"-inf"``: JSON has no
    literal for them (a bare ``NaN`` is not JSON), and metrics.jsonl writes them the same way."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def checked_checkpoint(path: Path, key: str) -> dict:
    """The trainer state, once every file of checkpoint ``path`` has been checked (``verify_checkpoint``:
    a damaged file is one line naming it, not a traceback from torch or safetensors) and the consolidated
    weights evaluation reads are there."""
    state = checkpoint_lib.verify_checkpoint(path, key=key)
    if not (path / checkpoint_lib.MODEL_FILE).is_file():
        raise ConfigError(
            f"{key}: {path} has no {checkpoint_lib.MODEL_FILE}, the consolidated weights evaluation reads (every "
            "engine writes them: the checkpoint is incomplete)"
        )
    return state


def _first_line(exc: BaseException) -> str:
    """``Type: the first sentence of the message`` on one line, short."""
    text = " ".join(str(exc).split(". ")[0].split())
    return f"{type(exc).__name__}: {text}"[:160] if text else type(exc).__name__


def held_out(cfg: RunConfig, tokenizer_dir: Path) -> Corpus:
    from data.build import build_corpus

    cfg.data.tokenizer = str(_tokenizer_file(tokenizer_dir))  # the checkpoint's own tokenizer, never a retrained one
    return build_corpus(cfg.data, vocab_size=cfg.model.vocab_size, log=lambda line: print(line, file=sys.stderr))


def task_ppl_text(
    model: Transformer, tokenizer: Tokenizer, *, path: str, length: int, stride: int, limit: int, device: torch.device
) -> dict:
    """Token and per-byte perplexity of the documents of a text file / folder / glob (strided windows)."""
    from data.sources import iter_local
    from eval.perplexity import NoDocuments, text_perplexity

    if not 0 < stride <= length:
        raise ConfigError(f"--ppl-stride: {stride} must be in [1, --ppl-length={length}]")
    docs = iter_local(path)
    texts = (d.text for i, d in enumerate(docs) if not limit or i < limit)
    try:
        return text_perplexity(model, texts, tokenizer, length=length, stride=stride, device=device) | {"data": path}
    except NoDocuments:
        within = f" within --limit {limit}" if limit else ""
        raise ConfigError(
            f"--ppl-data: {path} holds no document of two or more tokens{within}: nothing to score"
        ) from None


def task_ppl(model: Transformer, corpus: Corpus, *, limit: int, device: torch.device) -> dict:
    from eval.perplexity import mean_loss, perplexity

    assert corpus.val is not None  # the caller checked

    n = min(len(corpus.val), limit) if limit else len(corpus.val)
    batches = (torch.stack([corpus.val[i] for i in range(a, min(a + 8, n))]) for a in range(0, n, 8))
    loss, tokens = mean_loss(model, batches, device=device)
    return {"loss": loss, "perplexity": perplexity(loss), "tokens": tokens, "sequences": n}


def task_ppl_length(
    model: Transformer,
    corpus: Corpus,
    *,
    train_length: int,
    multiples: list[float],
    max_tokens: int,
    device: torch.device,
    plot: Path,
) -> dict:
    from eval.length import loss_by_length
    from eval.plots import plot_loss_by_length

    lengths = [max(1, int(train_length * m)) for m in multiples]
    if corpus.val is None:
        raise ConfigError("--tasks ppl_length: the run has no validation split (a stream without data.val_path)")
    results = loss_by_length(model, corpus.val.tokens, lengths, max_tokens=max_tokens, device=device)
    out: dict[str, Any] = {str(length): r for length, r in results.items()}
    out["plot"] = str(plot_loss_by_length(results, plot, train_length=train_length))
    return out


def task_attention_stats(
    model: Transformer,
    corpus: Corpus | None,
    tokenizer: Tokenizer,
    *,
    text_path: str | None,
    batch_size: int,
    device: torch.device,
) -> dict:
    """Per-layer statistics (and Focus group composition) on ``text_path`` or the first validation batch."""
    from eval.attention_stats import focus_composition, layer_statistics

    length = model.cfg.max_seq_len
    if text_path:
        from data.sources import iter_local

        ids = [i for doc in iter_local(text_path) for i in [*tokenizer.encode(doc.text), tokenizer.eos_id]]
        windows = [torch.tensor(ids[a : a + length]) for a in range(0, max(1, len(ids) - length + 1), length)][
            :batch_size
        ]
        if not windows or len(windows[0]) < 2:
            raise ConfigError(f"--stats-text: {text_path} holds fewer than 2 tokens")
        batches = [torch.stack(windows)]  # full-length windows, or one shorter window when the text is short
    else:
        if corpus is None or corpus.val is None:
            raise ConfigError(
                "--stats-text: the run has no validation split (a stream without data.val_path); give a text file"
            )
        batches = [torch.stack([corpus.val[i][:-1] for i in range(min(batch_size, len(corpus.val)))])]
    stats = layer_statistics(model, batches, device=device)
    out = {**stats["mean"], "layers": stats["layers"], "sequences": sum(int(b.shape[0]) for b in batches)}
    groups = focus_composition(model, batches, tokenizer, device=device)
    if groups:
        out["focus_groups"] = groups
    return out


def task_sample(
    model: Transformer, tokenizer: Tokenizer, *, prompt: str, max_new_tokens: int, seed: int, device: torch.device
) -> dict:
    ids = tokenizer.encode(prompt) or [tokenizer.eos_id]
    gen = torch.Generator(device=device).manual_seed(seed)
    out = model.generate(
        torch.tensor([ids], device=device),
        max_new_tokens,
        temperature=0.8,
        top_k=50,
        generator=gen,
        eos_id=tokenizer.eos_id,
        vocab_size=tokenizer.vocab_size,
    )
    assert isinstance(out, torch.Tensor)  # tokens only: return_logits is off
    return {
        "prompt": prompt,
        "text": tokenizer.decode(out[0, len(ids) :].tolist()),
        "tokens": int(out.shape[1] - len(ids)),
    }


_tokenizer_file = checkpoint_lib.tokenizer_file


def _numbers(raw: str, option: str, kind: Callable[[str], Any] = float) -> list:
    try:
        return [kind(m) for m in raw.split(",") if m.strip()]
    except ValueError:
        raise ConfigError(
            f"{option}: {raw!r} is not a comma-separated list of {'integers' if kind is int else 'numbers'}"
        ) from None


def _is_builtin(task: str) -> bool:
    return task in TASKS or (task.startswith(LONGBENCH_PREFIX) and len(task) > len(LONGBENCH_PREFIX))


def parse_tasks(raw: str) -> tuple[list[str], list[str]]:
    """(all tasks, the lm-eval ones); the harness (lm-eval) is imported only when a task needs it."""
    tasks = [t.strip() for t in raw.split(",") if t.strip()]
    others = [t for t in tasks if not _is_builtin(t)]
    harness = lm_eval_tasks() if others else ()
    unknown = [t for t in others if t not in harness]
    if unknown or not tasks:
        extra = "" if harness else f" (lm-eval tasks such as hellaswag need lm-eval: {install_hint('eval')})"
        allowed = ", ".join(sorted({*TASKS, *harness}))
        raise ConfigError(
            f"--tasks: {', '.join(unknown) or '(empty)'} not available; allowed: {allowed}, "
            f"longbench:<file.jsonl>{extra}"
        )
    return tasks, others


def lm_eval_tasks() -> tuple[str, ...]:
    try:
        from eval.harness import TASKS as LOCAL_TASKS
    except ImportError:  # lm-eval is an optional extra
        return ()
    return tuple(LOCAL_TASKS)


GRID = ("needle", "kv_retrieval", "rag")  # the tasks run over a grid of prompt lengths x depths
GRID_TASKS = " / ".join(GRID)


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m eval.run", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--run", help="run directory (uses its latest complete checkpoint)")
    src.add_argument("--checkpoint", help="checkpoint directory (checkpoints/step_NNNNNNNN)")
    p.add_argument("--tasks", default="ppl,sample", help="comma-separated task list (see above)")
    p.add_argument("--limit", type=int, default=0, help="cap on examples per task (0 = all)")
    p.add_argument("--out", help="JSON output file (default: <run>/eval/step_N.json); plots go beside it")
    p.add_argument("--prompt", default="ROMEO.", help="sample: prompt text")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lengths", default="1,2,4,8", help="ppl_length: multiples of the training length")
    p.add_argument("--max-tokens", type=int, default=16384, help="ppl_length: held-out tokens scored at every length")
    p.add_argument(
        "--context-lengths",
        default="",
        help=f"{GRID_TASKS}: prompt lengths in tokens (default: 1/4, 1/2 and all of the context)",
    )
    p.add_argument("--depths", default="0,0.5,1", help=f"{GRID_TASKS}: depth fractions of the needle / gold item")
    p.add_argument("--samples", type=int, default=1, help=f"{GRID_TASKS}: samples per length x depth")
    p.add_argument("--needle-kind", default="single", help="needle: single, multikey, multivalue or multiquery")
    p.add_argument("--haystack", default="noise", help="needle: noise (no data) or essay (--haystack-dir)")
    p.add_argument("--haystack-dir", default=None, help="needle: folder of .txt essays (e.g. Paul Graham's)")
    p.add_argument(
        "--kv-file",
        default=None,
        help="kv_retrieval: lost-in-the-middle kv-retrieval jsonl(.gz); default: generated pairs",
    )
    p.add_argument("--rag-file", default=None, help="rag: NQ-open oracle jsonl(.gz) (question, answers, ctxs)")
    p.add_argument(
        "--data-dir",
        default=None,
        help="lm-eval tasks: folder with the task data (the offline bundle's layout, docs/eval.md); "
        "default $FOCUSED_PRETRAIN_EVAL_DATA",
    )
    p.add_argument("--batch-size", type=int, default=8, help="lm-eval tasks: requests per forward")
    p.add_argument(
        "--max-context", type=int, default=0, help="generation: prompt + new tokens budget (default model.max_seq_len)"
    )
    p.add_argument(
        "--ppl-data",
        default=None,
        help="ppl: a text file, folder or glob (.txt / .jsonl / .parquet) instead of the validation split",
    )
    p.add_argument(
        "--ppl-length", type=int, default=0, help="ppl on --ppl-data: window length in tokens (default data.seq_len)"
    )
    p.add_argument(
        "--ppl-stride",
        type=int,
        default=0,
        help="ppl on --ppl-data: window stride (default the length: non-overlapping)",
    )
    p.add_argument(
        "--stats-text",
        default=None,
        help="attention_stats: a text file / folder to measure on (default the first validation batch)",
    )
    p.add_argument("--device", default="auto")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override the checkpoint's model config, e.g. --set model.attention.focus.mode=hard",
    )
    return p


def _new_tokens(task: str) -> int:
    from eval.synthetic.common import KV_NEW_TOKENS, NEEDLE_NEW_TOKENS, RAG_NEW_TOKENS

    return {"needle": NEEDLE_NEW_TOKENS, "kv_retrieval": KV_NEW_TOKENS, "rag": RAG_NEW_TOKENS}[task]


def _grid_samples(task: str, gen: TextGenerator, args: argparse.Namespace, lengths: list[int] | None,
                  depths: list[float]) -> list:  # fmt: skip
    """``task``'s prompts, built and sized with the model's tokenizer (so every length is checked before any
    task runs)."""
    from eval import synthetic
    from eval.synthetic.common import check_lengths

    lengths = check_lengths(lengths, gen.max_context)
    common = dict(lengths=lengths, depths=depths, samples=args.samples, seed=args.seed)
    new = _new_tokens(task)
    if task == "needle":
        return synthetic.needle_samples(
            gen.encode, kind=args.needle_kind, haystack=args.haystack, haystack_dir=args.haystack_dir,
            max_new_tokens=new, **common,
        )  # fmt: skip
    if task == "kv_retrieval":
        return synthetic.kv_samples(gen.encode, data_file=args.kv_file, max_new_tokens=new, **common)
    if not args.rag_file:
        raise ConfigError(
            "--rag-file: required by the rag task (an NQ-open oracle jsonl(.gz) with question, answers and ctxs)"
        )
    return synthetic.rag_samples(gen.encode, data_file=args.rag_file, max_new_tokens=new, **common)


def result_key(task: str, args: argparse.Namespace) -> str:
    """Where a grid task's results go in the results file: its name, plus the options that make it another test
    than the task's default (needle's kind and haystack, kv_retrieval's data file), so that successive calls with
    other options (the README's two needle lines) keep each call's grid and plot."""
    params = []
    if task == "needle":
        params = [f"kind={args.needle_kind}"] * (args.needle_kind != "single")
        params += [f"haystack={args.haystack}"] * (args.haystack != "noise")
    elif task == "kv_retrieval" and args.kv_file:
        params = [f"file={Path(args.kv_file).name}"]
    return f"{task}[{','.join(params)}]" if params else task


def _synthetic(task: str, gen: TextGenerator, items: list, args: argparse.Namespace, out: Path) -> dict:
    from eval import synthetic
    from eval.plots import plot_needle_heatmap
    from eval.synthetic.common import RAG_STOP

    key = result_key(task, args)
    stop = RAG_STOP if task == "rag" else ()
    result = synthetic.evaluate_samples(
        gen, items, max_new_tokens=_new_tokens(task), stop=stop, progress=not args.no_progress
    )
    slug = re.sub(r"[^A-Za-z0-9_.]+", "-", key).strip("-")  # needle[kind=multikey] -> needle-kind-multikey
    plot = out.with_suffix(f".{slug}.png")
    result["plot"] = str(plot_needle_heatmap(result["grid"], plot, title=f"{key}: score by depth and length"))
    print(f"{key}: score {result['score']:.1f} over {result['n']} prompts")
    return result


def preflight(
    tasks: list[str],
    harness_tasks: list[str],
    args: argparse.Namespace,
    gen: TextGenerator,
    context_lengths: list[int] | None,
    depths: list[float],
) -> dict[str, list]:
    """Every requested task checked against the model before any runs, so that a bad length or file fails in
    seconds rather than after the tasks before it: the grid tasks' prompts are built and sized (returned, by
    task), LongBench files read and their prompt budgets checked, lm-eval data files located."""
    samples = {task: _grid_samples(task, gen, args, context_lengths, depths) for task in tasks if task in GRID}
    for task in tasks:
        if task.startswith(LONGBENCH_PREFIX):
            from eval.longbench import load_longbench, official_metrics, prompt_budget

            for dataset in dict.fromkeys(row["dataset"] for row in load_longbench(task[len(LONGBENCH_PREFIX) :])):
                prompt_budget(gen, dataset)
            official_metrics()
    if harness_tasks:
        from eval.lm_tasks import check_tasks, task_source
        from run.config import resolve_data_dir

        root = resolve_data_dir(args.data_dir)
        for name in check_tasks(harness_tasks):
            task_source(name, root)
    return samples


def longest_input(tasks: list[str], args: argparse.Namespace, samples: dict[str, list], train_length: int) -> int:
    """The longest input (in tokens) the requested tasks give the model: the grid tasks' prompt lengths,
    ``ppl_length``'s lengths, ``--ppl-length``, and ``--max-context`` when given for LongBench / lm-eval tasks."""
    lengths = [s.length for items in samples.values() for s in items]
    if "ppl_length" in tasks:
        lengths += [max(1, int(train_length * m)) for m in _numbers(args.lengths, "--lengths")]
    if "ppl" in tasks and args.ppl_data and args.ppl_length:
        lengths.append(args.ppl_length)
    if args.max_context and any(t not in TASKS for t in tasks):  # LongBench and lm-eval prompts fill the budget
        lengths.append(args.max_context)
    return max(lengths, default=0)


@cli_errors
def main(argv: list[str] | None = None) -> int:
    command = shlex.join(["python", "-m", "eval.run", *(sys.argv[1:] if argv is None else argv)])
    args = _build_parser().parse_args(argv)
    try:
        tasks, harness_tasks = parse_tasks(args.tasks)
        multiples = _numbers(args.lengths, "--lengths")
        depths = _numbers(args.depths, "--depths")
        context_lengths = _numbers(args.context_lengths, "--context-lengths", int) or None
        path = resolve_checkpoint(args.run, args.checkpoint)
        from core.device import resolve_device
        from data.tokenizer import load_tokenizer
        from eval.generation import TextGenerator
        from run.checkpoint import load_model

        device = resolve_device(args.device, key="--device")
        key = "--run" if args.run else "--checkpoint"
        state = checked_checkpoint(path, key)
        out = Path(args.out) if args.out else path.parent.parent / "eval" / f"{path.name}.json"
        check_out(out)  # before any task runs: a result that cannot be written is known now, not after the work
        model, cfg = load_model(path, device=device, overrides=args.set)
        tokenizer = _load_tokenizer(load_tokenizer, path, key)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    results: dict = {"checkpoint": str(path), "step": state["step"]}
    gen = TextGenerator(model, tokenizer, device=device, max_context=args.max_context or None)
    try:
        samples = preflight(tasks, harness_tasks, args, gen, context_lengths, depths)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    longest = longest_input(tasks, args, samples, cfg.data.seq_len)
    if longest > cfg.data.seq_len:
        print(
            f"warning: evaluating at up to {longest} tokens, beyond the {cfg.data.seq_len} the run trained at "
            "(data.seq_len): scores there measure length extrapolation",
            file=sys.stderr,
        )
    try:
        needs_corpus = (
            {"ppl_length"}
            | ({"ppl"} if not args.ppl_data else set())
            | ({"attention_stats"} if not args.stats_text else set())
        )
        corpus = held_out(cfg, path) if needs_corpus & set(tasks) else None
        for task in tasks:
            if task == "ppl_length":
                assert corpus is not None  # needs_corpus
                results[task] = task_ppl_length(
                    model,
                    corpus,
                    train_length=cfg.data.seq_len,
                    multiples=multiples,
                    max_tokens=args.max_tokens,
                    device=device,
                    plot=out.with_suffix(".ppl_length.png"),
                )
                for length, r in results[task].items():
                    if isinstance(r, dict) and "perplexity" in r:
                        print(
                            f"ppl_length: {length:>6} tokens | loss {r['loss']:.4f} | perplexity {r['perplexity']:.2f}"
                        )
            elif task == "attention_stats":
                results[task] = task_attention_stats(
                    model, corpus, tokenizer, text_path=args.stats_text, batch_size=8, device=device
                )
                print(
                    "attention_stats: "
                    + ", ".join(f"{k} {v:.4f}" for k, v in results[task].items() if isinstance(v, float))
                )
            elif task == "ppl" and args.ppl_data:
                length = args.ppl_length or cfg.data.seq_len
                results["ppl"] = r = task_ppl_text(
                    model,
                    tokenizer,
                    path=args.ppl_data,
                    length=length,
                    stride=args.ppl_stride or length,
                    limit=args.limit,
                    device=device,
                )
                print(
                    f"ppl: {args.ppl_data} loss {r['loss']:.4f} | perplexity {r['perplexity']:.2f} | bits/byte "
                    f"{r['bits_per_byte']:.4f} over {r['tokens']:,} tokens"
                )
            elif task == "ppl":
                if corpus is None or corpus.val is None:  # corpus: needs_corpus
                    raise ConfigError(
                        "--ppl-data: the run has no validation split (a stream without data.val_path); give text to "
                        "score"
                    )
                results["ppl"] = task_ppl(model, corpus, limit=args.limit, device=device)
                print(
                    f"ppl: validation loss {results['ppl']['loss']:.4f} | perplexity "
                    f"{results['ppl']['perplexity']:.2f} over {results['ppl']['tokens']:,} tokens"
                    + (" (the whole validation split)" if not args.limit else f" (--limit {args.limit})")
                )
            elif task == "sample":
                results["sample"] = task_sample(
                    model,
                    tokenizer,
                    prompt=args.prompt,
                    max_new_tokens=args.max_new_tokens,
                    seed=args.seed,
                    device=device,
                )
                print(f"sample:\n{args.prompt}{results['sample']['text']}")
            elif task in GRID:
                results[result_key(task, args)] = _synthetic(task, gen, samples[task], args, out)
            elif task.startswith(LONGBENCH_PREFIX):
                from eval.longbench import run_longbench

                results[task] = run_longbench(
                    task[len(LONGBENCH_PREFIX) :], gen, limit=args.limit, progress=not args.no_progress
                )
                print(f"{task}: average {results[task]['average']['score']:.2f}")
        if harness_tasks:
            from eval.harness import FocusedLM, evaluate

            lm = FocusedLM(model, tokenizer, device=device, batch_size=args.batch_size, max_length=gen.max_context)
            found = evaluate(lm, harness_tasks, limit=args.limit or None, data_dir=args.data_dir, stderr=True)
            for task, metrics in found.items():
                results[task] = metrics  # each metric with lm-eval's standard error beside it: acc, acc_stderr, ...
                shown = (
                    f"{k} {v:.4f}"
                    + (f" ± {metrics[k + '_stderr']:.4f}" if metrics.get(k + "_stderr") is not None else "")
                    for k, v in metrics.items()
                    if not k.endswith("_stderr")
                )
                print(f"{task}: " + ", ".join(shown))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        if len(results) > 2 and _kept(out, results, command):  # beyond checkpoint and step: the tasks that ran
            print(f"results of the tasks that ran written to {out}", file=sys.stderr)
        return 2
    if args.run:
        results["plots"] = _run_plots(Path(args.run), out)
    if not _kept(out, results, command):
        return 2
    print(f"results written to {out}")
    return 0


def _kept(out: Path, results: dict, command: str) -> bool:
    """``write_results``; if ``out`` became unwritable while the tasks ran (check_out passed before them), one
    error line and the results as JSON on stdout, so that the work is not lost. Whether they were written."""
    try:
        write_results(out, results, command=command)
        return True
    except (OSError, ValueError) as exc:
        print(f"error: --out: cannot write {out} ({_first_line(exc)}); the results follow on stdout", file=sys.stderr)
        print(json.dumps(json_safe(results), indent=2, allow_nan=False, default=str))
        return False


META_KEYS = ("checkpoint", "step", "plots", "provenance")  # the results file's keys that are not tasks


def write_results(out: Path, results: dict, *, command: str) -> dict:
    """Add this call's task ``results`` to the results file ``out`` (atomically, under a lock on its folder):
    the tasks earlier calls wrote for the same checkpoint stay, a task run again replaces only its own entry, and
    ``provenance`` gets each task's time and command. A file of another checkpoint, or not a results file, is
    replaced with one note. Returns what was written."""
    when = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    ran = [k for k in results if k not in META_KEYS]
    with _locked(out.parent):
        earlier = _earlier_results(out, results["checkpoint"])
        merged = {**earlier, **results}
        merged["plots"] = {**earlier.get("plots", {}), **results.get("plots", {})}
        if not merged["plots"]:
            del merged["plots"]
        provenance = {**earlier.get("provenance", {}), **{t: {"time": when, "command": command} for t in ran}}
        merged["provenance"] = provenance
        atomic_write_text(out, json.dumps(json_safe(merged), indent=2, allow_nan=False) + "\n")
    return merged


def check_out(out: Path) -> None:
    """The results file ``out`` can be written (its folder made, a file created in it, and ``out`` itself, when
    there, a regular file the results may replace), or one ``ConfigError`` line saying why: checked before any
    task runs."""
    kind = file_kind(out)
    if kind is not None:
        raise ConfigError(f"--out: {out} is {kind}; give the name of a results file (.json)")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except (OSError, ValueError) as exc:  # ValueError: a NUL in the path
        raise ConfigError(f"--out: cannot create {out.parent} ({getattr(exc, 'strerror', None) or exc})") from None
    try:  # what write_results does: a temporary file beside out, renamed over it
        fd, probe = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.probe")
    except OSError as exc:
        raise ConfigError(f"--out: cannot write in {out.parent} ({exc.strerror or exc})") from None
    os.close(fd)
    os.unlink(probe)


def _earlier_results(out: Path, checkpoint: str) -> dict:
    """What earlier calls wrote to ``out`` for ``checkpoint``; {} when there is nothing to keep."""
    if not out.exists():
        return {}
    try:
        with open_regular(out) as f:
            earlier = json.loads(f.read().decode("utf-8"))
    except (OSError, ValueError) as exc:  # ValueError: not UTF-8, not JSON, an integer past Python's digit limit
        print(f"note: {out}: not a results file ({_first_line(exc)}); replaced", file=sys.stderr)
        return {}
    if not isinstance(earlier, dict) or not isinstance(earlier.get("checkpoint"), str):
        print(f"note: {out}: not a results file (no checkpoint named); replaced", file=sys.stderr)
        return {}
    try:
        same = Path(earlier["checkpoint"]).resolve() == Path(checkpoint).resolve()
    except (OSError, ValueError):  # ValueError: a NUL in the path
        same = False
    if not same:
        print(f"note: {out} held results of {earlier['checkpoint']}; replaced", file=sys.stderr)
        return {}
    for key in ("plots", "provenance"):
        if not isinstance(earlier.get(key, {}), dict):
            earlier.pop(key)
    return earlier


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """An exclusive lock on ``folder``: two evaluations of one checkpoint finishing together both keep their tasks."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _load_tokenizer(load_tokenizer: Callable[[Path], Tokenizer], path: Path, key: str) -> Tokenizer:
    file = _tokenizer_file(path)
    try:
        return load_tokenizer(file)
    except ConfigError:
        raise
    except Exception as exc:  # a damaged SentencePiece / tokenizer.json file
        raise ConfigError(f"{key}: {file} is damaged ({_first_line(exc)})") from None


def _run_plots(run: Path, out: Path) -> dict:
    """Loss curves, and Focus group sizes when the run logged them, from the run's metrics.jsonl."""
    from eval.plots import plot_group_sizes, plot_loss_curves

    metrics = run / "metrics.jsonl"
    plots: dict[str, str] = {}
    if not metrics.is_file():
        return plots
    plots["loss_curves"] = str(plot_loss_curves(metrics, out.with_suffix(".loss.png")))
    try:
        plots["focus_groups"] = str(plot_group_sizes(metrics, out.with_suffix(".focus_groups.png")))
    except ConfigError:
        pass  # not a Focus run
    return plots


if __name__ == "__main__":
    sys.exit(main())
