"""``python -m bench.attention`` end to end at a small size: every table it promises, as JSON."""

from __future__ import annotations

import json

import torch

from bench.attention import main, make


def test_bench_attention_small_run_writes_forward_and_interleaved_decode_rows(tmp_path, capsys):
    out = tmp_path / "bench.json"
    main(
        ["--lengths", "256", "--contexts", "300", "--cases", "focus hard k=1 (K=8", "--steps", "3", "--repeat", "2"]
        + ["--json", str(out)]
    )
    report = json.loads(out.read_text())
    assert {r["case"] for r in report["forward"]} == {"full (SDPA)", "focus hard k=1 (K=8, w=128)"}
    for row in report["forward"]:
        assert row["fwd_s"] > 0 and row["fwd_bwd_s"] > 0 and row["fwd_peak_bytes"] is not None
    decode = {r["case"]: r for r in report["decode"]}
    assert set(decode) == {"full (SDPA)", "focus hard k=1 (K=8, w=128)"}
    assert decode["full (SDPA)"]["time_ratio"] == 1.0
    focus = decode["focus hard k=1 (K=8, w=128)"]
    assert focus["ms_per_token"] > 0 and focus["cache_bytes"] > decode["full (SDPA)"]["cache_bytes"]
    printed = capsys.readouterr().out
    assert "median of 2 rounds x 3 tokens" in printed and "| focus hard k=1 (K=8, w=128) | 300 |" in printed


def test_every_measurement_builds_a_case_with_the_same_weights():
    """The timing runs, the memory child and the decode runs each build their own module: the same weights (Focus's
    groups, and so its cost and memory, follow its random centroids)."""
    first, second = (make("focus", dict(n_groups=8, top_k=1, mode="hard"), 64, "cpu", torch.float32) for _ in range(2))
    torch.rand(7)  # the global generator moves between builds
    third = make("focus", dict(n_groups=8, top_k=1, mode="hard"), 64, "cpu", torch.float32)
    for module in (second, third):
        for (name, a), b in zip(first.state_dict().items(), module.state_dict().values()):
            assert a.equal(b), name
