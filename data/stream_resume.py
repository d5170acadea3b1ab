"""Stream checkpoints: finding the per-worker states in a loader state, checking they fit this run, counting
tokens per source, and re-deriving positions when ranks x loader workers changed (local sources only)."""

from __future__ import annotations

from collections.abc import Sequence

from core.errors import ConfigError
from data.mixture import STATE_FORMAT, StreamSet, fresh_state, keep_legacy, pending, weighting_of
from data.source_stream import UNSHUFFLED_WINDOW
from data.stream_sources import LOCAL


def find_states(obj: object) -> list[dict]:
    """Our per-worker states anywhere inside a loader state (or a list of them), in worker order."""
    found: list[dict] = []

    def walk(x: object) -> None:
        if isinstance(x, dict):
            if x.get("format") == STATE_FORMAT:
                found.append(x)
                return
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    walk(obj)
    return sorted(found, key=lambda s: s["worker"])


def token_counts(loader_state: object, source_names: Sequence[str] | None = None) -> dict[str, int]:
    """Target tokens per source summed over the worker states in ``loader_state`` (one rank's, or all ranks')."""
    states = find_states(loader_state)
    names = list(source_names or (states[0]["sources"] if states else []))
    totals = dict.fromkeys(names, 0)
    for s in states:
        for name, n in zip(s["sources"], s["tokens"]):
            totals[name] = totals.get(name, 0) + int(n)
    return totals


def check_same_run(state: dict, *, sources: list[str], seed: int, window: int, weighting: str) -> None:
    """One-line errors for a worker state another stream wrote."""
    if state["sources"] != sources:
        key = "data.mixture" if len(sources) > 1 else "data.source"
        raise ConfigError(
            f"{key}: the checkpoint streamed {', '.join(state['sources'])}, this run {', '.join(sources)}"
        )
    if state["seed"] != seed or state["window"] != window:
        raise ConfigError(
            f"data.seed: the checkpoint's stream used seed {state['seed']} and shuffle window {state['window']}, "
            f"this run {seed} and {window}"
        )
    if "weighting" in state and state["weighting"] != weighting:  # states from before weightings resume as written
        raise ConfigError(
            f"data.mixture_weighting: the checkpoint's mixture weighted {state['weighting']}, this run {weighting}; "
            f"set data.mixture_weighting = {state['weighting']!r} to resume it"
        )


def check_resume_states(states: list[dict]) -> None:
    if not states:
        raise ConfigError("data: resume_from holds no streaming loader state")
    G_old = states[0]["workers"]
    if [s["worker"] for s in states] != list(range(G_old)):
        raise ConfigError(
            f"data: resume_from holds the states of loader workers {[s['worker'] for s in states]} of {G_old}; "
            "pass every rank's loader state"
        )


def derive_state(ds: StreamSet, old: list[dict], g: int, G: int) -> dict:
    """Worker g of G's start from every worker state ``old`` of a run with another worker count."""
    G_old = old[0]["workers"]
    if G_old == G:  # same global worker count (e.g. 2 ranks x 2 workers -> 4 x 1): positions carry over exactly
        return old[g]
    for spec in ds.specs:
        if spec.kind != LOCAL:
            raise ConfigError(
                f"data: source {spec.name!r} streams from the hub, whose position cannot be re-derived on another "
                f"world size; resume with ranks x loader workers = {G_old}"
            )
    if any(s["rule"] is not None for st in old for s in st["streams"]):
        raise ConfigError(
            "data: the world size changed again before the epoch of the previous change ended; resume with ranks "
            f"x loader workers = {G_old}"
        )
    n = len(ds.specs)
    state = fresh_state(weighting_of(old[0]), g=g, G=G, seed=ds.seed, window=ds.window, sources=ds.source_names)
    keep_legacy(state, old[0])
    state["generation"] = max(s["generation"] for s in old) + 1
    state["streams"] = [_residual(ds.window, src, old) for src in range(n)]
    if g == 0:  # the run's counts live on, once
        state["tokens"] = [sum(s["tokens"][i] for s in old) for i in range(n)]
    return state


def _residual(window_size: int, src: int, old: list[dict]) -> dict:
    """Source ``src``'s start after a world-size change: old worker h consumed the positions = h (mod G_old)
    below its limit in its epoch, all in earlier ones (a half-packed document counts as consumed)."""
    entries = []  # (epoch, limit, cursor of a window start at or before the limit, that window)
    for st in old:
        s = st["streams"][src]
        entry = (s["epoch"], s["next"], s["cursor"], s["window"])
        half = pending(st, src)
        if half is not None:
            pos, doc_epoch = half
            entry = (s["epoch"], pos + 1, s["cursor"], s["window"])
            if doc_epoch != s["epoch"]:  # taking that document crossed into the next epoch
                entry = (doc_epoch, pos + 1, [0, None, 0, 0], 0)
        entries.append(entry)
    first, last = min(e[0] for e in entries), max(e[0] for e in entries)
    limits = [
        [None if e > epoch else (limit if e == epoch else 0) for e, limit, _, _ in entries]
        for epoch in range(first, last + 1)
    ]
    _, _, cursor, window = min((e for e in entries if e[0] == first), key=lambda e: e[1])
    W = window_size or UNSHUFFLED_WINDOW
    rule = {"workers": len(old), "first": first, "limits": limits}
    # every position before the earliest limit is consumed, so counting resumes from that worker's window
    return {"epoch": first, "cursor": cursor, "window": window, "next": window * W, "rho": 0, "rule": rule}
