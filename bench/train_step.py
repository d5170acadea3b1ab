"""Training-step throughput and MFU per attention variant: ``python -m bench.train_step [--presets P1,P2]
[--variants all] [--seq-len 4096] [--device cuda] [--json F]``.

What is measured is what trains: each arm is the preset's launch config (``launch/configs/<preset>.toml``, or the
derived ``<preset>_<variant>.toml`` with the variant's launch settings) with the single-device engine and the
sequence length set to ``--seq-len``; precision, compile, the fused LM head (``train.fused_cross_entropy``) and the
SDPA backend (``train.sdpa_backend``) stay as the preset configures them. Activation checkpointing and the
micro-batch are what a user picks on this one device, the layout planner's choice (``arm_plan``,
``pretrain.layout_plan.single_device_plan``): no recomputation when the model fits without it, and the largest
micro-batch that fits the device less a 10% reserve, up to the preset's tokens per step (a power of two); each arm
is planned for its own variant, and its row records the plan. ``--micro-batch N`` fixes the micro-batch instead
(with the preset's checkpointing). The model comes from
``model.transformer.build_model`` and the engine from ``pretrain.engines.build_engine``, and one step is the trainer's
(``pretrain.loop.Trainer.train_step``): train progress, one micro-step (forward, loss, backward), gradient clipping,
the finiteness check (a host sync, as in the loop) and the optimizer update. Random tokens; no data loader.

Figures: the median step time over ``--steps`` steps after ``--warmup`` (compilation happens there), tokens/s at that
median, peak memory (CUDA: ``max_memory_allocated`` during the timed steps, weights and optimizer state included; CPU:
the process's peak resident set) and MFU = tokens/s x FLOPs per token / the device's dense bf16 peak
(``pretrain.metrics.peak_flops``; ``--peak-tflops`` for a device the table lacks). FLOPs per token are
``model.counts.flops_per_token`` (torchtitan's 6 N + 12 L H D T) of the *full-attention* model for every arm, so
the MFU column compares speed: a variant's MFU / full's is full's step time / the variant's.

The arms' micro-batches can differ, so a variant's ratio to full attention is of time per token (full's tokens/s /
the variant's), which is the ratio of step times when the micro-batches agree.

``--float8 none,rowwise,tensorwise``: each arm once per ``train.float8`` recipe (``none``: the bf16 arm), planned
alike (the planner counts float8's working memory); a float8 row's MFU is counted on the same bf16 FLOPs per token
against the bf16 peak, and its ``float8_speedup`` is its tokens/s / the same arm's bf16 tokens/s.

``--quick``: the same code on a tiny model (2 layers of 64, planned for a nominal 1 GiB device, micro-batch at most 2)
at T = 128 for 2 steps after 1 warm-up, without compile: a smoke run for CI.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from bench import profiling
from core.device import resolve_device
from core.errors import ConfigError, cli_errors
from model.attention import registry
from model.config import AttentionConfig, ModelConfig
from model.counts import flops_per_token
from model.transformer import Transformer, build_model
from pretrain.engines import Engine, build_engine
from pretrain.freezing import apply_trainable
from pretrain.layout_plan import RESERVE, single_device_plan
from pretrain.metrics import memory_gib, peak_flops, peak_flops_for_name
from run.config import FLOAT8_RECIPES, RunConfig, load_run_config
from run.sizes import GIB, host_memory

CONFIG_DIR = Path(__file__).resolve().parents[1] / "launch" / "configs"
PRESETS = ("llama-124m", "llama-1.3b")
SEQ_LEN = 4096
QUICK_SEQ_LEN = 128
QUICK_MEMORY = 1 << 30  # --quick plans for this nominal device
QUICK_MICRO = 2  # and at most this micro-batch
# --quick: a tiny shape of the same family (every other setting from the preset's config)
QUICK_MODEL = ("model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.d_ff=128", "model.vocab_size=256")


def trainable_variants() -> list[str]:
    """``full`` first, then every registered variant that trains (``Attention.trainable``)."""
    return ["full"] + sorted(name for name, entry in registry.items() if entry.cls.trainable and name != "full")


def config_path(preset: str, kind: str) -> Path:
    """The preset's launch config, or its derived one for a variant (``run.config.derived_config``)."""
    return CONFIG_DIR / (f"{preset}.toml" if kind == "full" else f"{preset}_{kind}.toml")


def device_memory(device: str) -> int:
    """The bytes one device holds: a CUDA device's total memory, or the machine's physical memory for the CPU."""
    dev = resolve_device(device)
    if dev.type == "cuda":
        return int(torch.cuda.get_device_properties(dev).total_memory)
    host = host_memory()
    if host is None:
        raise ConfigError("--device cpu: this system does not report its physical memory")
    return host


def _arm_run_config(
    path: Path, *, seq_len: int, device: str, quick: bool, micro: int, ac: str = "", float8: str = "none"
) -> RunConfig:
    overrides = [
        "train.engine=single",
        f"train.device={device}",
        f"data.seq_len={seq_len}",
        f"train.batch_size={micro}",
        f"train.micro_batch_size={micro}",
    ]
    if ac:
        overrides.append(f"train.activation_checkpointing={ac}")
    if float8 != "none":
        overrides.append(f'train.float8="{float8}"')
    if quick:
        overrides += [*QUICK_MODEL, "train.compile=false", "train.precision=auto"]
    cfg = load_run_config(path, overrides, validate=False)
    cfg.model.max_seq_len = max(cfg.model.max_seq_len, seq_len)
    cfg.model.validate()
    cfg.train.validate()
    return cfg


def most_micro(path: Path, seq_len: int, quick: bool) -> int:
    """The largest micro-batch an arm may take: the preset's tokens per step at ``seq_len``, rounded down to a power
    of two (``QUICK_MICRO`` with ``--quick``)."""
    if quick:
        return QUICK_MICRO
    base = load_run_config(path, validate=False)
    sequences = max(1, base.train.batch_size * base.data.seq_len // seq_len)
    return 1 << (sequences.bit_length() - 1)


def arm_plan(
    preset: str,
    kind: str,
    *,
    seq_len: int,
    device: str,
    quick: bool,
    micro_batch: int = 0,
    memory: int = 0,
    float8: str = "none",
) -> tuple[RunConfig, dict[str, Any]]:
    """The run config an arm trains with (the launch config on one device at ``seq_len``) and how its activation
    checkpointing and micro-batch were chosen: ``micro_batch`` > 0 fixes the micro-batch (the preset's
    checkpointing); 0 plans both for one device of ``memory`` bytes (0: this device's, ``device_memory``;
    ``QUICK_MEMORY`` with ``quick``): ``single_device_plan``'s pick up to ``most_micro``. When nothing fits by the
    estimate the arm still runs, at micro-batch 1 with full recomputation, and says so. ``float8``: the arm's
    ``train.float8`` recipe (planned with it)."""
    path = config_path(preset, kind)
    if micro_batch:
        cfg = _arm_run_config(path, seq_len=seq_len, device=device, quick=quick, micro=micro_batch, float8=float8)
        return cfg, {"planned": False}
    memory = memory or (QUICK_MEMORY if quick else device_memory(device))
    most = most_micro(path, seq_len, quick)
    sized = _arm_run_config(path, seq_len=seq_len, device=device, quick=quick, micro=1, float8=float8)
    chosen = single_device_plan(sized, memory, max_micro=most, reserve=RESERVE)
    ac, micro = (chosen.ac, chosen.micro) if chosen is not None else ("full", 1)
    cfg = _arm_run_config(path, seq_len=seq_len, device=device, quick=quick, micro=micro, ac=ac, float8=float8)
    plan = {
        "planned": True,
        "memory_gib": memory / GIB,
        "reserve": RESERVE,
        "max_micro": most,
        "fits": chosen is not None,
        "estimate_gib": chosen.total / GIB if chosen is not None else None,
    }
    return cfg, plan


def arm_config(
    preset: str, kind: str, *, seq_len: int, device: str, quick: bool, micro_batch: int = 0, memory: int = 0
) -> RunConfig:
    """``arm_plan``'s run config."""
    return arm_plan(preset, kind, seq_len=seq_len, device=device, quick=quick, micro_batch=micro_batch, memory=memory)[
        0
    ]


def plan_text(row: dict[str, Any]) -> str:
    """How a row's checkpointing and micro-batch were chosen, in a few words."""
    plan = row.get("plan") or {}
    head = f"micro-batch {row['micro_batch']}, checkpointing {row['activation_checkpointing']}"
    if not plan.get("planned"):
        return head + " (fixed)"
    if not plan["fits"]:
        return head + f" (nothing fits {plan['memory_gib']:.0f} GiB by the planner's estimate)"
    return (
        head + f" (planned: {plan['estimate_gib']:.1f} GiB estimated of {plan['memory_gib']:.0f} GiB less "
        f"{plan['reserve']:.0%})"
    )


def train_flops_per_token(model_cfg: ModelConfig, seq_len: int) -> float:
    """FLOPs per token of the full-attention model of this shape (whatever ``model_cfg``'s variant), so that MFU
    compares the variants' speed."""
    full = dataclasses.replace(model_cfg, attention=AttentionConfig(kind="full"))
    return flops_per_token(full, seq_len)["flops_per_token"]


def mfu(tokens_per_s: float, flops_per_token: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation of one device; None when its peak is unknown."""
    return tokens_per_s * flops_per_token / peak if peak else None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_step(model: Transformer, engine: Engine, cfg: RunConfig, tokens: Tensor, step: int) -> tuple[Tensor, bool]:
    """The trainer's step (``pretrain.loop.Trainer.train_step``): progress, one micro-step, clipping, the finiteness
    check (a host sync, as in the loop), the update; returns the loss sum and whether it was finite."""
    n_targets = tokens.shape[0] * (tokens.shape[1] - 1)
    model.set_collect_stats(False)
    model.set_train_progress(step, cfg.train.max_steps)
    out = engine.micro_step(tokens[:, :-1], tokens[:, 1:], loss_scale=1.0 / n_targets, aux_scale=1.0, sync=True)
    norm = engine.clip_gradients(cfg.train.grad_clip)
    finite = bool(torch.isfinite(out.loss_sum)) and bool(torch.isfinite(norm))
    engine.apply_update(skip=not finite)
    return out.loss_sum, finite


def profile_steps_of(
    model: Transformer, engine: Engine, cfg: RunConfig, tokens: Tensor, steps: range, top: int
) -> dict[str, Any]:
    """``bench.profiling``'s summary of the training steps numbered ``steps`` (no host sync between them beyond the
    step's own)."""
    numbers = iter(steps)
    device = resolve_device(cfg.train.device).type
    return profiling.safe_profile(
        lambda: train_step(model, engine, cfg, tokens, next(numbers)), len(steps), device, "train step", top
    )


def measure_arm(
    cfg: RunConfig,
    *,
    steps: int,
    warmup: int,
    peak: float | None = None,
    deadline: float | None = None,
    max_timed_s: float = 0.0,
    profile_steps: int = 0,
    profile_top: int = profiling.TOP,
    measured: Callable[[dict[str, Any]], None] | None = None,
    plan: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Time ``steps`` training steps after ``warmup`` of the arm ``cfg`` describes. Past ``deadline``
    (``time.perf_counter()``) it stops after the current step, keeping at least one timed step, and a warm-up step
    after the first (which compiles) that leaves no room for two more steps before it ends the warm-up; once the timed
    steps pass ``max_timed_s`` seconds (0: no limit) it stops after 3 of them (a slow arm's median needs no more).
    ``plan``: how the arm's checkpointing and micro-batch were chosen (``arm_plan``), kept in the row.

    ``profile_steps``: then profile that many more steps (``bench.profiling``: top kernels, launches and host
    synchronisations per step) into ``row["profile"]``, on the model the timed steps compiled; one step when a step
    takes over a second, none when the deadline is too close. ``measured`` gets the row before the profile runs
    (``bench.gpu`` keeps it if the item's timer cuts the profile off)."""
    device = resolve_device(cfg.train.device)
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model, device=device)
    engine = build_engine(model, cfg.train, device)
    apply_trainable(model, cfg.train, 0)
    seq_len, micro = cfg.data.seq_len, cfg.train.micro_batch_size
    tokens = torch.randint(cfg.model.vocab_size, (micro, seq_len + 1), generator=torch.Generator().manual_seed(0))
    n_targets = micro * seq_len
    times: list[float] = []
    loss, finite = torch.zeros(()), True
    step = 0
    for step in range(warmup + steps):
        if step == warmup and device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        _sync(device)
        t0 = time.perf_counter()
        loss, finite = train_step(model, engine, cfg, tokens, step)
        _sync(device)
        took = time.perf_counter() - t0
        if 0 < step < warmup - 1 and deadline is not None and time.perf_counter() + 2 * took > deadline:
            warmup = step + 1  # a slow arm near its deadline: time the next step rather than warm up again
        if step >= warmup:
            times.append(took)
            if deadline is not None and time.perf_counter() > deadline:
                break
            if max_timed_s and len(times) >= 3 and sum(times) > max_timed_s:
                break
    step_s = statistics.median(times)
    fpt = train_flops_per_token(cfg.model, seq_len)
    tps = n_targets / step_s
    peak = peak if peak is not None else peak_flops(device)
    row = {
        "kind": cfg.model.attention.kind,
        "seq_len": seq_len,
        "micro_batch": micro,
        "steps": len(times),
        "warmup": warmup,
        "precision": cfg.train.precision,
        "float8": cfg.train.float8,
        "compile": cfg.train.compile,
        "activation_checkpointing": cfg.train.activation_checkpointing,
        "plan": plan or {"planned": False},
        "parameters": sum(p.numel() for p in model.parameters()),
        "step_s": step_s,
        "step_s_all": times,
        "tokens_per_s": tps,
        "peak_memory_gib": memory_gib(device),
        "flops_per_token": fpt,
        "peak_flops": peak,
        "mfu": mfu(tps, fpt, peak),
        "loss": float(loss) / n_targets,
        "finite": finite,
    }
    if measured is not None:
        measured(row)
    n_profile = profile_steps if step_s * profile_steps <= 2.0 else min(profile_steps, 1)
    room = deadline is None or deadline - time.perf_counter() > 1.5 * (n_profile + 1) * step_s + 5.0
    if n_profile and room:
        row["profile"] = profile_steps_of(
            model, engine, cfg, tokens, range(step + 1, step + 1 + n_profile), profile_top
        )
    elif n_profile:
        row["profile"] = {"what": "train step", "steps": 0, "error": "not profiled: too close to the deadline"}
    del model, engine
    release(device)
    return row


def release(device: torch.device) -> None:
    """Drop the compiled graphs and cached memory of an arm: every arm compiles the same block code, so dynamo's
    per-code cache would fill up (and fall back to eager) across arms."""
    if "torch._dynamo" in sys.modules:  # nothing compiled otherwise (importing dynamo costs seconds on a CPU)
        torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def bench_arms(
    presets: list[str],
    variants: list[str],
    *,
    seq_len: int,
    device: str,
    quick: bool,
    steps: int,
    warmup: int,
    micro_batch: int = 0,
    peak: float | None = None,
    deadline: float | None = None,
    errors: list[str] | None = None,
    float8s: tuple[str, ...] = ("none",),
) -> list[dict[str, Any]]:
    """One row per (preset, variant, float8 recipe), with ``step_ratio`` = step time / full attention's of the same
    preset and recipe, and ``float8_speedup`` = tokens/s / the same arm's bf16 (``none``) tokens/s (when measured). A
    failing arm (out of memory, a path this device lacks) is listed in ``errors`` and skipped."""
    rows: list[dict[str, Any]] = []
    for preset in presets:
        for kind in variants:
            for float8 in float8s:
                arm = f"{preset} {kind}" + (f" float8 {float8}" if float8 != "none" else "")
                try:
                    cfg, plan = arm_plan(
                        preset,
                        kind,
                        seq_len=seq_len,
                        device=device,
                        quick=quick,
                        micro_batch=micro_batch,
                        float8=float8,
                    )
                    measured = measure_arm(cfg, steps=steps, warmup=warmup, peak=peak, deadline=deadline, plan=plan)
                    row = {"preset": preset, **measured}
                except (RuntimeError, MemoryError, ValueError, ConfigError) as err:
                    if errors is None:
                        raise
                    errors.append(f"{arm}: {type(err).__name__}: {(str(err).splitlines() or [''])[0][:200]}")
                    release(torch.device(resolve_device(device)))
                    continue
                same = [r for r in rows if r["preset"] == preset and r.get("float8", "none") == float8]
                full = next((r for r in same if r["kind"] == "full"), None)
                row["step_ratio"] = time_ratio(row, full) if full else None
                row["float8_speedup"] = float8_speedup(row, rows)
                rows.append(row)
                print(f"  train {arm}: {format_row(row)}", flush=True)
    return rows


def float8_speedup(row: dict[str, Any], rows: list[dict[str, Any]]) -> float | None:
    """A float8 arm's tokens/s / the bf16 (``none``) arm's of the same preset and variant among ``rows``; None for a
    bf16 arm or when that arm was not measured."""
    if row.get("float8", "none") == "none":
        return None
    bf16 = next(
        (
            r
            for r in rows
            if r["preset"] == row["preset"] and r["kind"] == row["kind"] and r.get("float8", "none") == "none"
        ),
        None,
    )
    return row["tokens_per_s"] / bf16["tokens_per_s"] if bf16 else None


def time_ratio(row: dict[str, Any], full: dict[str, Any]) -> float:
    """The arm's time per token / full attention's (of the same preset): their step times' ratio when the
    micro-batches agree."""
    return full["tokens_per_s"] / row["tokens_per_s"]


def format_row(row: dict[str, Any]) -> str:
    mfu_text = f", MFU {row['mfu']:.1%}" if row["mfu"] is not None else ""
    return (
        f"step {row['step_s'] * 1e3:.1f} ms, {row['tokens_per_s']:,.0f} tok/s{mfu_text}{float8_text(row)}, "
        f"peak {row['peak_memory_gib']:.2f} GiB; {plan_text(row)}"
    )


def float8_text(row: dict[str, Any]) -> str:
    """``, float8 rowwise (1.27x bf16's tokens/s)`` for a float8 row; empty for a bf16 one."""
    if row.get("float8", "none") == "none":
        return ""
    speedup = row.get("float8_speedup")
    return f", float8 {row['float8']}" + (f" ({speedup:.2f}x bf16's tokens/s)" if speedup is not None else "")


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| preset | variant | T | micro-batch | step ms | time per token / full | tokens/s | MFU | peak GiB | "
        "precision, compile, checkpointing |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        ratio = "-" if r.get("step_ratio") is None else f"{r['step_ratio']:.2f}"
        mfu_text = "-" if r["mfu"] is None else f"{r['mfu']:.1%}"
        lines.append(
            f"| {r['preset']} | {r['kind']} | {r['seq_len']} | {r['micro_batch']} | {r['step_s'] * 1e3:.1f} | "
            f"{ratio} | {r['tokens_per_s']:,.0f} | {mfu_text} | {r['peak_memory_gib']:.2f} | {r['precision']}"
            f"{float8_text(r)}, {'compile' if r['compile'] else 'eager'}, {r['activation_checkpointing']} |"
        )
    return "\n".join(lines)


def parse_list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


@cli_errors
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.train_step", description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--presets", type=parse_list, default=list(PRESETS))
    parser.add_argument("--variants", default="all", help="comma-separated registered variants, or all (trainable)")
    parser.add_argument("--seq-len", type=int, default=0, help=f"default {SEQ_LEN} ({QUICK_SEQ_LEN} with --quick)")
    parser.add_argument("--steps", type=int, default=0, help="timed steps (default 10; 2 with --quick)")
    parser.add_argument("--warmup", type=int, default=-1, help="untimed steps first (default 3; 1 with --quick)")
    parser.add_argument("--micro-batch", type=int, default=0, help="0: the preset's tokens per micro-batch")
    parser.add_argument("--peak-tflops", type=float, default=0.0, help="dense bf16 peak for a device the table lacks")
    parser.add_argument(
        "--float8", type=parse_list, default=["none"], help="train.float8 recipes per arm, e.g. none,rowwise,tensorwise"
    )
    parser.add_argument("--quick", action="store_true", help="a tiny model, few steps, no compile (CI)")
    parser.add_argument("--json", type=Path, default=None, help="write the rows here as JSON")
    args = parser.parse_args(argv)
    variants = trainable_variants() if args.variants == "all" else parse_list(args.variants)
    unknown = [v for v in variants if v not in registry]
    if unknown:
        parser.error(f"--variants: {', '.join(unknown)} not registered; registered: {', '.join(sorted(registry))}")
    wrong = [r for r in args.float8 if r not in FLOAT8_RECIPES]
    if wrong or not args.float8:
        parser.error(f"--float8: {', '.join(wrong) or 'empty'}: allowed {', '.join(FLOAT8_RECIPES)}")
    device = resolve_device(args.device, key="--device")
    peak = args.peak_tflops * 1e12 if args.peak_tflops else None
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"# bench.train_step on {name} (bf16 peak {peak or peak_flops_for_name(name) or 'unknown'})", flush=True)
    errors: list[str] = []
    rows = bench_arms(
        args.presets,
        variants,
        seq_len=args.seq_len or (QUICK_SEQ_LEN if args.quick else SEQ_LEN),
        device=str(device),
        quick=args.quick,
        steps=args.steps or (2 if args.quick else 10),
        warmup=args.warmup if args.warmup >= 0 else (1 if args.quick else 3),
        micro_batch=args.micro_batch,
        peak=peak,
        errors=errors,
        float8s=tuple(args.float8),
    )
    print("\n" + markdown(rows))
    for err in errors:
        print(f"- failed: {err}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"device": name, "rows": rows, "errors": errors}, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
