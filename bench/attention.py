"""Attention variants side by side: ``python -m bench.attention [--device cpu|cuda] [--quick]``.

One attention layer (batch 1, 4 heads of 64), random inputs, float32. For each entry of
``CASES`` and each length: forward time and forward+backward time, with their ratios to full
attention at the same length. Then DGA decoding: per-token time and KV-cache size at 4K/8K/16K
context against full attention (``DECODE_CASES``). Prints markdown tables.

Adding a variant is one line in ``CASES``: a label, the registered kind and its
options. Ratios divide by the ``full`` entry's time at the same length.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from model.attention import KVCache, LayerSpec, build_attention, registry

HEADS, HEAD_DIM, BATCH = 4, 64, 1


@dataclass
class Case:
    label: str
    kind: str  # a registered attention variant
    options: dict[str, Any] = field(default_factory=dict)
    backward: bool = True  # time forward+backward too


CASES: list[Case] = [
    Case("full (SDPA)", "full"),
    Case("dga causal (C=128, m=16, gamma=0.1)", "dga", dict(selection="causal", chunk_size=128, group_size=16)),
    Case("dga sequence (m=16, gamma=0.1)", "dga", dict(selection="sequence", group_size=16)),
    Case("focus soft (K=4, w=128)", "focus", dict(n_groups=4, window=128)),
    Case("focus hard k=1 (K=4, w=128)", "focus", dict(n_groups=4, window=128, mode="hard", top_k=1), backward=False),
    Case("focus hard k=1 (K=8, w=128)", "focus", dict(n_groups=8, window=128, mode="hard", top_k=1), backward=False),
    Case("focus hard k=2 (K=4, w=128)", "focus", dict(n_groups=4, window=128, mode="hard", top_k=2), backward=False),
    Case(
        "prescored_hyper kmeans (top_k=1024, min_seq_len=512)",
        "prescored_hyper",
        dict(scoring="kmeans", top_k=1024, min_seq_len=512),
    ),
    Case(
        "prescored_hyper leverage (top_k=1024, min_seq_len=512)",
        "prescored_hyper",
        dict(scoring="leverage", top_k=1024, min_seq_len=512),
    ),
]


@dataclass
class DecodeCase:
    label: str
    kind: str
    options: dict[str, Any] = field(default_factory=dict)


DECODE_CASES: list[DecodeCase] = [
    DecodeCase("full (SDPA)", "full"),
    DecodeCase("dga causal (C=128, m=16, gamma=0.1)", "dga", dict(selection="causal", chunk_size=128, group_size=16)),
]


def make(kind: str, options: dict[str, Any], max_len: int, device, dtype):
    cfg = registry[kind].config_cls(**options)
    if hasattr(cfg, "validate"):
        cfg.validate()
    spec = LayerSpec(
        d_model=HEADS * HEAD_DIM,
        n_heads=HEADS,
        n_kv_heads=HEADS,
        head_dim=HEAD_DIM,
        max_seq_len=max_len,
        layer_idx=0,
        n_layers=1,
    )
    return build_attention(kind, cfg, spec).to(device, dtype)


def timeit(fn: Callable[[], Any], device: str, repeat: int) -> float:
    """Median seconds of ``repeat`` runs after one warm-up."""

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    fn()
    sync()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def forward(module, q, k, v, hidden, positions) -> None:
    with torch.no_grad():
        module(q, k, v, hidden=hidden, positions=positions)


def forward_backward(module, q, k, v, hidden, positions) -> None:
    q, k, v = (x.detach().requires_grad_(True) for x in (q, k, v))
    module(q, k, v, hidden=hidden, positions=positions).output.sum().backward()


def bench_forward(lengths: list[int], device: str, repeat: int) -> list[dict[str, Any]]:
    rows = []
    dtype = torch.float32
    for t in lengths:
        g = torch.Generator().manual_seed(t)
        q, k, v = (torch.randn(BATCH, HEADS, t, HEAD_DIM, generator=g).to(device, dtype) for _ in range(3))
        hidden = torch.randn(BATCH, t, HEADS * HEAD_DIM, generator=g).to(device, dtype)
        positions = torch.arange(t, device=device)
        base: dict[str, float] = {}
        for case in CASES:
            module = make(case.kind, case.options, t, device, dtype)

            inputs = (module, q, k, v, hidden, positions)
            row = {"case": case.label, "T": t, "fwd": timeit(partial(forward, *inputs), device, repeat)}
            row["fwd_bwd"] = timeit(partial(forward_backward, *inputs), device, repeat) if case.backward else None
            if case.kind == "full":
                base = {"fwd": row["fwd"], "fwd_bwd": row["fwd_bwd"]}
            rows.append(
                {
                    **row,
                    "fwd_ratio": row["fwd"] / base["fwd"] if base else None,
                    "fwd_bwd_ratio": row["fwd_bwd"] / base["fwd_bwd"] if base and row["fwd_bwd"] else None,
                }
            )
            print(f"  {case.label} T={t}: fwd {row['fwd'] * 1e3:.1f} ms", flush=True)
    return rows


def bench_decode(contexts: list[int], device: str, steps: int, prefill_chunk: int = 1024) -> list[dict[str, Any]]:
    """Fill a KV cache to ``context`` tokens (chunked prefill through the variant, so DGA builds
    its grouped cache), then time ``steps`` single-token decode calls."""
    rows = []
    dtype = torch.float32
    elt = torch.finfo(dtype).bits // 8
    for ctx in contexts:
        g = torch.Generator().manual_seed(ctx)
        total = ctx + steps
        q, k, v = (torch.randn(BATCH, HEADS, total, HEAD_DIM, generator=g).to(device, dtype) for _ in range(3))
        hidden = torch.zeros(BATCH, 1, HEADS * HEAD_DIM, device=device, dtype=dtype)
        base = None
        for case in DECODE_CASES:
            module = make(case.kind, case.options, total, device, dtype)
            cache = KVCache(BATCH, HEADS, HEAD_DIM, total, dtype=dtype, device=device)
            with torch.no_grad():
                if case.kind == "full":  # full attention's prefill leaves exactly the raw keys: skip its O(L^2) work
                    cache.append(k[:, :, :ctx], v[:, :, :ctx])
                else:
                    for a in range(0, ctx, prefill_chunk):
                        b = min(ctx, a + prefill_chunk)
                        module(
                            q[:, :, a:b],
                            k[:, :, a:b],
                            v[:, :, a:b],
                            hidden=hidden.expand(BATCH, b - a, -1),
                            positions=torch.arange(a, b, device=device),
                            cache=cache,
                        )
                if device == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                for i in range(ctx, total):
                    module(
                        q[:, :, i : i + 1],
                        k[:, :, i : i + 1],
                        v[:, :, i : i + 1],
                        hidden=hidden,
                        positions=torch.arange(i, i + 1, device=device),
                        cache=cache,
                    )
                if device == "cuda":
                    torch.cuda.synchronize()
                per_token = (time.perf_counter() - t0) / steps
            size = (
                module.cache_size(cache)
                if hasattr(module, "cache_size")
                else {"full_kv_slots": cache.length, "dga_kv_slots": cache.length, "dga_query_slots": 0}
            )
            slots = size["dga_kv_slots"]
            nbytes = (2 * slots + size["dga_query_slots"]) * BATCH * HEADS * HEAD_DIM * elt
            row = {
                "case": case.label,
                "context": ctx,
                "ms_per_token": per_token * 1e3,
                "kv_slots": slots,
                "query_slots": size["dga_query_slots"],
                "bytes": nbytes,
            }
            if base is None:
                base = row
            row["time_ratio"] = row["ms_per_token"] / base["ms_per_token"]
            row["bytes_ratio"] = row["bytes"] / base["bytes"]
            rows.append(row)
            print(f"  {case.label} context={ctx}: {row['ms_per_token']:.2f} ms/token, {slots} KV slots", flush=True)
    return rows


def fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.attention", description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="short lengths and contexts (a smoke run)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device")
    lengths = [256, 512] if args.quick else [1024, 2048, 4096]
    contexts = [1024, 2048] if args.quick else [4096, 8192, 16384]
    repeat, steps = (1, 8) if args.quick else (3, 32)
    torch.manual_seed(0)
    print(
        f"# bench.attention on {args.device} ({platform.processor() or platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads)",
        flush=True,
    )
    fwd = bench_forward(lengths, args.device, repeat)
    dec = bench_decode(contexts, args.device, steps)
    print(
        f"\n## Forward and forward+backward, one layer, batch {BATCH}, {HEADS} heads x {HEAD_DIM}, float32 (median of {repeat})\n"
    )
    print("| variant | T | fwd ms | fwd / full | fwd+bwd ms | fwd+bwd / full |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in fwd:
        print(
            f"| {r['case']} | {r['T']} | {r['fwd'] * 1e3:.1f} | {fmt(r['fwd_ratio'], '.2f')} | {fmt(r['fwd_bwd'] and r['fwd_bwd'] * 1e3, '.1f')} | {fmt(r['fwd_bwd_ratio'], '.2f')} |"
        )
    print(f"\n## Decode: one token on a KV cache of the given context (mean of {steps} tokens)\n")
    print(
        "| variant | context | ms / token | time / full | KV slots per head | queries held | cache MiB | cache / full |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in dec:
        print(
            f"| {r['case']} | {r['context']} | {r['ms_per_token']:.2f} | {r['time_ratio']:.2f} | {r['kv_slots']} | {r['query_slots']} | {r['bytes'] / 2**20:.2f} | {r['bytes_ratio']:.3f} |"
        )


if __name__ == "__main__":
    main()
