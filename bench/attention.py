"""Attention variants side by side: ``python -m bench.attention [--lengths 4096,16384] [--dtype float32] [--json F]``.

One attention layer (batch 1, 4 heads of 64 by default; ``--shape llama-1.3b``: 16 heads of 128, the batch holding
32K tokens at each length; GQA off), random inputs, every registered variant in ``CASES``, side by side with full
attention in the same run. For each length: forward time and forward+backward time (median of
``--repeat`` runs after one warm-up), and the peak memory a forward / forward+backward adds. For each context: decode
time per token on a KV cache filled to that context (median over ``--repeat`` rounds of ``--steps`` tokens, the
variants taking turns within each round) and the bytes the cache holds.
Ratios divide by full attention's figure at the same length. Prints Markdown tables and writes the same figures as JSON
(``--json``), with the date, device, command and machine load.

Peak memory. CUDA: ``torch.cuda.max_memory_allocated`` minus the allocation before the call. CPU: the growth of the
process's peak resident set during one call after a warm-up (Linux ``VmHWM``, reset through ``/proc/self/clear_refs``
before the call), measured in a child process per length whose glibc mmap threshold is fixed at 64 KiB, so that every
tensor buffer is its own mapping and returns to the system when freed (otherwise freed heap memory would be reused
without showing up). It counts what the call touches: outputs, temporaries, saved activations, kernel scratch; the
inputs exist before the call and are not counted. Timing runs keep the default allocator.

Limits on CPU: a variant whose CPU path materialises T x T scores (``dense=True``) runs only while
batch x heads x T^2 x 4 bytes stays under ``--dense-gib``; any variant is skipped at a length where its time, scaled
quadratically from the previous length, would pass ``--max-seconds`` per run. Skips are listed, not hidden.

Adding a variant is one line in ``CASES``: a label, the registered kind and its options.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import inspect
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from bench import profiling
from bench.memory import PeakMemory, cache_nbytes, fix_malloc_for_rss, measure
from core.errors import cli_errors
from model.attention import Attention, KVCache, LayerSpec, build_attention, registry
from model.config import ModelConfig, preset_dict


@dataclass(frozen=True)
class Shape:
    """One attention call's shape: batch x heads x head dimension (as many key / value heads: no GQA)."""

    batch: int = 1
    heads: int = 4
    head_dim: int = 64
    name: str = "small"

    def text(self) -> str:
        """``batch 8, 16 heads x 128 (llama-1.3b)``: what a table heading or a headline row states."""
        label = "" if self.name == "small" else f" ({self.name})"
        return f"batch {self.batch}, {self.heads} heads x {self.head_dim}{label}"

    def fields(self) -> dict[str, Any]:
        return {"batch": self.batch, "heads": self.heads, "head_dim": self.head_dim, "shape": self.name}


SMALL = Shape()
HEADS, HEAD_DIM, BATCH = SMALL.heads, SMALL.head_dim, SMALL.batch
PRESET_TOKENS = 32768  # a preset shape's batch holds this many tokens per call (at least one sequence)


def small_shape(t: int) -> Shape:
    """The default shape at every length."""
    return SMALL


def preset_shape(preset: str, tokens: int = PRESET_TOKENS) -> Callable[[int], Shape]:
    """The attention shape of a model preset (its heads and head dimension, bf16 on CUDA) with a batch of
    ``tokens`` tokens at each length: ``preset_shape("llama-1.3b")(4096)`` is 8 x 16 heads x 128."""
    cfg = ModelConfig(**preset_dict(preset))

    def at(t: int) -> Shape:
        return Shape(max(1, tokens // t), cfg.n_heads, cfg.head_dim, preset)

    return at


def row_shape(row: dict[str, Any]) -> Shape:
    """A row's shape (rows written before shapes were recorded are the default one)."""
    if "heads" not in row:
        return SMALL
    return Shape(row["batch"], row["heads"], row["head_dim"], row.get("shape", "small"))


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


@dataclass
class Case:
    label: str
    kind: str  # a registered attention variant
    options: dict[str, Any] = field(default_factory=dict)
    backward: bool = True  # time forward+backward too
    dense: bool = False  # its CPU path materialises T x T scores
    decode: bool = True  # time decoding on a KV cache


HARD = dict(mode="hard", window=128)
CASES: list[Case] = [
    Case("full (SDPA)", "full"),
    Case("focal constant (t=0.4)", "focal", dict(mode="constant")),
    Case("focal learned (query)", "focal", dict(mode="learned")),
    Case("lazy (zeros bias)", "lazy"),
    Case("dga causal (C=128, m=16, gamma=0.1)", "dga", dict(selection="causal", chunk_size=128, group_size=16)),
    Case("dga sequence (m=16, gamma=0.1)", "dga", dict(selection="sequence", group_size=16), decode=False),
    Case("focus soft (K=4, w=128)", "focus", dict(n_groups=4, window=128)),
    Case("focus hard k=1 (K=4, w=128)", "focus", dict(n_groups=4, top_k=1, **HARD)),
    Case("focus hard k=1 (K=8, w=128)", "focus", dict(n_groups=8, top_k=1, **HARD)),
    Case("focus hard k=2 (K=4, w=128)", "focus", dict(n_groups=4, top_k=2, **HARD)),
    Case(
        "prescored_hyper kmeans (top_k=1024, min_seq_len=512)",
        "prescored_hyper",
        dict(scoring="kmeans", top_k=1024, min_seq_len=512),
        decode=False,
    ),
    Case(
        "prescored_hyper leverage (top_k=1024, min_seq_len=512)",
        "prescored_hyper",
        dict(scoring="leverage", top_k=1024, min_seq_len=512),
        decode=False,
    ),
]


def make(
    kind: str, options: dict[str, Any], max_len: int, device: str, dtype: torch.dtype, shape: Shape = SMALL
) -> Attention:
    """The case's module, its parameters drawn from a fixed seed: the timing runs, the memory child and the decode
    runs measure the same weights (Focus's groups, and so its cost, depend on its random centroids)."""
    torch.manual_seed(0)
    cfg = registry[kind].config_cls(**options)
    if hasattr(cfg, "validate"):
        takes_prefix = len(inspect.signature(cfg.validate).parameters) > 0
        cfg.validate(f"model.attention.{kind}.") if takes_prefix else cfg.validate()
    spec = LayerSpec(
        d_model=shape.heads * shape.head_dim,
        n_heads=shape.heads,
        n_kv_heads=shape.heads,
        head_dim=shape.head_dim,
        max_seq_len=max_len,
        layer_idx=0,
        n_layers=1,
    )
    return build_attention(kind, cfg, spec).to(device, dtype).eval()


# ---- measurement ---------------------------------------------------------------------------------------------------
def cpu_peaks(
    t: int, labels: list[str], backward: list[str], dtype: torch.dtype, shape: Shape = SMALL
) -> dict[str, dict[str, int | None]]:
    """CPU peak memory of each case at length ``t`` (forward+backward too for the cases in ``backward``), measured
    in a fresh child process whose glibc serves every buffer >= 64 KiB by its own mapping from the start (timing
    runs keep the default allocator)."""
    spec = json.dumps(
        {
            "T": t,
            "labels": labels,
            "backward": backward,
            "dtype": str(dtype).removeprefix("torch."),
            "shape": dataclasses.asdict(shape),
        }
    )
    child = subprocess.run(
        [sys.executable, "-m", "bench.attention", "--memory-child", spec], capture_output=True, text=True
    )
    lines = [line for line in child.stdout.splitlines() if line.startswith("{")]
    if child.returncode != 0 or not lines:
        tail = (child.stderr.strip().splitlines() or ["no output"])[-1]
        print(f"  peak memory at T={t}: the child failed ({tail[:160]})", flush=True)
        return {}
    return json.loads(lines[-1])


def memory_child(spec: dict[str, Any]) -> None:
    """Peak memory of one forward and one forward+backward (after a warm-up each) for the named cases at one length."""
    fix_malloc_for_rss()
    t, dtype = spec["T"], DTYPES[spec["dtype"]]
    shape = Shape(**spec.get("shape", {}))
    q, k, v, hidden = random_qkv(t, "cpu", dtype, seed=t, shape=shape)
    positions = torch.arange(t)
    out: dict[str, dict[str, int | None]] = {}
    for case in [c for c in CASES if c.label in spec["labels"]]:
        module = make(case.kind, case.options, t, "cpu", dtype, shape)
        inputs = (module, q, k, v, hidden, positions)
        peaks: dict[str, int | None] = {"fwd_peak_bytes": None, "fwd_bwd_peak_bytes": None}
        with_bwd = case.label in spec["backward"]
        runs = [("fwd_peak_bytes", forward)] + ([("fwd_bwd_peak_bytes", forward_backward)] if with_bwd else [])
        for key, fn in runs:
            try:
                fn(*inputs)
                with PeakMemory("cpu") as mem:
                    fn(*inputs)
                peaks[key] = mem.peak
            except (RuntimeError, MemoryError):
                pass
        out[case.label] = peaks
        del module, inputs
    print(json.dumps(out))


def forward(module: Attention, q: Tensor, k: Tensor, v: Tensor, hidden: Tensor, positions: Tensor) -> None:
    with torch.no_grad():
        module(q, k, v, hidden=hidden, positions=positions)


def forward_backward(module: Attention, q: Tensor, k: Tensor, v: Tensor, hidden: Tensor, positions: Tensor) -> None:
    q, k, v = (x.detach().requires_grad_(True) for x in (q, k, v))
    module(q, k, v, hidden=hidden, positions=positions).output.float().sum().backward()


def random_qkv(
    t: int, device: str, dtype: torch.dtype, seed: int, shape: Shape = SMALL
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    b, h, d = shape.batch, shape.heads, shape.head_dim
    q, k, v = (torch.randn(b, h, t, d, generator=g).to(device, dtype) for _ in range(3))
    hidden = torch.randn(b, t, h * d, generator=g).to(device, dtype)
    return q, k, v, hidden


class Skipper:
    """Skips a (case, what) at a length where its quadratically scaled time would pass the budget."""

    def __init__(self, max_seconds: float):
        self.max_seconds = max_seconds
        self.last: dict[tuple[str, str], tuple[int, float]] = {}

    def too_slow(self, key: tuple[str, str], t: int) -> float | None:
        if key not in self.last:
            return None
        t0, s0 = self.last[key]
        predicted = s0 * (t / t0) ** 2
        return predicted if predicted > self.max_seconds else None

    def record(self, key: tuple[str, str], t: int, seconds: float) -> None:
        self.last[key] = (t, seconds)


def focus_groups(
    module: Attention, q: Tensor, k: Tensor, v: Tensor, hidden: Tensor, positions: Tensor
) -> dict[str, float]:
    """Largest group's share of tokens and the share of causal pairs the hard mask keeps, from one untimed call."""
    module.collect_stats = True
    with torch.no_grad():
        stats = module(q, k, v, hidden=hidden, positions=positions).stats
    module.collect_stats = False
    return {name: float(stats[name]) for name in ("max_group_share", "pairs_kept") if name in stats}


RATIOS = {
    "fwd_s": "fwd_ratio",
    "fwd_bwd_s": "fwd_bwd_ratio",
    "fwd_peak_bytes": "fwd_peak_ratio",
    "fwd_bwd_peak_bytes": "fwd_bwd_peak_ratio",
}


def bench_forward(
    cases: list[Case],
    lengths: list[int],
    device: str,
    dtype: torch.dtype,
    repeat: int,
    dense_gib: float,
    max_seconds: float,
    skipped: list[str],
    cpu_memory: bool = True,
    *,
    shape: Callable[[int], Shape] = small_shape,
    rows: list[dict[str, Any]] | None = None,
    profile_top: int = 0,
) -> list[dict[str, Any]]:
    """Forward (and forward+backward) rows per case and length, at ``shape(T)``; ``cpu_memory=False`` leaves out the
    CPU peak-memory child (a process per length: too slow for a smoke run). Each row is appended to ``rows`` (a new
    list when None, returned) as soon as it is measured, so a caller cut off part-way keeps what was measured.
    ``profile_top``: then profile one more call of each case (forward+backward where it was timed, else forward;
    ``bench.profiling``) into the row's ``profile``, with that many top kernels."""
    rows = [] if rows is None else rows
    skip = Skipper(max_seconds)
    for t in lengths:
        sh = shape(t)
        q, k, v, hidden = random_qkv(t, device, dtype, seed=t, shape=sh)
        positions = torch.arange(t, device=device)
        base: dict[str, Any] = {}
        for case in cases:
            if device == "cpu" and case.dense and sh.batch * sh.heads * t * t * 4 > dense_gib * 2**30:
                skipped.append(f"{case.label} T={t}: its CPU path holds T x T scores (over --dense-gib {dense_gib})")
                continue
            slow = skip.too_slow((case.label, "fwd"), t) if case.kind != "full" else None
            if slow:
                skipped.append(f"{case.label} T={t}: forward predicted {slow:.0f} s per run (over --max-seconds)")
                continue
            module = make(case.kind, case.options, t, device, dtype, sh)
            inputs = (module, q, k, v, hidden, positions)
            row: dict[str, Any] = {"case": case.label, "kind": case.kind, "T": t, **sh.fields()}
            try:
                row["fwd_s"], row["fwd_peak_bytes"] = measure(partial(forward, *inputs), device, repeat)
                skip.record((case.label, "fwd"), t, row["fwd_s"])
                row["fwd_bwd_s"] = row["fwd_bwd_peak_bytes"] = None
                slow = skip.too_slow((case.label, "bwd"), t) if case.kind != "full" else None
                if case.backward and slow:
                    skipped.append(f"{case.label} T={t}: fwd+bwd predicted {slow:.0f} s per run (over --max-seconds)")
                elif case.backward:
                    row["fwd_bwd_s"], row["fwd_bwd_peak_bytes"] = measure(
                        partial(forward_backward, *inputs), device, repeat
                    )
                    skip.record((case.label, "bwd"), t, row["fwd_bwd_s"])
                if case.kind == "focus" and case.options.get("mode") == "hard":
                    row.update(focus_groups(*inputs))
            except (RuntimeError, MemoryError) as err:  # out of memory, or a path this device lacks
                skipped.append(f"{case.label} T={t}: {type(err).__name__}: {str(err).splitlines()[0][:160]}")
                del module, inputs
                continue
            if case.kind == "full":
                base = row
            for key, ratio in RATIOS.items():
                row[ratio] = row[key] / base[key] if base.get(key) and row.get(key) is not None else None
            rows.append(row)
            print(
                f"  {case.label} T={t} ({sh.text()}): fwd {row['fwd_s'] * 1e3:.1f} ms"
                + (f", fwd+bwd {row['fwd_bwd_s'] * 1e3:.1f} ms" if row["fwd_bwd_s"] else ""),
                flush=True,
            )
            if profile_top:
                backward = row["fwd_bwd_s"] is not None
                fn = partial(forward_backward if backward else forward, *inputs)
                what = "fwd+bwd" if backward else "fwd"
                row["profile"] = profiling.safe_profile(fn, 1, device, what, profile_top)
            del module, inputs
        at_t = [r for r in rows if r["T"] == t and row_shape(r) == sh]
        if device == "cpu" and at_t and cpu_memory:
            del q, k, v, hidden
            peaks = cpu_peaks(
                t, [r["case"] for r in at_t], [r["case"] for r in at_t if r["fwd_bwd_s"] is not None], dtype, sh
            )
            for r in at_t:
                r.update(peaks.get(r["case"], {}))
            base = next((r for r in at_t if r["kind"] == "full"), {})
            for r in at_t:
                for key in ("fwd_peak_bytes", "fwd_bwd_peak_bytes"):
                    have = base.get(key) and r.get(key) is not None
                    r[RATIOS[key]] = r[key] / base[key] if have else None
            print(f"  peak memory at T={t}: measured in a child process", flush=True)
    return rows


def _decode_step(
    module: Attention, q: Tensor, k: Tensor, v: Tensor, hidden: Tensor, cache: KVCache, a: int, b: int, device: str
) -> None:
    module(
        q[:, :, a:b],
        k[:, :, a:b],
        v[:, :, a:b],
        hidden=hidden[:, a:b],
        positions=torch.arange(a, b, device=device),
        cache=cache,
    )


def _decode_token(
    module: Attention, q: Tensor, k: Tensor, v: Tensor, hidden: Tensor, cache: KVCache, i: int, device: str
) -> None:
    with torch.no_grad():
        _decode_step(module, q, k, v, hidden, cache, i, i + 1, device)


def bench_decode(
    cases: list[Case],
    contexts: list[int],
    device: str,
    dtype: torch.dtype,
    steps: int,
    rounds: int,
    dense_gib: float,
    skipped: list[str],
    prefill_chunk: int = 1024,
    *,
    shape: Callable[[int], Shape] = small_shape,
    rows: list[dict[str, Any]] | None = None,
    profile_top: int = 0,
) -> list[dict[str, Any]]:
    """Fill a KV cache per case to ``context`` tokens (chunked prefill through the variant, so caches that keep state
    build it; full attention's cache is filled directly), then time ``rounds`` rounds of ``steps`` single-token decode
    calls after one untimed warm-up round, the cases taking turns within each round, so that a change in the
    machine's speed during the run reaches every case alike. The figure is the median over all timed tokens of a
    case. The batch and heads are ``shape(context)``'s; a context's rows are appended to ``rows`` when its rounds end.
    ``profile_top``: then profile one more token of each case (``bench.profiling``) into the row's ``profile``."""
    rows = [] if rows is None else rows
    for ctx in contexts:
        sh = shape(ctx)
        total = ctx + steps * (rounds + 1) + (1 if profile_top else 0)
        q, k, v, hidden = random_qkv(total, device, dtype, seed=ctx, shape=sh)
        live: list[list[Any]] = []  # [case, module, cache, times]
        for case in [c for c in cases if c.decode]:
            if device == "cpu" and case.dense and sh.batch * sh.heads * prefill_chunk * ctx * 4 > dense_gib * 2**30:
                skipped.append(f"{case.label} decode at {ctx}: its prefill chunks hold chunk x context scores")
                continue
            module = make(case.kind, case.options, total, device, dtype, sh)
            cache = KVCache(sh.batch, sh.heads, sh.head_dim, total, dtype=dtype, device=device)
            try:
                with torch.no_grad():
                    if case.kind == "full":  # its prefill leaves exactly the raw keys: skip its O(L^2) work
                        cache.append(k[:, :, :ctx], v[:, :, :ctx])
                    else:
                        for a in range(0, ctx, prefill_chunk):
                            _decode_step(module, q, k, v, hidden, cache, a, min(ctx, a + prefill_chunk), device)
            except (RuntimeError, MemoryError) as err:
                skipped.append(f"{case.label} decode at {ctx}: {type(err).__name__}: {str(err).splitlines()[0][:160]}")
                continue
            live.append([case, module, cache, []])
        for r in range(-1, rounds):  # round -1: a warm-up (one-time work of a variant's first decode steps)
            for entry in list(live):
                case, module, cache, times = entry
                try:
                    with torch.no_grad():
                        for i in range(ctx + (r + 1) * steps, ctx + (r + 2) * steps):
                            if device == "cuda":
                                torch.cuda.synchronize()
                            t0 = time.perf_counter()
                            _decode_step(module, q, k, v, hidden, cache, i, i + 1, device)
                            if device == "cuda":
                                torch.cuda.synchronize()
                            if r >= 0:
                                times.append(time.perf_counter() - t0)
                except (RuntimeError, MemoryError) as err:
                    msg = str(err).splitlines()[0][:160]
                    skipped.append(f"{case.label} decode at {ctx}: {type(err).__name__}: {msg}")
                    live.remove(entry)
        base: dict[str, Any] | None = None
        at_ctx: list[tuple[dict[str, Any], Attention, KVCache]] = []
        for case, module, cache, times in live:
            row: dict[str, Any] = {
                "case": case.label,
                "kind": case.kind,
                "context": ctx,
                **sh.fields(),
                "ms_per_token": statistics.median(times) * 1e3,
                "cache_bytes": cache_nbytes(cache),
            }
            cache_size = getattr(module, "cache_size", None)
            if cache_size is not None:  # DGA: key/value slots it reads against full attention's
                row["kv_slots"] = cache_size(cache).get("dga_kv_slots")
            if base is None:
                base = row
            row["time_ratio"] = row["ms_per_token"] / base["ms_per_token"]
            row["cache_ratio"] = row["cache_bytes"] / base["cache_bytes"]
            rows.append(row)
            at_ctx.append((row, module, cache))
            print(f"  {case.label} context={ctx} ({sh.text()}): {row['ms_per_token']:.2f} ms/token", flush=True)
        if profile_top:
            i = ctx + (rounds + 1) * steps  # the token after the last round's
            for row, module, cache in at_ctx:
                token = partial(_decode_token, module, q, k, v, hidden, cache, i, device)
                row["profile"] = profiling.safe_profile(token, 1, device, "decode token", profile_top)
        del live, at_ctx
    return rows


# ---- report --------------------------------------------------------------------------------------------------------
def fmt(x: float | None, spec: str, scale: float = 1.0) -> str:
    return "-" if x is None else format(x * scale, spec)


def by_shape(rows: list[dict[str, Any]]) -> list[tuple[Shape, list[dict[str, Any]]]]:
    """Rows grouped by their shape, in the order the shapes first appear."""
    groups: dict[Shape, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(row_shape(r), []).append(r)
    return list(groups.items())


def markdown(meta: dict[str, Any], fwd: list[dict[str, Any]], dec: list[dict[str, Any]]) -> str:
    """The forward and decode tables, one per shape (its heading states it)."""
    lines = [
        f"- Date: {meta['date']}.",
        f"- Device: {meta['device']}; load average (1 / 5 / 15 min) {meta['loadavg_start']} at the start, "
        f"{meta['loadavg_end']} at the end.",
        f"- Command: `{meta['command']}`.",
        f"- Peak memory: {meta['memory_method']}",
    ]
    for shape, rows in by_shape(fwd):
        lines += [
            "",
            f"### Forward and forward+backward, one layer, {shape.text()}, {meta['dtype']} "
            f"(median of {meta['repeat']})",
            "",
            "| variant | T | fwd ms | fwd / full | fwd+bwd ms | fwd+bwd / full | fwd peak MiB | peak / full "
            "| fwd+bwd peak MiB | peak / full |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in rows:
            lines.append(
                f"| {r['case']} | {r['T']} | {fmt(r['fwd_s'], '.1f', 1e3)} | {fmt(r['fwd_ratio'], '.2f')} | "
                f"{fmt(r['fwd_bwd_s'], '.1f', 1e3)} | {fmt(r['fwd_bwd_ratio'], '.2f')} | "
                f"{fmt(r['fwd_peak_bytes'], '.1f', 2**-20)} | {fmt(r['fwd_peak_ratio'], '.2f')} | "
                f"{fmt(r.get('fwd_bwd_peak_bytes'), '.1f', 2**-20)} | {fmt(r.get('fwd_bwd_peak_ratio'), '.2f')} |"
            )
        groups = [r for r in rows if "max_group_share" in r]
        if groups:
            lines += ["", "Focus hard groups in these runs (random inputs, untrained centroids):", ""]
            lines += ["| variant | T | largest group share | causal pairs kept |", "|---|---:|---:|---:|"]
            for r in groups:
                share, kept = r["max_group_share"], r.get("pairs_kept", 0)
                lines.append(f"| {r['case']} | {r['T']} | {share:.3f} | {kept:.3f} |")
    for shape, rows in by_shape(dec):
        lines += [
            "",
            f"### Decode: one token on a KV cache of the given context, {shape.text()} (median of {meta['repeat']} "
            f"rounds x {meta['steps']} tokens, the variants taking turns within each round)",
            "",
            "| variant | context | ms / token | time / full | cache MiB (allocated) | cache / full |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for r in rows:
            lines.append(
                f"| {r['case']} | {r['context']} | {r['ms_per_token']:.2f} | {r['time_ratio']:.2f} | "
                f"{r['cache_bytes'] / 2**20:.2f} | {r['cache_ratio']:.3f} |"
            )
    if meta["skipped"]:
        lines += ["", "Skipped:", ""] + [f"- {s}" for s in meta["skipped"]]
    return "\n".join(lines)


def parse_ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


@cli_errors
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.attention", description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--lengths", type=parse_ints, default=None, help="comma-separated (default 1024,4096,16384)")
    parser.add_argument("--contexts", type=parse_ints, default=None, help="decode contexts (default 4096,16384)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="float32 on CPU, bfloat16 on CUDA")
    parser.add_argument(
        "--cases", default="", help="only cases whose label contains one of these comma-separated words"
    )
    parser.add_argument(
        "--shape",
        default="small",
        help=f"small (batch {BATCH}, {HEADS} heads x {HEAD_DIM}) or a model preset (its heads x head dimension, "
        f"a batch of {PRESET_TOKENS} tokens per call)",
    )
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--steps", type=int, default=32, help="decode tokens timed per context and round")
    parser.add_argument("--dense-gib", type=float, default=1.0, help="CPU: largest T x T score tensor a case may hold")
    parser.add_argument("--max-seconds", type=float, default=60.0, help="skip a run predicted to take longer")
    parser.add_argument("--no-decode", action="store_true")
    parser.add_argument("--no-backward", action="store_true", help="forward only")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here as JSON")
    parser.add_argument("--quick", action="store_true", help="a smoke run: T 256 and 512, contexts 512, 1 repeat")
    parser.add_argument("--memory-child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.memory_child:
        memory_child(json.loads(args.memory_child))
        return
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device")
    try:
        shape = small_shape if args.shape == "small" else preset_shape(args.shape)
    except (KeyError, ValueError) as err:
        parser.error(f"--shape: {err}")
    dtype = DTYPES[args.dtype or ("bfloat16" if args.device == "cuda" else "float32")]
    lengths = args.lengths or ([256, 512] if args.quick else [1024, 4096, 16384])
    contexts = [] if args.no_decode else (args.contexts or ([512] if args.quick else [4096, 16384]))
    repeat, steps = (1, 4) if args.quick else (args.repeat, args.steps)
    words = [w.strip() for w in args.cases.split(",") if w.strip()]
    cases = [c for c in CASES if c.kind == "full" or not words or any(w in c.label for w in words)]
    if args.no_backward:
        cases = [dataclasses.replace(c, backward=False) for c in cases]
    torch.manual_seed(0)
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    device = (
        torch.cuda.get_device_name() if args.device == "cuda" else f"{cpu}, {os.cpu_count()} cores"
    ) + f", torch {torch.__version__}, {torch.get_num_threads()} threads"
    meta: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "device": device,
        "command": "python -m bench.attention " + shlex.join(sys.argv[1:] if argv is None else argv),
        "dtype": str(dtype).removeprefix("torch."),
        "shape": args.shape,
        "repeat": repeat,
        "steps": steps,
        "loadavg_start": " / ".join(f"{x:.2f}" for x in os.getloadavg()),
        "memory_method": (
            "torch.cuda.max_memory_allocated growth during the call"
            if args.device == "cuda"
            else "growth of the peak RSS (VmHWM, reset via /proc/self/clear_refs) during one call after a warm-up, "
            "in a child process per length whose glibc mmap threshold is fixed at 64 KiB (every buffer its own "
            "mapping, returned when freed); the inputs exist before the call"
        ),
        "skipped": [],
    }
    print(f"# bench.attention on {device}", flush=True)
    skipped = meta["skipped"]
    fwd = bench_forward(
        cases, lengths, args.device, dtype, repeat, args.dense_gib, args.max_seconds, skipped, shape=shape
    )
    dec = (
        bench_decode(cases, contexts, args.device, dtype, steps, repeat, args.dense_gib, skipped, shape=shape)
        if contexts
        else []
    )
    meta["loadavg_end"] = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    print("\n" + markdown(meta, fwd, dec))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({**meta, "forward": fwd, "decode": dec}, indent=1) + "\n")
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    sys.exit(main())
