"""Attention statistics of a checkpoint on given text, per layer: what each variant reports
(sink ratio and density from the dense weights, Lazy's, Focal's, Focus's group balance ...) and,
for Focus, the composition of each group: its share of the tokens and the tokens it holds most
often (the paper's table 23).

Every layer runs its dense reference path, so variants are measured the same way.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from data.tokenizer import Tokenizer
    from model.transformer import Transformer


@contextlib.contextmanager
def _reference_with_stats(model: Transformer) -> Iterator[None]:
    cores = [block.attn.core for block in model.blocks]
    saved = [core.impl for core in cores]
    for core in cores:
        core.impl = "reference"
    model.set_collect_stats(True)
    try:
        yield
    finally:
        model.set_collect_stats(False)
        for core, impl in zip(cores, saved):
            core.impl = impl


@torch.no_grad()
def layer_statistics(model: Transformer, batches: list[Tensor], *, device: torch.device | str) -> dict:
    """{"mean": {name: value}, "layers": [{name: value} per layer]}, averaged over ``batches`` ([B, T])."""
    kind = model.cfg.attention.kind
    per_layer: list[dict[str, float]] = [{} for _ in model.blocks]
    model.eval()
    with _reference_with_stats(model):
        for batch in batches:
            out = model(batch.to(device), return_logits=False)
            for i, stats in enumerate(out.layer_stats):
                for key, value in stats.items():
                    per_layer[i][key] = per_layer[i].get(key, 0.0) + float(value) / len(batches)
    layers = [{f"attn/{kind}/{k}": v for k, v in d.items()} for d in per_layer]
    names = sorted({k for d in layers for k in d})
    mean = {k: sum(d.get(k, 0.0) for d in layers) / len(layers) for k in names}
    return {"mean": mean, "layers": layers}


@torch.no_grad()
def focus_composition(
    model: Transformer, batches: list[Tensor], tokenizer: Tokenizer, *, device: torch.device | str, top: int = 10
) -> list[dict]:
    """Per Focus layer: each group's share of the tokens (argmax assignment) and its most frequent tokens."""
    captured: dict[int, list[Tensor]] = {}
    hooks = []
    for i, block in enumerate(model.blocks):
        core = block.attn.core
        if not hasattr(core, "assignments"):
            continue

        def grab(module: nn.Module, args: tuple, kwargs: dict, i: int = i, core: Any = core) -> None:
            hidden = args[0]  # the normed block input the attention projects
            g, _ = core.assignments(hidden, None)
            captured.setdefault(i, []).append(g.argmax(-1).cpu())

        hooks.append(block.attn.register_forward_pre_hook(grab, with_kwargs=True))
    model.eval()
    tokens = []
    try:
        for batch in batches:
            model(batch.to(device), return_logits=False)
            tokens.append(batch.cpu())
    finally:
        for hook in hooks:
            hook.remove()
    if not captured:
        return []
    ids = torch.cat([t.flatten() for t in tokens])
    out = []
    for layer, parts in sorted(captured.items()):
        groups = torch.cat([p.flatten() for p in parts])
        n_groups = model.blocks[layer].attn.core.cfg.n_groups
        entries = []
        for g in range(n_groups):
            members = ids[groups == g].tolist()
            common = Counter(members).most_common(top)
            entries.append(
                {
                    "group": g,
                    "share": len(members) / len(ids),
                    "top_tokens": [[tokenizer.decode([t]), n] for t, n in common],
                }
            )
        out.append({"layer": layer, "groups": entries})
    return out
