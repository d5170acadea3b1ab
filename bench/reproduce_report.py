"""The report of ``python -m bench.reproduce``: markdown table, details, JSON and plots."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.reproduce_arms import arms
from bench.reproduce_claims import GROUPS, mean, spread
from core.files import atomic_write_text

if TYPE_CHECKING:
    from matplotlib.figure import Figure

Results = dict[str, list[dict]]


def _ok(results: Results, label: str) -> list[dict]:
    runs = results.get(label) or []
    return [] if any("error" in r for r in runs) else runs


def _m(values: list[float], spec: str = ".3f") -> str:
    if not values:
        return "-"
    return format(mean(values), spec) + ("" if len(values) < 2 else f" ± {format(spread(values) / 2, spec)}")


# ---- plots --------------------------------------------------------------------------------
def plots(folder: Path, results: Results, budget: dict, groups: list[str]) -> dict[str, str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made: dict[str, str] = {}

    def save(fig: Figure, name: str, title: str) -> None:
        fig.tight_layout()
        fig.savefig(folder / name, dpi=110)
        plt.close(fig)
        made[title] = name

    fig, ax = plt.subplots(figsize=(7, 3.6))
    labels = [label for label in arms(budget) if _ok(results, label)]
    for i, label in enumerate(labels):
        values = [r["val_loss"] for r in _ok(results, label)]
        ax.bar(i, mean(values), color="#8fb3d9")
        ax.scatter([i] * len(values), values, color="black", s=10, zorder=3)
    ax.set_xticks(range(len(labels)), labels, rotation=45, ha="right")
    if labels:
        lows = [r["val_loss"] for label in labels for r in _ok(results, label)]
        ax.set_ylim(min(lows) - 0.1, max(lows) + 0.1)
    ax.set_ylabel("validation loss (nats)")
    ax.set_title("Validation loss per arm (bars: mean; dots: seeds)")
    save(fig, "val_loss.png", "Validation loss per arm")

    if "focus" in groups and (_ok(results, "focus") or _ok(results, "focus_softmax")):
        fig, ax = plt.subplots(figsize=(6, 3.6))
        for label, color in (("focus_softmax", "tab:red"), ("focus", "tab:blue")):
            for r in _ok(results, label):
                rows = r.get("groups") or []
                ax.plot(
                    [x["step"] for x in rows],
                    [100 * x["max_group_share"] for x in rows],
                    color=color,
                    alpha=0.8,
                    label=f"{'softmax' if label.endswith('softmax') else 'Sinkhorn'} seed {r['seed']}",
                )
        ax.axhline(100 / 8, color="gray", ls="--", lw=1, label="uniform (K = 8)")
        ax.set_xlabel("training step")
        ax.set_ylabel("largest group's share of tokens (%)")
        ax.legend(fontsize=7)
        ax.set_title("Focus group dominance (tables 19 / 21)")
        save(fig, "focus_groups.png", "Focus group dominance over training")

    runs = _ok(results, "focus_k4")
    if "focus" in groups and runs and all("topk" in r for r in runs):
        ks = sorted(runs[0]["topk"], key=int)
        fig, ax = plt.subplots(figsize=(5, 3.4))
        ax.plot(
            [int(k) for k in ks], [mean([r["topk"][k]["loss"] for r in runs]) for k in ks], "o-", label="hard top-k"
        )
        ax.axhline(mean([r["val_loss"] for r in runs]), color="tab:green", ls="--", label="soft gating")
        ax.set_xlabel("k (groups per token, K = 4)")
        ax.set_ylabel("validation loss")
        ax.legend(fontsize=8)
        ax.set_title("Focus top-k inference (table 3, E.4.8)")
        save(fig, "focus_topk.png", "Focus top-k sweep")

    if "lazy" in groups and _ok(results, "full") and _ok(results, "lazy"):
        fig, ax = plt.subplots(figsize=(5, 3.4))
        for label in ("full", "lazy"):
            rs = [r for r in _ok(results, label) if "length" in r]
            if not rs:
                continue
            lengths = sorted((k for k in rs[0]["length"] if "loss" in rs[0]["length"][k]), key=int)
            ys = [mean([r["length"][k]["loss"] for r in rs]) for k in lengths]
            ax.plot([int(k) for k in lengths], ys, "o-", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel(f"evaluation length (trained at {budget['seq_len']})")
        ax.set_ylabel("validation loss")
        ax.legend(fontsize=8)
        ax.set_title("Loss against length (Lazy figure 6)")
        save(fig, "lazy_length.png", "Lazy: loss against evaluation length")

    rs = [r for r in _ok(results, "full") if "prescored" in r]
    if "prescored_hyper" in groups and rs:
        fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
        for key, ax in zip(("loss", "error"), axes):
            for scoring in budget["prescored"]["scorings"]:
                ks = budget["prescored"]["top_k"]
                ys = [mean([_pick(r, scoring, k)[key] for r in rs]) for k in ks]
                ax.plot(ks, ys, "o-", label=scoring)
            ax.axhline(mean([_pick(r, "plain", 0)[key] for r in rs]), color="gray", ls="--", label="plain Hyper")
            if key == "loss":
                ax.axhline(mean([r["prescored"]["exact_loss"] for r in rs]), color="black", ls=":", label="exact")
            ax.set_xlabel(f"kept keys (top_k of {budget['seq_len']})")
            ax.set_ylabel("validation loss" if key == "loss" else "relative output error")
            ax.legend(fontsize=7)
        fig.suptitle("Pre-scored HyperAttention at inference on the full-attention model")
        save(fig, "prescored.png", "Pre-scored HyperAttention sweep")
    return made


def _pick(r: dict, scoring: str, top_k: int) -> dict:
    return next(x for x in r["prescored"]["rows"] if x["scoring"] == scoring and x["top_k"] == top_k)


# ---- markdown -----------------------------------------------------------------------------
def _details(results: Results, budget: dict, groups: list[str]) -> list[str]:
    lines = ["## Details", "", "### Validation loss of every arm", ""]
    lines += ["| arm | what | seeds | validation loss | per seed | train s / seed |", "|---|---|---:|---:|---|---:|"]
    for label, (_, what, _) in arms(budget).items():
        runs = results.get(label)
        if not runs:
            continue
        if any("error" in r for r in runs):
            errors = "; ".join(r["error"] for r in runs if "error" in r)
            lines.append(f"| {label} | {what} | {len(runs)} | failed | {errors[:200]} | - |")
            continue
        values = [r["val_loss"] for r in runs]
        per = ", ".join(f"{v:.4f}" for v in values)
        secs = mean([r["train_seconds"] for r in runs])
        lines.append(f"| {label} | {what} | {len(runs)} | {_m(values, '.4f')} | {per} | {secs:.0f} |")
    runs = _ok(results, "focus_k4")
    if "focus" in groups and runs and all("topk" in r for r in runs):
        lines += ["", "### Focus, K = 4: hard top-k inference of the soft-trained model", ""]
        lines += ["| inference | validation loss | pairs kept |", "|---|---:|---:|"]
        lines.append(f"| soft gating | {_m([r['val_loss'] for r in runs])} | 100% (all pairs, gated) |")
        for k in sorted(runs[0]["topk"], key=int):
            kept = [r["topk"][k]["pairs_kept"] for r in runs if r["topk"][k].get("pairs_kept") is not None]
            share = f"{100 * mean(kept):.0f}%" if kept else "-"
            lines.append(f"| hard k = {k} | {_m([r['topk'][k]['loss'] for r in runs])} | {share} |")
    for label in ("focus", "focus_softmax"):  # the arms that log group statistics
        runs = _ok(results, label)
        if "focus" in groups and runs and all(r.get("groups") for r in runs):
            if label == "focus":
                lines += ["", "### Focus group statistics at the last logged step (mean over seeds)", ""]
                lines += ["| arm | largest group | confidence | imbalance |", "|---|---:|---:|---:|"]
            last = [r["groups"][-1] for r in runs]
            lines.append(
                f"| {label} | {_m([100 * x['max_group_share'] for x in last], '.1f')}% | "
                f"{_m([x.get('confidence', float('nan')) for x in last], '.2f')} | "
                f"{_m([x.get('imbalance', float('nan')) for x in last], '.2f')} |"
            )
    if "lazy" in groups:
        rows = []
        for label in ("full", "lazy"):
            rs = [r for r in _ok(results, label) if "attn_stats" in r and "length" in r]
            if rs:
                lengths = sorted((k for k in rs[0]["length"] if "loss" in rs[0]["length"][k]), key=int)
                cells = " | ".join(_m([r["length"][k]["loss"] for r in rs]) for k in lengths)
                sink = _m([100 * r["attn_stats"]["sink_ratio"] for r in rs], ".2f")
                density = _m([100 * r["attn_stats"]["density"] for r in rs], ".2f")
                rows.append((lengths, f"| {label} | {sink} | {density} | {cells} |"))
        if rows:
            lengths = rows[0][0]
            lines += ["", "### Lazy against full attention", ""]
            lines += ["| arm | sink % | density % | " + " | ".join(f"loss at {k}" for k in lengths) + " |"]
            lines += ["|---|---:|---:|" + "---:|" * len(lengths)] + [r[1] for r in rows]
    if "dga" in groups and _ok(results, "full") and _ok(results, "dga"):
        full, dga = _ok(results, "full")[0].get("kv_cache"), _ok(results, "dga")[0].get("kv_cache")
        if full and dga:
            lines += ["", "### KV cache bytes, all layers, batch 1 (after prefill of L tokens + 1 decoded)", ""]
            lines += ["| L | full KiB | DGA KiB | DGA / full |", "|---:|---:|---:|---:|"]
            for length in sorted(full, key=int):
                if "bytes" in full[length] and "bytes" in dga.get(length, {}):
                    f, d = full[length]["bytes"], dga[length]["bytes"]
                    lines.append(f"| {length} | {f / 1024:.0f} | {d / 1024:.0f} | {d / f:.3f} |")
    rs = [r for r in _ok(results, "full") if "prescored" in r]
    if "prescored_hyper" in groups and rs:
        lines += ["", "### Pre-scored HyperAttention swapped in at inference (full-attention model)", ""]
        lines += [f"Exact attention on the same windows: loss {_m([r['prescored']['exact_loss'] for r in rs])}.", ""]
        lines += ["| scoring | top_k | validation loss | relative output error |", "|---|---:|---:|---:|"]
        configs = [("plain", 0)] + [
            (s, k) for s in budget["prescored"]["scorings"] for k in budget["prescored"]["top_k"]
        ]
        for scoring, k in configs:
            loss = _m([_pick(r, scoring, k)["loss"] for r in rs])
            err = _m([_pick(r, scoring, k)["error"] for r in rs])
            lines.append(f"| {scoring} | {k if k else '- (all keys)'} | {loss} | {err} |")
    return lines


TARGET_MINUTES = {"full": 30, "quick": 8, "context": 60}  # each mode's wall-time budget on 2 cores (issues 19, 26)


def _over_target(meta: dict, budget: dict) -> list[str]:
    target = TARGET_MINUTES.get(budget["name"])
    minutes = meta["wall_seconds"] / 60
    if target is None or minutes <= target:
        return []
    return [
        f"- **Over the {target}-minute target for this mode** ({minutes:.1f} min): the 2-core machine was shared "
        f"while it ran (load average {meta['load_average_start'][0]:.1f} at the start, "
        f"{meta['load_average_end'][0]:.1f} at the end, against {meta['jobs']} worker processes)."
    ]


def markdown(meta: dict, budget: dict, rows: list[dict], details: list[str], made: dict[str, str], assets: str) -> str:
    b, d = budget, meta["data"]
    tokens = b["steps"] * b["batch_size"] * b["seq_len"]
    verdicts = ("holds", "does not hold", "inconclusive at this scale", "not measured")
    counts = {v: sum(r["verdict"] == v for r in rows) for v in verdicts}
    lines = [
        "# The papers' claims at tiny scale",
        "",
        "Generated by `python -m bench.reproduce`; every figure below was measured by the command shown.",
        "",
        *([f"- Tier: {b['about']}."] if "about" in b else []),  # the context tier; the default report stays as measured
        f"- Date: {meta['date']}. Code: `{meta['code_version']}`.",
        f"- Command: `{meta['command']}`. Wall time: {meta['wall_seconds'] / 60:.1f} min; CPU time of all its "
        f"processes {meta['cpu_seconds'] / 60:.1f} min (on {meta['jobs']} otherwise idle cores the wall time would be "
        f"about {meta['cpu_seconds'] / 60 / meta['jobs']:.1f} min: an estimate, not a measurement).",
        *_over_target(meta, budget),
        f"- Device: {meta['device']}. Load average (1, 5, 15 min) at the start {meta['load_average_start']}, "
        f"at the end {meta['load_average_end']} (the machine was shared when it was higher than the worker count).",
        f"- Data: {len(d['files'])} files of `{d['path']}` (the first by name, {d['bytes'] / 1e6:.1f} MB: "
        f"{', '.join(d['files'])}); {d['train_tokens']:,} training / {d['val_tokens']:,} validation tokens "
        f"(whole documents held out); SentencePiece BPE, {b['vocab_size']} tokens, trained on the training split.",
        f"- Model (every arm): LLaMA-style, {b['n_layers']} layers, d_model {b['d_model']}, {b['n_heads']} heads, "
        f"d_ff {b['d_ff']}, RoPE theta {b['rope_theta']:.0f}, trained at {b['seq_len']} tokens.",
        f"- Budget (every arm, the same): {b['steps']} steps x {b['batch_size']} x {b['seq_len']} = {tokens:,} tokens, "
        f"AdamW lr {b['lr']} cosine to 10%, warmup {b['warmup_steps']}; seeds {b['seeds']} "
        f"({len(b['seeds'])} per arm). Validation loss: the first {b['val_windows']} held-out windows, the same for "
        "every arm. Full attention is trained once per seed and shared by every claim that compares with it.",
        "- Verdict: a claim compares two measured figures across seeds; **holds** when the gap in the claimed "
        "direction exceeds the seed spread (the larger max - min over seeds of the two), **does not hold** when "
        "the gap in the other direction exceeds it, **inconclusive at this scale** otherwise "
        "(also when the gap is below the last digit shown). `a ± s`: mean over "
        "seeds ± half the max - min. These are tiny models after a few hundred steps: a verdict says what this "
        "scale shows, not whether the paper is right at its scale.",
        f"- Summary: {counts['holds']} hold, {counts['does not hold']} do not hold, "
        f"{counts['inconclusive at this scale']} inconclusive at this scale"
        + (f", {counts['not measured']} not measured (an arm failed)" if counts["not measured"] else "")
        + f", of {len(rows)} claims.",
        "",
        "| paper | claim | paper's figure (source) | our figure | verdict | seeds |",
        "|---|---|---|---|---|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['group']} | {r['claim']} | {r['paper']} | {r['ours']} | **{r['verdict']}** | {r['seeds']} |"
        )
    lines += ["", *details, "", "## Plots", ""]
    for title, name in made.items():
        lines += [f"### {title}", "", f"![{title}]({assets}/{name})", ""]
    lines += [f"Raw results (every seed, every arm): [`{assets}/results.json`]({assets}/results.json)."]
    return "\n".join(lines) + "\n"


def write_report(out: Path, meta: dict, budget: dict, groups: list[str], results: Results) -> None:
    folder = out.parent / out.stem
    folder.mkdir(parents=True, exist_ok=True)
    rows = [r for group in groups for r in GROUPS[group](results, budget)]
    made = plots(folder, results, budget, groups)
    payload: dict[str, Any] = {"meta": meta, "budget": budget, "claims": rows, "results": results}
    atomic_write_text(folder / "results.json", json.dumps(payload, indent=1, default=str) + "\n")
    text = markdown(meta, budget, rows, _details(results, budget, groups), made, out.stem)
    atomic_write_text(out, text)
