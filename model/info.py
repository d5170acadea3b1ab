"""``python -m model.info --preset NAME [--set key=value ...] [--json]``

Parameters (total and non-embedding, counted on the meta device), training FLOPs
per token at the configured length (attention included), and a training memory
estimate for one unsharded replica.
"""

from __future__ import annotations

import argparse
import json
import sys

from core import configlib
from core.configlib import apply_override
from core.errors import ConfigError, cli_errors
from model.config import model_config_from_dict
from model.counts import count_parameters, flops_per_token, memory_estimate


def model_info(preset: str, overrides: list[str], *, seq_len: int = 0, micro_batch: int = 1) -> dict:
    table: dict = {"preset": preset} if preset else {}
    for assignment in overrides:
        key = assignment.split("=", 1)[0]
        # accept both "n_layers=2" and "model.n_layers=2"
        apply_override(table, assignment[len("model.") :] if key.startswith("model.") else assignment)
    cfg = model_config_from_dict(table)
    cfg.validate()
    seq_len = seq_len or cfg.max_seq_len
    counts = count_parameters(cfg)
    flops = flops_per_token(cfg, seq_len)
    return {
        "preset": cfg.preset,
        "family": cfg.family,
        "attention": cfg.attention.kind,
        **counts,
        "seq_len": seq_len,
        **flops,
        "memory": memory_estimate(cfg, seq_len=seq_len, micro_batch=micro_batch),
        "config": {
            k: getattr(cfg, k)
            for k in (
                "vocab_size",
                "max_seq_len",
                "d_model",
                "n_layers",
                "n_heads",
                "n_kv_heads",
                "ffn_dim",
                "tie_embeddings",
            )
        },
    }


@cli_errors
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m model.info", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--preset", default="", help="preset name (tiny, gpt2-124m, ..., llama-7b)")
    configlib.add_set_argument(p, "model field override, e.g. --set n_layers=2")
    p.add_argument("--seq-len", type=int, default=0, help="context length for FLOPs and memory (default: max_seq_len)")
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per forward for the memory estimate")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    try:
        info = model_info(args.preset, args.overrides, seq_len=args.seq_len, micro_batch=args.micro_batch)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(info))
        return 0
    mem = info["memory"]
    print(f"preset                  {info['preset'] or '(custom)'} ({info['family']}, attention={info['attention']})")
    print(f"parameters              {info['parameters']:,}")
    print(f"non-embedding params    {info['non_embedding_parameters']:,}")
    print(
        f"train FLOPs / token     {info['flops_per_token']:.4g} (attention {info['attention_flops_per_token']:.3g} at "
        f"seq_len {info['seq_len']})"
    )
    print(
        f"train memory estimate   {mem['total_gib']:.2f} GiB (weights {mem['weights_gib']:.2f} + grads "
        f"{mem['grads_gib']:.2f} + "
        f"AdamW {mem['optimizer_gib']:.2f} + activations {mem['activations_gib']:.2f} at micro-batch "
        f"{mem['micro_batch']})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
