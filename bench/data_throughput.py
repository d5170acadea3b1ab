"""Data path throughput against what training consumes: ``python -m bench.data_throughput [--data PATH] [--seconds S]``.

Rows, each in tokens per second on this machine:

- memmap: ``PreparedDataset.batch`` over random sequence indices (batch 8 x 1024) of shards
  written by ``data.prepare`` (one process; the shards were just written, so they sit in the
  page cache: this is the warm-cache rate);
- on-the-fly tokenisation: ``tokenizer.encode_batch`` over the documents (the tokenizer's own
  threads);
- streaming: ``data.streaming.build_stream_loader`` over the same documents (local source,
  in this process: num_workers = 0), when that module imports and runs; otherwise the row says
  why it was skipped.

Each is divided by the tokens per second one training step consumes (forward + backward +
AdamW through the trainer's engine, ``pretrain.engines``) for the tiny model at its demo batch
(16 x 256) and for ``llama-124m`` at 1 x 1024. A ratio above 1 means the data path outruns
the model. Prints Markdown ready for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from core.errors import cli_errors

if TYPE_CHECKING:
    from data.shards import PreparedDataset
    from data.tokenizer import Tokenizer

TARGET_MEMMAP = 1_000_000  # tokens/s per process the memmap path must reach


@dataclass
class Row:
    name: str
    tokens_per_s: float | None
    note: str = ""


@dataclass
class ModelRate:
    preset: str
    batch: int
    seq_len: int
    steps: int
    tokens_per_s: float


def timed(fn: Callable[[], int], seconds: float, min_calls: int = 3) -> float:
    """Tokens per second of ``fn`` (which returns the tokens it delivered), after one warm-up call."""
    fn()
    tokens, calls, t0 = 0, 0, time.perf_counter()
    while calls < min_calls or time.perf_counter() - t0 < seconds:
        tokens += fn()
        calls += 1
    return tokens / (time.perf_counter() - t0)


# ---- data paths -----------------------------------------------------------------------------


def memmap_rate(dataset: PreparedDataset, batch: int, seconds: float) -> float:
    rng = np.random.default_rng(0)
    n = len(dataset)

    def step() -> int:
        out = dataset.batch(rng.integers(0, n, batch))
        return out.shape[0] * (out.shape[1] - 1)  # training tokens (targets) delivered

    return timed(step, seconds)


def tokenise_rate(tokenizer: Tokenizer, texts: list[str], seconds: float, chunk: int = 16) -> float:
    chunks = [texts[i : i + chunk] for i in range(0, len(texts), chunk)]
    state = {"i": 0}

    def step() -> int:
        batch = chunks[state["i"] % len(chunks)]
        state["i"] += 1
        return sum(len(ids) + 1 for ids in tokenizer.encode_batch(batch))  # + EOS, as packing adds

    return timed(step, seconds, min_calls=1)


def streaming_row(tokenizer: Tokenizer, folder: str, batch: int, seq_len: int, seconds: float) -> Row:
    """data.streaming's loader over the same documents, in this process (num_workers = 0), if it runs."""
    name = f"streaming: data.streaming.build_stream_loader, in-process ({batch} x {seq_len})"
    try:
        from data.streaming import StreamConfig, build_stream_loader
    except Exception as exc:  # another engineer's module, possibly absent or half-written: skip
        return Row(
            name,
            None,
            f"skipped: data.streaming.build_stream_loader / StreamConfig not importable ({exc.__class__.__name__})",
        )
    try:
        cfg = StreamConfig(source="local", path=folder, num_workers=0)
        batches = iter(build_stream_loader(cfg, tokenizer, seq_len=seq_len, batch_size=batch, num_workers=0))
        rate = timed(lambda: next(batches).shape[0] * seq_len, seconds)
    except Exception as exc:  # an API that differs from the expected one is a skipped row
        return Row(name, None, f"skipped: it did not run as expected ({exc.__class__.__name__}: {str(exc)[:80]})")
    return Row(name, rate, "tokenises on the fly, shuffle window 1024 documents")


# ---- model consumption ----------------------------------------------------------------------


def model_rate(preset: str, batch: int, seq_len: int, steps: int, device: str) -> ModelRate:
    """Tokens/s of full training steps (forward, backward, clip, AdamW) as the trainer runs them."""
    from core.device import resolve_device
    from model.transformer import build_model
    from pretrain.engines import build_engine
    from run.config import TrainConfig, model_config_from_dict

    torch.manual_seed(0)
    dev = resolve_device(device)
    cfg = model_config_from_dict({"preset": preset})
    train = TrainConfig(batch_size=batch, max_steps=10**6, warmup_steps=0, device=device)
    engine = build_engine(build_model(cfg, device=dev), train, dev)
    data = torch.randint(0, cfg.vocab_size, (batch, seq_len + 1))

    def step() -> None:
        engine.micro_step(data[:, :-1], data[:, 1:], loss_scale=1.0 / (batch * seq_len), aux_scale=1.0, sync=True)
        engine.optimizer_step(train.grad_clip)  # reads the norm on the host: a sync, as a logging step
        if dev.type == "cuda":
            torch.cuda.synchronize()

    step()  # warm-up: allocations, kernel selection
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    return ModelRate(preset, batch, seq_len, steps, batch * seq_len * steps / (time.perf_counter() - t0))


# ---- setup and report -----------------------------------------------------------------------


def load_texts(data: str) -> tuple[list[str], str]:
    if data:
        from data.sources import iter_local

        return [d.text for d in iter_local(data)], data
    from data.embedded import iter_embedded

    return [d.text for d in iter_embedded()], "the embedded corpus"


def _as_data_option(exc: Exception) -> str:
    """Errors from the shared data code name data.path / --path; here the option is --data."""
    message = str(exc)
    for key in ("data.path:", "--path:"):
        if message.startswith(key):
            return "--data:" + message[len(key) :]
    return message


def text_folder(data: str, texts: list[str], tmp: Path) -> str:
    """A local path the streaming loader can read: --data itself, or the embedded plays written out as .txt."""
    if data:
        return data
    folder = tmp / "texts"
    folder.mkdir()
    for i, text in enumerate(texts):
        (folder / f"{i:04d}.txt").write_text(text, encoding="utf-8")
    return str(folder)


def cpu_name() -> str:
    try:  # platform.processor() is often empty on Linux; /proc/cpuinfo names the model
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_line(device: str) -> str:
    cpu = f"{cpu_name()}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads"
    if device == "cuda" or (device == "auto" and torch.cuda.is_available()):
        return f"{torch.cuda.get_device_name(0)}; host {cpu}"
    return cpu


def fmt_rate(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f}"


def fmt_ratio(x: float | None, base: float) -> str:
    return "-" if x is None else f"{x / base:,.1f}"


def report(args: argparse.Namespace, rows: list[Row], models: list[ModelRate], corpus: str) -> str:
    lines = [
        "## Data throughput",
        "",
        f"- Date: {datetime.date.today().isoformat()}.",
        f"- Device: {device_line(args.device)}.",
        f"- Command: `{' '.join(['python -m bench.data_throughput', shlex.join(sys.argv[1:])]).strip()}`.",
        f"- Data: {corpus}.",
        "",
        "| model training step | batch x length | steps timed | tokens/s |",
        "|---|---:|---:|---:|",
    ]
    lines += [f"| {m.preset} | {m.batch} x {m.seq_len} | {m.steps} | {m.tokens_per_s:,.0f} |" for m in models]
    heads = " | ".join(f"x {m.preset} training" for m in models)
    lines += ["", f"| data path | tokens/s | {heads} | note |", "|---|---:|" + "---:|" * len(models) + "---|"]
    for r in rows:
        ratios = " | ".join(fmt_ratio(r.tokens_per_s, m.tokens_per_s) for m in models)
        lines.append(f"| {r.name} | {fmt_rate(r.tokens_per_s)} | {ratios} | {r.note} |")
    memmap = rows[0].tokens_per_s
    assert memmap is not None  # the memmap row is always measured
    verdict = "met" if memmap >= TARGET_MEMMAP else "NOT met"
    lines += ["", f"Memmap path: {memmap:,.0f} tokens/s per process (target >= {TARGET_MEMMAP:,}: {verdict})."]
    return "\n".join(lines)


@cli_errors
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.data_throughput", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--data", default="", help="a file, folder or glob of .txt / .jsonl / .parquet (default: the embedded corpus)"
    )
    parser.add_argument("--seconds", type=float, default=3.0, help="per data measurement")
    parser.add_argument(
        "--tokenizer",
        default="train",
        help="'train' (SentencePiece BPE, cached like the trainer's) or a .model / tokenizer.json",
    )
    parser.add_argument(
        "--vocab-size", type=int, default=0, help="pieces of a trained tokenizer (default 4096, the tiny preset's)"
    )
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="for the model steps")
    parser.add_argument("--steps-124m", type=int, default=2, help="timed llama-124m steps (after one warm-up)")
    parser.add_argument("--json", default="", help="also write the figures to this JSON file")
    args = parser.parse_args(argv)
    if args.seconds <= 0:
        parser.error(f"--seconds: must be > 0, got {args.seconds}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device")

    from core.errors import ConfigError
    from data.prepare import PrepareConfig, prepare
    from data.shards import load_prepared_tokenizer, open_prepared

    try:
        texts, corpus = load_texts(args.data)
    except ConfigError as exc:
        print(f"error: {_as_data_option(exc)}", file=sys.stderr)
        return 2
    batch, seq_len = 8, 1024
    with tempfile.TemporaryDirectory(prefix="bench-data-") as tmp:
        cfg = PrepareConfig(
            out=str(Path(tmp) / "shards"),
            source="local" if args.data else "embedded",
            path=args.data,
            tokenizer=args.tokenizer,
            vocab_size=args.vocab_size,
            shard_tokens=2**20,
        )
        try:
            prepared = prepare(cfg, log=lambda line: print(line, file=sys.stderr), progress=False)
            train, _, index = open_prepared(cfg.out, seq_len)
        except ConfigError as exc:
            print(f"error: {_as_data_option(exc)}", file=sys.stderr)
            return 2
        if len(train) < 1:
            print(
                f"error: --data: the training split has {len(train.tokens)} tokens, fewer than one {seq_len + 1}-token "
                "sequence",
                file=sys.stderr,
            )
            return 2
        tokenizer = load_prepared_tokenizer(cfg.out, index)
        corpus += (
            f", {len(texts):,} documents, {index['splits']['train']['tokens']:,} training tokens in "
            f"{len(index['splits']['train']['shards'])} {index['dtype']} shards of <= 2^20 tokens; "
            f"tokenizer {tokenizer.file_name} with {tokenizer.vocab_size:,} ids"
        )
        print(f"# {prepared.summary}", file=sys.stderr)
        print("# timing the memmap path ...", file=sys.stderr, flush=True)
        rows = [
            Row(
                f"memmap: PreparedDataset.batch, random indices ({batch} x {seq_len})",
                memmap_rate(train, batch, args.seconds),
                "one process, warm page cache",
            )
        ]
        print("# timing on-the-fly tokenisation ...", file=sys.stderr, flush=True)
        threads = os.cpu_count() if tokenizer.file_name == "tokenizer.model" else "its own"
        rows.append(
            Row(
                "on-the-fly: tokenizer.encode_batch over documents",
                tokenise_rate(tokenizer, texts, args.seconds),
                f"{threads} tokenizer threads",
            )
        )
        print("# timing data.streaming ...", file=sys.stderr, flush=True)
        rows.append(streaming_row(tokenizer, text_folder(args.data, texts, Path(tmp)), batch, seq_len, args.seconds))
    print("# timing training steps (tiny, then llama-124m) ...", file=sys.stderr, flush=True)
    tiny_steps = 5 if args.device == "cpu" or not torch.cuda.is_available() else 20
    models = [
        model_rate("tiny", 16, 256, tiny_steps, args.device),
        model_rate("llama-124m", 1, 1024, args.steps_124m, args.device),
    ]
    print(report(args, rows, models, corpus))
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"rows": [asdict(r) for r in rows], "models": [asdict(m) for m in models], "corpus": corpus}, indent=2
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
