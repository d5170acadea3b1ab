"""``python -m bench.reproduce`` (the papers' claims at tiny scale) stays runnable, its verdict rule says what
docs/reproduce.md says it does, and each tier's arms and claims carry that tier's lengths (the default and
``--quick`` tiers exactly as docs/reproduce.md was measured, ``--context`` at 512 tokens)."""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from bench.reproduce import BUDGETS, DEFAULT_OUTS, GROUPS, common_overrides, plan
from bench.reproduce_arms import arm_overrides, arms, local_window_registered
from bench.reproduce_claims import (
    FAILS,
    HOLDS,
    UNSURE,
    dga_claims,
    focus_claims,
    lazy_claims,
    prescored_claims,
    verdict,
)
from tests.conftest import REPO

# every arm's own overrides in the default and --quick tiers, as docs/reproduce.md was measured with them
TODAY = {
    "full": ["model.attention.kind=full"],
    "local_window": ["model.attention.kind=local_window", "model.attention.local_window.window=32"],
    **{
        label: [
            "model.attention.kind=focus",
            f"model.attention.focus.n_groups={k}",
            f"model.attention.focus.window={w}",
            f"model.attention.focus.assignment={assignment}",
        ]
        for label, k, w, assignment in (
            ("focus", 8, 32, "sinkhorn"),
            ("focus_softmax", 8, 32, "softmax"),
            ("focus_k2", 2, 32, "sinkhorn"),
            ("focus_k4", 4, 32, "sinkhorn"),
            ("focus_w16", 8, 16, "sinkhorn"),
            ("focus_w64", 8, 64, "sinkhorn"),
        )
    },
    "lazy": ["model.attention.kind=lazy"],
    "focal_t0.4": ["model.attention.kind=focal", "model.attention.focal.mode=constant", "model.attention.focal.t=0.4"],
    "focal_learned": ["model.attention.kind=focal", "model.attention.focal.mode=learned"],
    **{
        label: [
            "model.attention.kind=dga",
            f"model.attention.dga.gamma={gamma}",
            "model.attention.dga.chunk_size=32",
            "model.attention.dga.group_size=8",
        ]
        for label, gamma in (("dga", 0.1), ("dga_g0.5", 0.5))
    },
}


def test_verdict_compares_the_gap_with_the_seed_spread():
    assert verdict([1.0, 1.1], [2.0, 2.1])[0] == HOLDS  # claimed lower, lower by more than the spread
    assert verdict([2.0, 2.1], [1.0, 1.1])[0] == FAILS  # the other way round
    assert verdict([1.0, 1.5], [1.2, 1.3])[0] == UNSURE  # the gap (0) is inside the spread
    assert verdict([1.0], [2.0])[0] == UNSURE  # one seed: no spread to compare with
    assert verdict([1.0, 1.0], [1.0004, 1.0004], resolution=0.001)[0] == UNSURE  # below the last digit shown


def test_missing_data_is_one_line_naming_the_option(tmp_path, capsys):
    from bench.reproduce import main

    code = main(["--quick", "--data", str(tmp_path / "absent"), "--out", str(tmp_path / "r.md")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("error: --data:") and "\n" not in err
    assert not (tmp_path / "r.md").exists()


def _own(label: str, budget: dict) -> list[str]:
    """Arm ``label``'s overrides without the common ones, the run directory and the seed."""
    return arm_overrides(label, budget, [], Path("run"), 0)[:-2]


@pytest.mark.parametrize("tier", ["full", "quick"])
def test_the_default_and_quick_tiers_train_the_arms_they_were_measured_with(tier):
    budget = BUDGETS[tier]
    assert {label: _own(label, budget) for label in arms(budget)} == TODAY
    assert sorted({job["label"] for job in plan(list(GROUPS), budget)}) == sorted(TODAY)
    common = common_overrides(budget, Path("data"), "")
    assert {"model.max_seq_len=128", "data.seq_len=128", "train.batch_size=8", "train.lr=0.003"} <= set(common)


def test_the_context_tier_trains_every_arm_at_the_papers_lengths():
    budget = BUDGETS["context"]
    jobs = plan(list(GROUPS), budget)
    own = {job["label"]: _own(job["label"], budget) for job in jobs}
    assert sorted(own) == sorted(TODAY.keys() - {"focus_w16", "focus_w64"} | {"focus_w64", "focus_w256"})
    assert sorted(job["seed"] for job in jobs if job["label"] == "focus") == [0, 1]  # two seeds: a spread
    windows = {label: o for label, opts in own.items() for o in opts if o.startswith("model.attention.focus.window=")}
    assert windows == {
        **dict.fromkeys(("focus", "focus_softmax", "focus_k2", "focus_k4"), "model.attention.focus.window=128"),
        "focus_w64": "model.attention.focus.window=64",
        "focus_w256": "model.attention.focus.window=256",
    }
    assert "model.attention.local_window.window=128" in own["local_window"]
    for label in ("dga", "dga_g0.5"):
        assert {"model.attention.dga.chunk_size=128", "model.attention.dga.group_size=16"} <= set(own[label])
    common = common_overrides(budget, Path("data"), "")
    assert {"model.max_seq_len=512", "data.seq_len=512"} <= set(common)
    tokens = budget["steps"] * budget["batch_size"] * budget["seq_len"]
    assert tokens >= 409_600  # at least the default tier's token budget per arm
    assert [budget["seq_len"] * m for m in budget["length_multiples"]] == [512, 1024, 2048]
    assert DEFAULT_OUTS["context"] == REPO / "docs" / "reproduce_context.md"


def test_every_context_arm_is_a_valid_run_config(tmp_path):
    from run.config import load_run_config

    budget = BUDGETS["context"]
    (tmp_path / "a.txt").write_text("text")
    common = common_overrides(budget, tmp_path, "")
    with local_window_registered():
        for label in arms(budget):
            cfg = load_run_config(None, arm_overrides(label, budget, common, tmp_path / label, 0))
            assert cfg.data.seq_len == 512, label


def test_quick_never_writes_over_a_committed_report():
    """--quick is a smoke run: its default report is under runs/ (ignored by git); the default and --context tiers
    write the committed reports they were measured for."""
    assert DEFAULT_OUTS["quick"].is_relative_to(REPO / "runs")
    assert DEFAULT_OUTS["full"] == REPO / "docs" / "reproduce.md"
    assert DEFAULT_OUTS["quick"] not in (DEFAULT_OUTS["full"], DEFAULT_OUTS["context"])


def test_the_local_window_baseline_is_registered_only_while_an_arm_runs():
    """The bench's baseline must not leak into the product's registry: every registry-parametrised test and
    every saved config (``model.attention.<variant>`` keys) would otherwise change in a process that imported
    the bench (a suite worker did, and a run's config then named a key no other process knew)."""
    from model.attention import registry

    assert "local_window" not in registry
    with local_window_registered():
        assert "local_window" in registry
    assert "local_window" not in registry


def test_claims_name_the_tiers_windows_chunks_and_lengths():
    context, full = BUDGETS["context"], BUDGETS["full"]
    texts = " | ".join(
        f"{c.text} {c.lower[1]} {c.higher[1]}"
        for claims in (focus_claims, lazy_claims, dga_claims, prescored_claims)
        for c in claims(context)
    )
    assert "w = 64 below w = 256 (validation loss; w = 128 in the details)" in texts
    assert "local w=128" in texts and "(gamma = 0.1, m = 16)" in texts
    assert "from 1x to 4x the training length (512 tokens;" in texts and "(top_k = 256 of 512 keys)" in texts
    for stale in ("w = 16", "w=16", "w = 32", "w=32", "m = 8", "128 tokens", "of 128 keys"):
        assert stale not in texts, stale
    window = next(c for c in focus_claims(context) if c.text.startswith("Smaller windows"))
    assert window.paper == "appendix C (K=2, centroid-only): w=64 34.1, w=256 35.3, w=512 37.5 PPL"
    assert window.lower[0] == "focus_w64" and window.higher[0] == "focus_w256"
    default = next(c for c in focus_claims(full) if c.text.startswith("Smaller windows"))
    assert default.text == "Smaller windows are better: w = 16 below w = 64 (validation loss; w = 32 in the details)"


def test_the_committed_report_renders_again_from_its_results(monkeypatch, tmp_path):
    """docs/reproduce.md is what today's report code writes from docs/reproduce/results.json (the tiers' refactor
    changed no byte of the default tier's report)."""
    import re

    from bench import reproduce_report

    text = (REPO / "docs" / "reproduce.md").read_text()
    payload = json.loads((REPO / "docs" / "reproduce" / "results.json").read_text())
    measured = payload["budget"]
    assert {k: BUDGETS["full"][k] for k in measured if k in BUDGETS["full"]} == measured  # the budget it ran with
    made = dict(re.findall(r"^!\[(.+)\]\(reproduce/(.+)\)$", text, flags=re.M))
    monkeypatch.setattr(reproduce_report, "plots", lambda *args: made)
    out = tmp_path / "reproduce.md"
    reproduce_report.write_report(out, payload["meta"], BUDGETS["full"], payload["meta"]["groups"], payload["results"])
    assert out.read_text() == text


def test_the_context_report_names_its_tier_and_counts_the_verdicts(tmp_path, monkeypatch):
    from bench import reproduce_report

    monkeypatch.setattr(reproduce_report, "plots", lambda *args: {})
    budget = BUDGETS["context"]
    meta = {
        "date": "today", "command": "python -m bench.reproduce --context", "device": "cpu", "wall_seconds": 60.0,
        "cpu_seconds": 120.0, "code_version": "x", "groups": list(GROUPS), "jobs": 2,
        "load_average_start": [0.0, 0.0, 0.0], "load_average_end": [2.0, 2.0, 2.0],
        "data": {"path": "d", "files": ["a.txt"], "bytes": 1, "train_tokens": 1, "val_tokens": 1},
    }  # fmt: skip
    out = tmp_path / "reproduce_context.md"
    reproduce_report.write_report(out, meta, budget, list(GROUPS), {})
    text = out.read_text()
    assert "- Tier: the context tier (`--context`): trained at 512 tokens" in text
    assert "Command: `python -m bench.reproduce --context`" in text
    assert (
        "- Summary: 0 hold, 0 do not hold, 0 inconclusive at this scale, 22 not measured (an arm failed), of 22" in text
    )
    assert (tmp_path / "reproduce_context" / "results.json").exists()


def test_context_with_quick_is_one_line_error(tmp_path, capsys):
    from bench.reproduce import main

    code = main(["--context", "--quick", "--out", str(tmp_path / "r.md")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("error: --context:") and "--quick" in err and "\n" not in err
    assert not (tmp_path / "r.md").exists()


@pytest.mark.slow
def test_quick_prescored_hyper_claims_run_end_to_end(tmp_path):
    """The command in its --quick --only form, on eight of the embedded plays (no ../shared needed)."""
    data = tmp_path / "plays"
    data.mkdir()
    with tarfile.open(REPO / "data" / "embedded" / "shakespeare_plays.tar.xz") as tar:
        members = sorted((m for m in tar.getmembers() if m.isfile() and m.name.endswith(".txt")), key=lambda m: m.name)
        for member in members[:8]:
            (data / Path(member.name).name).write_bytes(tar.extractfile(member).read())
    out = tmp_path / "reproduce.md"
    cmd = [sys.executable, "-m", "bench.reproduce", "--quick", "--only", "prescored_hyper", "--data", str(data)]
    cmd += ["--out", str(out), "--cache-dir", str(tmp_path / "cache")]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = out.read_text()
    assert "| paper | claim | paper's figure (source) | our figure | verdict | seeds |" in text
    assert "Command: `python -m bench.reproduce --quick --only prescored_hyper" in text
    payload = json.loads((tmp_path / "reproduce" / "results.json").read_text())
    claims = payload["claims"]
    assert len(claims) == 4 and all(c["group"] == "Pre-scored HyperAttention" for c in claims)
    assert {c["verdict"] for c in claims} <= {HOLDS, FAILS, UNSURE}
    assert all(c["seeds"] == 2 for c in claims)
    assert (tmp_path / "reproduce" / "prescored.png").stat().st_size > 0
