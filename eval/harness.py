"""lm-evaluation-harness on this repo's models, offline.

- ``FocusedLM``: lm_eval's ``TemplateLM`` over a ``model.transformer.Transformer`` and a ``data.tokenizer``
  tokenizer; registered as lm_eval model ``focused`` (``model_args``: ``checkpoint=DIR`` or ``run=DIR``,
  ``device=``, ``batch_size=``, ``max_length=``, ``max_gen_toks=``) once this module is imported.
  lm_eval's command line builds it with ``create_from_arg_obj`` (``create_from_arg_string`` from Python):
  ``model_args`` win over the CLI's ``--device`` / ``--batch_size``, which fill in what they leave out; the
  CLI's default device ``cuda:0`` on a machine without CUDA falls back to ``auto`` with a warning.
  ``python -m eval.lm_eval`` runs lm_eval's own CLI with this module imported (eval/lm_eval.py).
- eval/tasks/*.yaml: ready-to-use lm_eval tasks (``--include_path eval/tasks``) reading the local data
  through ``local_dataset`` (data directory: task metadata ``data_dir``, else $FOCUSED_PRETRAIN_EVAL_DATA,
  else ``run.config.DEFAULT_DATA_DIR`` if present). ``render_tasks(data_dir)`` copies them to an include folder with
  ``data_dir`` written into each task's metadata, after checking every file is there.
- ``evaluate(lm, tasks, limit=, data_dir=, stderr=)`` -> ``{task: {metric: value}}`` through
  ``lm_eval.simple_evaluate`` on those tasks alone (lm_eval's built-in index is never built, nothing is
  downloaded); with ``stderr`` each metric also gets lm_eval's ``<metric>_stderr`` (None where lm_eval
  has none); ``flatten_for_metrics`` turns it into ``{"eval/<task>/<metric>": value}`` for metrics.jsonl.

Tasks are lm_eval's hellaswag, arc_easy, arc_challenge, piqa, winogrande, boolq, social_iqa,
lambada_openai and wikitext with the built-in prompts, delimiters and metrics, zero-shot, read from a
data directory laid out like the shared offline bundle (``FOCUSED_PRETRAIN_EVAL_DATA`` by default).
Inside lm_eval they are named ``focused_<task>`` so they can never be mistaken for the built-ins.

Data parallelism: every rank runs the whole task list (the same requests in the same order, so the
same forwards: a sharded engine's collectives stay matched) and only rank 0 reports; lm_eval is told
it runs one process (``lm.rank == 0``, ``lm.world_size == 1``) so it never splits or pads requests.
``FocusedLM(rank=, world_size=)`` (default: torch.distributed's, else 0 / 1) decides who reports and
who shows progress bars. This costs world_size times the compute of one rank, which is what a sharded
model needs anyway; the forwards only match if greedy decoding gives every rank the same tokens.

Batches are right-padded, which leaves every scored position unchanged for causal attention; a
variant whose attention reads later tokens (a non-causal "paper form") should run with batch_size=1.
Forwards run in eval mode under ``torch.no_grad``; wrap ``evaluate`` in ``torch.autocast`` for bf16.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any
from unittest import mock

import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import (
    get_rolling_token_windows,
    make_disjoint_window,
    simple_parse_args_string,
)
from tqdm import tqdm

from core.errors import ConfigError
from eval.lm_tasks import (  # noqa: F401  (the task set, importable from here as before)
    LM_EVAL_PREFIX,
    SOURCES,
    TASK_DIR,
    TASKS,
    Source,
    check_tasks,
    local_dataset,
    render_tasks,
    task_source,
)

if TYPE_CHECKING:
    from lm_eval.api.instance import Instance

    from eval.generation import TextGenerator
    from model.transformer import Transformer

log = logging.getLogger(__name__)

STDERR_BOOTSTRAP_ITERS = 1000  # lm_eval's bootstrap draws for metrics without a closed-form stderr
MODEL_ARGS = ("checkpoint", "run", "device", "batch_size", "max_length", "max_gen_toks")
LM_EVAL_ARGS = ("batch_size", "device")  # what lm_eval's additional_config may fill in (max_batch_size dropped)


# ---- the model -----------------------------------------------------------------------------------


def _dist_default(rank: int | None, world_size: int | None) -> tuple[int, int]:
    ready = torch.distributed.is_available() and torch.distributed.is_initialized()
    if rank is None:
        rank = torch.distributed.get_rank() if ready else 0
    if world_size is None:
        world_size = torch.distributed.get_world_size() if ready else 1
    if not 0 <= rank < world_size:
        raise ConfigError(f"rank: must be in [0, world_size={world_size}), got {rank}")
    return rank, world_size


def _positive_int(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{key}: must be an integer >= 1, got {value!r}")
    return value


@register_model("focused")
class FocusedLM(TemplateLM):
    """lm_eval's LM interface over a causal ``Transformer`` (``model(idx).logits`` -> [B, T, V])."""

    def __init__(
        self,
        model: Transformer,
        tokenizer: Any,
        device: torch.device | str = "cpu",
        batch_size: int = 8,
        max_length: int | None = None,
        *,
        max_gen_toks: int = 256,
        rank: int | None = None,
        world_size: int | None = None,
    ):
        super().__init__()
        self.model, self.tokenizer = model, tokenizer
        self._device = torch.device(device)
        self.batch_size = _positive_int("batch_size", batch_size)
        self.max_length = _positive_int("max_length", max_length or model.cfg.max_seq_len)
        if self.max_length < 2:
            raise ConfigError(f"max_length: must be >= 2 (one context and one scored token), got {self.max_length}")
        self.max_gen_toks = _positive_int("max_gen_toks", max_gen_toks)
        self.dist_rank, self.dist_world_size = _dist_default(rank, world_size)
        self._rank, self._world_size = 0, 1  # lm_eval sees one process on every rank (module docstring)

    # -- lm_eval surface --

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_id

    @property
    def tokenizer_name(self) -> str:
        return getattr(self.tokenizer, "fingerprint", type(self.tokenizer).__name__)

    @property
    def reports(self) -> bool:
        """Whether this rank returns results (rank 0 of the data-parallel group)."""
        return self.dist_rank == 0

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        return self.tokenizer.encode(string)  # these tokenizers add no special tokens

    def tok_decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(list(tokens))

    # -- scoring --

    @contextlib.contextmanager
    def _eval_mode(self) -> Iterator[None]:
        # Callable from inside a training loop: no dropout now, the caller's mode afterwards.
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                yield
        finally:
            self.model.train(was_training)

    def _window(self, context: list[int], continuation: list[int]) -> list[int]:
        """Model input for one request: context + continuation left-truncated to max_length + 1
        tokens, minus the last (the final logit predicts nothing we score)."""
        if not context or not continuation:
            raise ValueError("loglikelihood requests need a non-empty context and continuation (token lists)")
        if len(continuation) > self.max_length:
            raise ValueError(f"continuation of {len(continuation)} tokens exceeds max_length={self.max_length}")
        return (context + continuation)[-(self.max_length + 1) :][:-1]

    def _score_batch(self, batch: list[tuple[Any, list[int], list[int]]]) -> list[tuple[float, bool]]:
        windows = [self._window(ctx, cont) for _, ctx, cont in batch]
        width = max(map(len, windows))
        # Right padding: causal attention keeps the real positions' logits unchanged.
        idx = torch.full((len(windows), width), self.eot_token_id, dtype=torch.long)
        for row, window in enumerate(windows):
            idx[row, : len(window)] = torch.tensor(window, dtype=torch.long)
        logits = self.model(idx.to(self.device)).logits
        dtype = torch.promote_types(logits.dtype, torch.float32)  # bf16 logits: normalise in fp32
        out = []
        for row, ((_, _, cont), window) in enumerate(zip(batch, windows)):
            n, end = len(cont), len(window)
            # Position i predicts token i + 1: the last n real positions score the continuation.
            scored = F.log_softmax(logits[row, end - n : end].to(dtype), dim=-1)
            target = torch.tensor(cont, device=scored.device)
            total = scored.gather(-1, target[:, None]).sum()
            out.append((float(total), bool((scored.argmax(dim=-1) == target).all())))
        return out

    def _loglikelihood_tokens(
        self, requests: list[tuple[Any, list[int], list[int]]], disable_tqdm: bool = False, **kwargs: Any
    ) -> list[tuple[float, bool]]:
        """(sum of continuation log-probs, whether greedy decoding gives the continuation) per request,
        in request order. Longest first, as lm_eval's HF model: a batch pads only to its first row."""
        order = sorted(
            range(len(requests)),
            key=lambda i: (-len(requests[i][1]) - len(requests[i][2]), tuple(requests[i][1] + requests[i][2])),
        )
        results: list[tuple[float, bool]] = [(0.0, False)] * len(requests)
        bar = tqdm(total=len(requests), desc="loglikelihood", disable=disable_tqdm or not self.reports)
        with self._eval_mode():
            for start in range(0, len(order), self.batch_size):
                chunk = order[start : start + self.batch_size]
                for i, answer in zip(chunk, self._score_batch([requests[i] for i in chunk])):
                    results[i] = answer
                    if requests[i][0] is not None:  # rolling windows carry no request key
                        self.cache_hook.add_partial("loglikelihood", requests[i][0], answer)
                bar.update(len(chunk))
        bar.close()
        return results

    def loglikelihood_rolling(self, requests: list[Instance], disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of whole texts: lm_eval's disjoint rolling windows of max_length tokens, each
        token scored once, the first one after the EOS prefix token."""
        windows, owners = [], []
        for i, (text,) in enumerate(req.args for req in requests):
            tokens = self.tok_encode(text)
            for ctx, pred in map(
                make_disjoint_window, get_rolling_token_windows(tokens, self.prefix_token_id, self.max_length, 1)
            ):
                windows.append((None, ctx, pred))
                owners.append(i)
        totals = [0.0] * len(requests)
        for i, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)):
            totals[i] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # -- generation --

    def _generator(self) -> TextGenerator:
        from eval.generation import TextGenerator

        return TextGenerator(self.model, self.tokenizer, device=self.device, max_context=self.max_length)

    def _generation_options(self, gen_kwargs: dict) -> dict:
        until = gen_kwargs.get("until") or []
        if isinstance(until, str):
            until = [until]
        if not isinstance(until, (list, tuple)):
            raise TypeError(f"generate_until: 'until' must be a string or a list of strings, got {until!r}")
        # At least one prompt token must stay: the prompt is left-truncated to max_length - max_gen_toks.
        max_new = min(int(gen_kwargs.get("max_gen_toks", self.max_gen_toks)), self.max_length - 1)
        sample = bool(gen_kwargs.get("do_sample", False))
        return {
            "max_new_tokens": max_new,
            "stop": list(until),
            "temperature": float(gen_kwargs.get("temperature", 0.0) or 0.0) if sample else 0.0,
            "top_k": gen_kwargs.get("top_k") if sample else None,
        }

    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations through the KV-cache generator, cut before the first ``until`` string,
        at most ``max_gen_toks`` tokens; the prompt keeps its last max_length - max_gen_toks tokens."""
        generator = self._generator()
        out = []
        for req in tqdm(requests, desc="generate_until", disable=disable_tqdm or not self.reports):
            context, gen_kwargs = req.args
            opts = self._generation_options(dict(gen_kwargs))
            ids = self.tok_encode(context)[-(self.max_length - opts["max_new_tokens"]) :]
            text = generator.generate(ids, opts.pop("max_new_tokens"), **opts)
            out.append(text)
            self.cache_hook.add_partial("generate_until", req.args, text)
        return out

    # -- construction from lm_eval model_args --

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> FocusedLM:
        """``model_args="run=DIR,device=cpu"`` (lm_eval.simple_evaluate with a string)."""
        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict[str, Any], additional_config: dict | None = None) -> FocusedLM:
        """``model_args`` as a dict (lm_eval's command line parses them to one). ``additional_config`` is
        lm_eval's ``{"batch_size", "max_batch_size", "device"}`` from its own options: they fill in only
        what ``model_args`` leave out, a CUDA device without CUDA is dropped (lm_eval defaults to
        ``cuda:0``), and ``max_batch_size`` is ignored (no automatic batch size)."""
        args = dict(arg_dict or {})
        unknown = sorted(set(args) - set(MODEL_ARGS))
        if unknown:
            raise ConfigError(f"model_args: {', '.join(unknown)} not accepted; allowed: {', '.join(MODEL_ARGS)}")
        for key in LM_EVAL_ARGS:
            value = (additional_config or {}).get(key)
            if value is None or key in args:
                continue
            if key == "device" and str(value).startswith("cuda") and not torch.cuda.is_available():
                log.warning("device: %s (lm_eval's --device or its default) but CUDA is unavailable; using auto", value)
                continue
            args[key] = value
        if isinstance(args.get("batch_size"), str) and args["batch_size"].isdigit():
            args["batch_size"] = int(args["batch_size"])  # lm_eval's --batch_size arrives as text
        return cls.from_checkpoint(**args)

    @classmethod
    def from_checkpoint(
        cls,
        checkpoint: str | Path | None = None,
        run: str | Path | None = None,
        device: str = "auto",
        batch_size: int = 8,
        max_length: int | None = None,
        max_gen_toks: int = 256,
    ) -> FocusedLM:
        """A checkpoint directory (or a run's latest complete one) with its own tokenizer."""
        from core.device import resolve_device
        from data.tokenizer import load_tokenizer
        from run.checkpoint import load_model, resolve_checkpoint
        from run.checkpoint import tokenizer_file as _tokenizer_file

        if (checkpoint is None) == (run is None):
            raise ConfigError("model_args: pass exactly one of checkpoint=DIR or run=DIR")
        if batch_size == "auto":
            raise ConfigError("batch_size: 'auto' is not supported; pass an integer >= 1")
        if checkpoint is not None:
            path = resolve_checkpoint(str(checkpoint), key="checkpoint")
        else:
            path = resolve_checkpoint(str(run), key="run")
        dev = resolve_device(str(device), key="device")
        model, _ = load_model(path, device=dev)
        return cls(
            model,
            load_tokenizer(_tokenizer_file(path)),
            device=dev,
            batch_size=batch_size,
            max_length=max_length,
            max_gen_toks=max_gen_toks,
        )


# ---- running -------------------------------------------------------------------------------------


@contextlib.contextmanager
def _kept_rng() -> Iterator[None]:
    # simple_evaluate reseeds python, numpy and torch; a training loop must not notice the eval.
    from core.rng import rng_state, set_rng_state

    saved = rng_state()
    try:
        yield
    finally:
        set_rng_state(saved)


@contextlib.contextmanager
def _without_run_metadata() -> Iterator[None]:
    # simple_evaluate stamps its result with `git describe` and torch's environment report (pip,
    # nvidia-smi: seconds of subprocesses on every call); only the metrics are returned here.
    from lm_eval import evaluator

    with contextlib.ExitStack() as stack:
        for name, stub in (("get_git_commit_hash", lambda: None), ("add_env_info", lambda storage: None)):
            if hasattr(evaluator, name):
                stack.enter_context(mock.patch.object(evaluator, name, stub))
        yield


def _forget_modules(folder: Path) -> None:
    # lm_eval imports the rendered utils.py under its path; drop it (and its cached documents) with the folder.
    root = str(folder.resolve())
    for name in [n for n in sys.modules if n.startswith(root)]:
        del sys.modules[name]


def _metrics(entry: dict[str, Any], stderr: bool = False) -> dict[str, float | None]:
    """lm_eval's ``{"acc,none": v, "acc_stderr,none": s, "alias": ...}`` -> ``{"acc": v}``; with ``stderr``
    ``{"acc": v, "acc_stderr": s}`` (None where lm_eval reports "N/A")."""
    out: dict[str, float | None] = {}
    for key, value in entry.items():
        metric, _, filt = key.partition(",")
        if not filt or "_stderr" in metric or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        name = metric if filt == "none" else f"{metric}_{filt}"
        out[name] = float(value)
        if stderr:
            err = entry.get(f"{metric}_stderr,{filt}")
            ok = isinstance(err, (int, float)) and not isinstance(err, bool)
            out[f"{name}_stderr"] = float(err) if ok and err is not None else None
    return out


def evaluate(
    lm: FocusedLM,
    tasks: Sequence[str],
    *,
    limit: int | None = None,
    data_dir: str | Path | None = None,
    stderr: bool = False,
) -> dict[str, dict[str, float | None]]:
    """Zero-shot lm_eval on ``tasks`` (user names: hellaswag, arc_easy, ...), at most ``limit``
    documents each (None = all) -> ``{task: {metric: value}}`` on the reporting rank, {} elsewhere.
    ``stderr``: also ``<metric>_stderr`` (closed form for means, ``STDERR_BOOTSTRAP_ITERS`` bootstrap
    draws for perplexities); off, lm_eval computes none (the training loop's setting)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    names = check_tasks(tasks)
    if limit is not None:
        _positive_int("limit", limit)
    with tempfile.TemporaryDirectory(prefix="focused_tasks_") as tmp:
        include = render_tasks(data_dir, names, out_dir=tmp)
        manager = TaskManager(include_path=str(include), include_defaults=False)
        try:
            with _kept_rng(), _without_run_metadata():
                out = lm_eval.simple_evaluate(
                    model=lm,
                    tasks=[LM_EVAL_PREFIX + t for t in names],
                    limit=limit,
                    task_manager=manager,
                    bootstrap_iters=STDERR_BOOTSTRAP_ITERS if stderr else 0,
                    log_samples=False,  # zero-shot is the tasks' default
                )
        finally:
            _forget_modules(include)
    if out is None or not lm.reports:
        return {}
    return {task: _metrics(out["results"][LM_EVAL_PREFIX + task], stderr) for task in names}


def flatten_for_metrics(results: dict[str, dict[str, float | None]], prefix: str = "eval") -> dict[str, float | None]:
    """``{task: {metric: v}}`` -> ``{"eval/<task>/<metric>": v}`` (non-finite values kept: they are findings)."""
    return {
        f"{prefix}/{task}/{metric}": value for task, metrics in results.items() for metric, value in metrics.items()
    }
