"""``python -m eval.run --run DIR | --checkpoint DIR --tasks ppl,sample [--limit N] [--out FILE]``

Evaluates a checkpoint (``--run`` takes the run's latest complete one) and writes
``{task: {metric: value}}`` JSON, by default to ``<run>/eval/step_NNNNNNNN.json``.

Tasks:
- ``ppl``: token-level loss and perplexity on the run's validation split (all of it, or ``--limit`` sequences).
- ``sample``: a seeded generated continuation of ``--prompt`` through the KV cache.
- ``attention_stats``: each variant's statistics (sink ratio, density, ...) averaged over layers, from the
  dense reference path on the first validation batch, so variants are measured the same way.
- ``ppl_length``: loss and perplexity at ``--lengths`` multiples of the training length on the same
  held-out tokens, plus a PNG plot beside the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from model.errors import ConfigError

TASKS = ("ppl", "sample", "ppl_length", "attention_stats")


def resolve_checkpoint(run: str | None, checkpoint: str | None) -> Path:
    from pretrain.checkpoint import latest_checkpoint

    if checkpoint:
        path = Path(checkpoint)
        if not path.is_dir():
            raise ConfigError(f"--checkpoint: no such directory {checkpoint!r}")
        return path
    path = latest_checkpoint(Path(run))
    if path is None:
        raise ConfigError(f"--run: no complete checkpoint under {run}/checkpoints")
    return path


def held_out(cfg, tokenizer_dir: Path):
    from data.build import build_corpus

    cfg.data.tokenizer = str(_tokenizer_file(tokenizer_dir))  # the checkpoint's own tokenizer, never a retrained one
    return build_corpus(cfg.data, vocab_size=cfg.model.vocab_size, log=lambda line: print(line, file=sys.stderr))


def task_ppl(model, corpus, *, limit: int, device) -> dict:
    from eval.perplexity import mean_loss, perplexity

    n = min(len(corpus.val), limit) if limit else len(corpus.val)
    batches = (torch.stack([corpus.val[i] for i in range(a, min(a + 8, n))]) for a in range(0, n, 8))
    loss, tokens = mean_loss(model, batches, device=device)
    return {"loss": loss, "perplexity": perplexity(loss), "tokens": tokens, "sequences": n}


def task_ppl_length(model, corpus, *, train_length: int, multiples: list[float], max_tokens: int, device, plot: Path) -> dict:
    from eval.length import loss_by_length, plot_loss_by_length

    lengths = [max(1, int(train_length * m)) for m in multiples]
    results = loss_by_length(model, corpus.val.tokens, lengths, max_tokens=max_tokens, device=device)
    out = {str(length): r for length, r in results.items()}
    try:
        out["plot"] = str(plot_loss_by_length(results, plot, train_length=train_length))
    except ImportError:
        out["plot"] = "matplotlib is not installed (pip install '.[eval]')"
    return out


@torch.no_grad()
def task_attention_stats(model, corpus, *, batch_size: int, device) -> dict:
    cores = [block.attn.core for block in model.blocks]
    saved = [core.impl for core in cores]
    for core in cores:
        core.impl = "reference"
    model.set_collect_stats(True)
    try:
        batch = torch.stack([corpus.val[i] for i in range(min(batch_size, len(corpus.val)))]).to(device)
        stats = model(batch[:, :-1]).stats
    finally:
        model.set_collect_stats(False)
        for core, impl in zip(cores, saved):
            core.impl = impl
    return {key: float(value) for key, value in stats.items()} | {"sequences": int(batch.shape[0])}


def task_sample(model, tokenizer, *, prompt: str, max_new_tokens: int, seed: int, device) -> dict:
    ids = tokenizer.encode(prompt) or [tokenizer.eos_id]
    gen = torch.Generator(device=device).manual_seed(seed)
    out = model.generate(torch.tensor([ids], device=device), max_new_tokens, temperature=0.8, top_k=50, generator=gen, eos_id=tokenizer.eos_id)
    return {"prompt": prompt, "text": tokenizer.decode(out[0, len(ids) :].tolist()), "tokens": int(out.shape[1] - len(ids))}


def _tokenizer_file(directory: Path) -> Path:
    for name in ("tokenizer.model", "tokenizer.json"):
        if (directory / name).is_file():
            return directory / name
    raise ConfigError(f"--checkpoint: {directory} holds no tokenizer.model or tokenizer.json")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m eval.run", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--run", help="run directory (uses its latest complete checkpoint)")
    src.add_argument("--checkpoint", help="checkpoint directory (checkpoints/step_NNNNNNNN)")
    p.add_argument("--tasks", default="ppl,sample", help=f"comma-separated: {', '.join(TASKS)}")
    p.add_argument("--limit", type=int, default=0, help="cap on examples per task (0 = all)")
    p.add_argument("--out", help="JSON output file (default: <run>/eval/step_N.json)")
    p.add_argument("--prompt", default="ROMEO.", help="sample: prompt text")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lengths", default="1,2,4,8", help="ppl_length: multiples of the training length")
    p.add_argument("--max-tokens", type=int, default=16384, help="ppl_length: held-out tokens scored at every length")
    p.add_argument("--device", default="auto")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override the checkpoint's model config, e.g. --set model.attention.focus.mode=hard")
    args = p.parse_args(argv)
    try:
        tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
        unknown = [t for t in tasks if t not in TASKS]
        if unknown or not tasks:
            raise ConfigError(f"--tasks: {', '.join(unknown) or '(empty)'} not available; allowed: {', '.join(TASKS)}")
        try:
            multiples = [float(m) for m in args.lengths.split(",") if m.strip()]
        except ValueError:
            raise ConfigError(f"--lengths: {args.lengths!r} is not a comma-separated list of numbers, e.g. 1,2,4,8") from None
        path = resolve_checkpoint(args.run, args.checkpoint)
        from data.tokenizer import load_tokenizer
        from pretrain.checkpoint import load_model, load_trainer_state
        from pretrain.engine import resolve_device

        device = resolve_device(args.device)
        model, cfg = load_model(path, device=device, overrides=args.set)
        tokenizer = load_tokenizer(_tokenizer_file(path))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    step = load_trainer_state(path)["step"]
    results: dict = {"checkpoint": str(path), "step": step}
    out = Path(args.out) if args.out else path.parent.parent / "eval" / f"{path.name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    corpus = held_out(cfg, path) if {"ppl", "ppl_length", "attention_stats"} & set(tasks) else None
    for task in tasks:
        if task == "ppl_length":
            results[task] = task_ppl_length(model, corpus, train_length=cfg.data.seq_len, multiples=multiples, max_tokens=args.max_tokens, device=device, plot=out.with_suffix(".ppl_length.png"))
            for length, r in results[task].items():
                if isinstance(r, dict) and "perplexity" in r:
                    print(f"ppl_length: {length:>6} tokens | loss {r['loss']:.4f} | perplexity {r['perplexity']:.2f}")
        elif task == "attention_stats":
            results[task] = task_attention_stats(model, corpus, batch_size=8, device=device)
            print("attention_stats: " + ", ".join(f"{k} {v:.4f}" for k, v in results[task].items() if k != "sequences"))
        elif task == "ppl":
            results["ppl"] = task_ppl(model, corpus, limit=args.limit, device=device)
            print(f"ppl: validation loss {results['ppl']['loss']:.4f} | perplexity {results['ppl']['perplexity']:.2f} over {results['ppl']['tokens']:,} tokens")
        elif task == "sample":
            results["sample"] = task_sample(model, tokenizer, prompt=args.prompt, max_new_tokens=args.max_new_tokens, seed=args.seed, device=device)
            print(f"sample:\n{args.prompt}{results['sample']['text']}")
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(results, indent=2) + "\n")
    os.replace(tmp, out)
    print(f"results written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
