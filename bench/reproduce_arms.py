"""The trained arms of ``python -m bench.reproduce`` and what is measured on each.

An *arm* is one attention configuration trained from scratch through the project's trainer
(``pretrain.loop.Trainer`` on a ``RunConfig``), with the same shape, data, token budget and seed as
every other arm. After training, the arm's checkpoint is evaluated through the project's evaluation
code (``eval.perplexity``, ``eval.attention_stats``, ``eval.length``, ``run.checkpoint.load_model``
with overrides for Focus hard mode and pre-scored HyperAttention at inference).

Arms run in worker processes (one thread each), so ``run_arm`` takes and returns plain dicts.

The local-window-only baseline of the Focus paper (section 3.5) has no variant in ``model/``, so a
small one is defined here (``local_window``: causal softmax attention over the last ``window``
keys). It is registered only while an arm runs (``local_window_registered``), so importing this module
leaves the product's registry, and every test parametrised from it, as it was.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from core.errors import check_min
from model.attention.common import reference as ref
from model.attention.common.base import Attention, AttnOut, KVCache, VariantConfig, attention_registered

if TYPE_CHECKING:
    from data.build import Corpus
    from model.transformer import Transformer
    from run.config import RunConfig


# ---- the local-window-only baseline ---------------------------------------------------------
@dataclass
class LocalWindowConfig(VariantConfig):
    window: int = 32  # query i attends keys j with i - window < j <= i

    def validate(self, prefix: str = "model.attention.local_window.") -> None:
        check_min(prefix + "window", self.window, 1)


class LocalWindowAttention(Attention):
    """Causal softmax attention restricted to the last ``window`` keys (sliding window)."""

    description = "sliding-window causal attention (bench.reproduce's local-only baseline)"

    def _mask(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        return ref.causal_mask(q_pos, k_pos) & ((q_pos[:, None] - k_pos[None, :]) < self.cfg.window)

    def reference(
        self, q: Tensor, k: Tensor, v: Tensor, *, hidden: Tensor, q_pos: Tensor, k_pos: Tensor, cache: KVCache | None
    ) -> AttnOut:
        scale = 1.0 / math.sqrt(self.spec.head_dim)
        p = ref.masked_softmax(ref.scores(q, k, scale), self._mask(q_pos, k_pos))
        stats = ref.sink_and_density(p, k_pos) if self.collect_stats else {}
        return AttnOut(ref.weighted_values(p, v, q.dtype), stats=stats)

    def has_fast_path(self, q: Tensor, cache: KVCache | None) -> bool:
        return True

    def fast(
        self, q: Tensor, k: Tensor, v: Tensor, *, hidden: Tensor, q_pos: Tensor, k_pos: Tensor, cache: KVCache | None
    ) -> AttnOut:
        mask = self._mask(q_pos, k_pos)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=1.0 / math.sqrt(self.spec.head_dim), enable_gqa=k.shape[1] != q.shape[1]
        )
        return AttnOut(out)


def local_window_registered() -> contextlib.AbstractContextManager[type[Attention]]:
    """``local_window`` in the attention registry for the duration of the block (an arm's training and
    evaluation), then removed: a test process that runs an arm in-process keeps the product's registry."""
    return attention_registered("local_window", LocalWindowConfig, LocalWindowAttention)


# ---- arm definitions ------------------------------------------------------------------------
Arms = dict[str, tuple[dict[str, Any], str, float]]


def window_label(window: int) -> str:
    """The label of the Focus window-ablation arm at ``window``."""
    return f"focus_w{window}"


def arms(budget: dict) -> Arms:
    """label -> (config overrides, description, relative cost per step on CPU, used for scheduling only).

    The lengths are the budget's: the Focus window (``focus_window``, also the local-window baseline's), the
    window ablation's pair (``focus_windows``), DGA's chunk and group sizes (``dga_chunk``, ``dga_group``)."""
    w, c, m = budget["focus_window"], budget["dga_chunk"], budget["dga_group"]

    def focus(**changes: Any) -> dict[str, Any]:
        opts = {"n_groups": 8, "window": w, "assignment": "sinkhorn"} | changes  # K = 8 (paper 3.5 / 3.6)
        return {"model.attention.kind": "focus", **{f"model.attention.focus.{k}": v for k, v in opts.items()}}

    def dga(gamma: float) -> dict[str, Any]:
        keys = {"gamma": gamma, "chunk_size": c, "group_size": m}
        return {"model.attention.kind": "dga", **{f"model.attention.dga.{k}": v for k, v in keys.items()}}

    windows = {window_label(x): (focus(window=x), f"Focus, K = 8, w = {x}", 3.0) for x in budget["focus_windows"]}
    return {
        "full": ({"model.attention.kind": "full"}, "full causal attention (t = 1)", 1.0),
        "local_window": (
            {"model.attention.kind": "local_window", "model.attention.local_window.window": w},
            f"local window only, w = {w}",
            1.2,
        ),
        "focus": (focus(), f"Focus, Sinkhorn, K = 8, w = {w}", 3.0),
        "focus_softmax": (focus(assignment="softmax"), f"Focus, softmax assignment, K = 8, w = {w}", 3.0),
        "focus_k2": (focus(n_groups=2), f"Focus, K = 2, w = {w}", 3.0),
        "focus_k4": (focus(n_groups=4), f"Focus, K = 4, w = {w}", 3.0),
        **windows,
        "lazy": ({"model.attention.kind": "lazy"}, "Lazy (distance bias + Elastic-Softmax, tau init 1)", 2.0),
        "focal_t0.4": (
            {"model.attention.kind": "focal", "model.attention.focal.mode": "constant", "model.attention.focal.t": 0.4},
            "Focal, constant t = 0.4",
            1.0,
        ),
        "focal_learned": (
            {"model.attention.kind": "focal", "model.attention.focal.mode": "learned"},
            "Focal, learned temperature (tau in [5, 10])",
            2.5,
        ),
        "dga": (dga(0.1), f"DGA, gamma = 0.1, m = {m}, C = {c}", 2.0),
        "dga_g0.5": (dga(0.5), f"DGA, gamma = 0.5, m = {m}, C = {c}", 2.0),
    }


def arm_overrides(label: str, budget: dict, common: list[str], run_dir: Path, seed: int) -> list[str]:
    extra = [f"{k}={_toml(v)}" for k, v in arms(budget)[label][0].items()]
    return [*common, *extra, f"run.dir={run_dir}", f"train.seed={seed}"]


def _toml(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value)


# ---- evaluation helpers (all through eval/ and run/) ----------------------------------------
_CORPUS: dict[str, Corpus] = {}


def corpus_for(cfg: RunConfig) -> Corpus:
    """The run's corpus (tokenizer and packed splits), built once per process from the data cache."""
    from data.build import build_corpus

    key = json.dumps([cfg.data.path, cfg.data.seq_len, cfg.model.vocab_size, cfg.data.cache_dir])
    if key not in _CORPUS:
        with contextlib.redirect_stdout(None):
            _CORPUS[key] = build_corpus(cfg.data, vocab_size=cfg.model.vocab_size, log=lambda line: None)
    return _CORPUS[key]


def windows(corpus: Corpus, n: int) -> list[torch.Tensor]:
    """The first ``n`` held-out sequences ([T + 1] each): the same tokens for every arm."""
    assert corpus.val is not None  # a prepared corpus has its split
    return [corpus.val[i] for i in range(min(n, len(corpus.val)))]


def loss_on(model: Transformer, wins: list[torch.Tensor], batch: int = 16) -> float:
    from eval.perplexity import mean_loss

    batches = (torch.stack(wins[i : i + batch]) for i in range(0, len(wins), batch))
    return mean_loss(model, batches, device=torch.device("cpu"))[0]


def attention_stats(model: Transformer, wins: list[torch.Tensor], n: int = 8) -> dict[str, float]:
    """Sink ratio, density (and the variant's other statistics), mean over layers, dense reference path."""
    from eval.attention_stats import layer_statistics

    batch = torch.stack([w[:-1] for w in wins[:n]])
    mean = layer_statistics(model, [batch], device=torch.device("cpu"))["mean"]
    return {key.rsplit("/", 1)[-1]: value for key, value in mean.items()}


def loss_by_length(
    model: Transformer, corpus: Corpus, seq_len: int, multiples: list[int], max_tokens: int
) -> dict[str, dict]:
    from eval.length import loss_by_length as measure

    assert corpus.val is not None  # a prepared corpus has its split

    found = measure(
        model, corpus.val.tokens, [seq_len * m for m in multiples], max_tokens=max_tokens, device=torch.device("cpu")
    )
    return {str(length): r for length, r in found.items()}


def focus_topk(ckpt: Path, wins: list[torch.Tensor], n_groups: int) -> dict[str, dict]:
    """Hard (exact sparse) inference at top-k = 1..K of a soft-trained Focus checkpoint."""
    from run.checkpoint import load_model

    out = {}
    for k in range(1, n_groups + 1):
        model, _ = load_model(ckpt, overrides=["model.attention.focus.mode=hard", f"model.attention.focus.top_k={k}"])
        out[str(k)] = {"loss": loss_on(model, wins), "pairs_kept": attention_stats(model, wins).get("pairs_kept")}
    return out


def kv_cache_bytes(model: Transformer, corpus: Corpus, contexts: list[int]) -> dict[str, dict]:
    """Bytes every layer's KV cache holds after prefilling ``L`` held-out tokens and decoding one more."""
    from model.attention.common.base import kv_cache_nbytes

    assert corpus.val is not None  # a prepared corpus has its split

    out = {}
    tokens = torch.from_numpy(corpus.val.tokens[: max(contexts) + 1].astype("int64"))[None]
    for length in contexts:
        if tokens.shape[1] < length + 1:
            out[str(length)] = {"skipped": f"fewer than {length + 1} held-out tokens"}
            continue
        caches = model.new_caches(1, length + 1)
        with torch.no_grad():
            model(tokens[:, :length], caches=caches)
            model(tokens[:, length : length + 1], caches=caches)
        row: dict[str, Any] = {"bytes": sum(kv_cache_nbytes(c) for c in caches)}
        cache_size = getattr(model.blocks[0].attn.core, "cache_size", None)  # a variant's own slot count (DGA)
        if cache_size is not None:
            row["slots_layer0"] = cache_size(caches[0])
        out[str(length)] = row
    return out


def _capture_attention(model: Transformer, batch: torch.Tensor) -> list[dict]:
    """Each layer's attention inputs (q, k, v, hidden, positions) and exact output on ``batch``."""
    captured: list[dict] = [{} for _ in model.blocks]
    hooks = []
    for i, block in enumerate(model.blocks):
        core = block.attn.core

        def before(module: nn.Module, args: tuple, kwargs: dict, i: int = i) -> None:
            captured[i].update(q=args[0], k=args[1], v=args[2], hidden=kwargs["hidden"], positions=kwargs["positions"])

        def after(module: nn.Module, args: tuple, kwargs: dict, out: AttnOut, i: int = i) -> None:
            captured[i]["out"] = out.output

        hooks.append(core.register_forward_pre_hook(before, with_kwargs=True))
        hooks.append(core.register_forward_hook(after, with_kwargs=True))
    try:
        with torch.no_grad():
            model(batch, return_logits=False)
    finally:
        for hook in hooks:
            hook.remove()
    return captured


def prescored_sweep(ckpt: Path, model: Transformer, wins: list[torch.Tensor], sweep: dict) -> dict:
    """Perplexity and attention output error of pre-scored HyperAttention (and plain HyperAttention,
    top_k = 0) swapped in at inference for the trained full-attention model's attention."""
    from run.checkpoint import load_model

    batch = torch.stack([w[:-1] for w in wins[:8]])
    exact = _capture_attention(model, batch)
    common = [f"model.attention.prescored_hyper.{k}={v}" for k, v in sweep["options"].items()]
    configs = [("plain", 0)] + [(s, k) for s in sweep["scorings"] for k in sweep["top_k"]]
    out: dict[str, Any] = {"exact_loss": loss_on(model, wins), "rows": []}
    for scoring, top_k in configs:
        approx, _ = load_model(
            ckpt,
            overrides=[
                "model.attention.kind=prescored_hyper",
                f"model.attention.prescored_hyper.scoring={'kmeans' if scoring == 'plain' else scoring}",
                f"model.attention.prescored_hyper.top_k={top_k}",
                *common,
            ],
        )
        errors = []
        with torch.no_grad():
            for block, layer in zip(approx.blocks, exact):
                got = block.attn.core(
                    layer["q"], layer["k"], layer["v"], hidden=layer["hidden"], positions=layer["positions"]
                ).output
                errors.append(float((got - layer["out"]).norm() / layer["out"].norm()))
        out["rows"].append(
            {"scoring": scoring, "top_k": top_k, "loss": loss_on(approx, wins), "error": sum(errors) / len(errors)}
        )
    return out


def focus_groups(run_dir: Path) -> list[dict]:
    """attn/focus/* statistics the trainer logged on its logging steps (metrics.jsonl)."""
    rows = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "attn/focus/max_group_share" in record:
            rows.append(
                {k.removeprefix("attn/focus/"): v for k, v in record.items() if k.startswith(("step", "attn/"))}
            )
    return rows


# ---- one arm, in a worker process -----------------------------------------------------------
def run_arm(job: dict) -> dict:
    """Train one arm (label, seed) through the trainer, then run its evaluations. Plain dicts in and out."""
    torch.set_num_threads(job.get("threads", 1))
    run_dir = Path(job["run_dir"])
    run_dir.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"label": job["label"], "seed": job["seed"]}
    log = open(run_dir / "reproduce.log", "w")  # closed below; the trainer prints progress
    try:
        with contextlib.redirect_stdout(log), local_window_registered():
            result.update(_train_and_measure(job, run_dir))
    except Exception as exc:  # one failed arm must not lose the others: the claims it feeds say so
        result["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        log.close()
    return result


def _train_and_measure(job: dict, run_dir: Path) -> dict:
    from pretrain.loop import Trainer
    from run.checkpoint import latest_checkpoint, load_model
    from run.config import load_run_config

    budget = job["budget"]
    cfg = load_run_config(None, job["overrides"])
    started = time.perf_counter()
    trainer = Trainer(cfg)
    trainer.setup()
    trainer.run()
    trained = time.perf_counter()
    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        raise RuntimeError(f"no checkpoint under {run_dir}")
    model, cfg = load_model(ckpt)
    corpus = corpus_for(cfg)
    wins = windows(corpus, budget["val_windows"])
    out: dict[str, Any] = {"val_loss": loss_on(model, wins), "val_tokens": len(wins) * budget["seq_len"]}
    evals = set(job["evals"])
    if "groups" in evals:
        out["groups"] = focus_groups(run_dir)
    if "attn_stats" in evals:
        out["attn_stats"] = attention_stats(model, wins)
    if "length" in evals:
        out["length"] = loss_by_length(
            model, corpus, budget["seq_len"], budget["length_multiples"], budget["length_tokens"]
        )
    if "topk" in evals:
        out["topk"] = focus_topk(ckpt, wins, cfg.model.attention.options["focus"].n_groups)
    if "kv_cache" in evals:
        out["kv_cache"] = kv_cache_bytes(model, corpus, [budget["seq_len"] * m for m in budget["kv_multiples"]])
    if "prescored" in evals:
        out["prescored"] = prescored_sweep(ckpt, model, wins[: budget["prescored_windows"]], budget["prescored"])
    out["train_seconds"] = trained - started
    out["eval_seconds"] = time.perf_counter() - trained
    return out
