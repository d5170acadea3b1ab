"""The layout planner's command (``launch.plan``) and the llama-7b long-context launch configs it picked: each
dry-runs at 64 ranks, renders its SLURM script for 8 nodes x 8 GPUs, and is the planner's own pick, which fits
80 GiB devices. (Its bytes against real runs: tests/e2e/test_plan.py.)"""

from __future__ import annotations

import math

import pytest
import torch

from launch import plan as planner
from launch import submit
from launch.presets import CONFIG_DIR
from model.loss import default_chunk
from pretrain import layout_plan, train
from run.config import load_run_config
from run.parallel import ParallelLayout

LONG = {"llama-7b-32k.toml": 32768, "llama-7b-128k.toml": 131072}


@pytest.mark.parametrize("name", list(LONG))
def test_the_7b_long_context_configs_dry_run_and_render(name, monkeypatch, capsys):
    path = str(CONFIG_DIR / name)
    monkeypatch.setenv("WORLD_SIZE", "64")  # the layout is checked against the world size under --dry-run
    # as on a login node without CUDA: the run is meant for CUDA devices (train.device = auto would train on this
    # host, whose memory is no 80 GiB GPU's; the planner's test below checks the fit on one)
    assert train.main(["--config", path, "--dry-run", "--set", "train.device=cuda"]) == 0
    assert f"seq_len = {LONG[name]}" in capsys.readouterr().out
    assert submit.main(["--config", path, "--nodes", "8", "--gpus-per-node", "8", "--dry-run"]) == 0
    script = capsys.readouterr().out
    assert "#SBATCH --nodes=8" in script and "NPROC_PER_NODE=8" in script and path in script


@pytest.mark.parametrize("name", list(LONG))
def test_the_7b_configs_are_the_planners_pick_and_fit_80gib(name):
    cfg = load_run_config(CONFIG_DIR / name)
    chosen = planner.pick(planner.plan(cfg, 64, 80 << 30))
    assert chosen is not None and chosen.fits
    lay = chosen.layout
    assert (lay.cp, lay.tp, chosen.ac) == (
        cfg.train.parallel.cp,
        cfg.train.parallel.tp,
        cfg.train.activation_checkpointing,
    )
    assert lay.world == 64 and chosen.micro * lay.dp == cfg.train.batch_size  # no accumulation
    assert planner.breakdown(chosen) in (CONFIG_DIR / name).read_text()  # the file says why it fits


def test_sharded_bytes_follow_torch_chunk_and_fsdp_padding():
    """A [5, 3] float32 parameter split on dim 1 by tp=3 (1 column each), then over 2 FSDP ranks: each stores 3
    padded rows, the optimizer holds rank 0's 3 and rank 1's 2 rows (torch.chunk), plus a float32 step."""
    table = (planner.ParamInfo("w", (5, 3), 4, True, 1),)
    rows = [len(c) for c in torch.chunk(torch.zeros(5), 2)]
    for rank in (0, 1):
        s = planner.table_state_bytes(table, ParallelLayout(1, 2, 1, 3), 0, rank)
        assert s.parameters == s.gradients == math.ceil(5 / 2) * 1 * 4
        assert s.optimizer == 2 * rows[rank] * 1 * 4 + 4
        assert s.accumulation == 5 * 1 * 4


def test_emit_writes_a_config_that_loads(tmp_path, capsys):
    out = tmp_path / "planned.toml"
    tiny = str(CONFIG_DIR / "tiny.toml")
    assert (
        planner.main(
            ["--config", tiny, "--gpus", "2", "--gpu-memory", "1GiB", "--set", "train.engine=fsdp2", "--emit", str(out)]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "picked 1x2x1x1" in text and "<- picked" in text
    cfg = load_run_config(out)
    assert cfg.train.engine == "fsdp2" and cfg.train.activation_checkpointing == "none"


@pytest.mark.parametrize(
    ("flags", "line"),
    [
        (["--gpus", "0", "--gpu-memory", "80GiB"], "error: --gpus: must be >= 1, got 0"),
        (["--gpus", "8", "--gpu-memory", "80XB"], "error: --gpu-memory: '80XB' is not a size"),
        (["--gpus", "8", "--gpu-memory", "80GiB", "--reserve", "1.5"], "error: --reserve: must be in [0, 1)"),
        (["--gpus", "3", "--gpu-memory", "80GiB", "--set", "train.engine=fsdp2"], "error: --gpus: no layout of 3"),
        (["--gpus", "8", "--gpu-memory", "80GiB"], "error: train.engine: the planner plans fsdp2 layouts"),
    ],
)
def test_bad_flags_give_one_line_and_exit_2(flags, line, capsys):
    assert planner.main(["--config", str(CONFIG_DIR / "tiny.toml"), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith(line) and err.count("\n") == 1, err


def _one_device(preset: str, seq_len: int, memory: int, batch: int) -> list[layout_plan.Estimate]:
    sets = [f"data.seq_len={seq_len}", f"model.max_seq_len={seq_len}", f"train.batch_size={batch}"]
    return layout_plan.plan(load_run_config(CONFIG_DIR / f"{preset}.toml", sets), 1, memory)


@pytest.mark.parametrize("memory", [80 << 30, 141 * 10**9], ids=["h100-80GiB", "h200-141GB"])
def test_llama_1_3b_at_4096_on_one_large_gpu_runs_without_recomputation_at_the_largest_micro_batch(memory):
    """What a user picks on one large GPU: no activation checkpointing when it fits, and the largest micro-batch
    (a divisor of the batch) whose estimate fits the device less its 10% reserve, the next one up not fitting."""
    estimates = _one_device("llama-1.3b", 4096, memory, 64)
    chosen = layout_plan.pick(estimates)
    assert chosen is not None and chosen.ac == "none" and chosen.layout.world == 1
    assert chosen.capacity == int(memory * 0.9) and chosen.total <= chosen.capacity
    cfg = load_run_config(CONFIG_DIR / "llama-1.3b.toml", ["data.seq_len=4096", "model.max_seq_len=4096"])
    model, layout = layout_plan.meta_model(cfg), chosen.layout
    bigger = layout_plan.estimate(
        cfg, model, layout, ac="none", micro=2 * chosen.micro, capacity=chosen.capacity, accumulate=True
    )
    assert not bigger.fits
    assert chosen.micro >= (8 if memory > 100 << 30 else 4)  # the estimate's figures at the time of writing


@pytest.mark.parametrize("memory", [80 << 30, 141 * 10**9], ids=["h100-80GiB", "h200-141GB"])
def test_llama_7b_at_32k_keeps_recomputation_and_a_small_micro_batch(memory):
    """One GPU holds no 7B run at 32K (its float32 state and AdamW alone pass 100 GiB); one node of 8 does, with
    activation checkpointing on and one sequence per micro-batch."""
    assert layout_plan.pick(_one_device("llama-7b", 32768, memory, 8)) is None
    sets = ["data.seq_len=32768", "model.max_seq_len=32768", "train.batch_size=8"]
    chosen = layout_plan.pick(layout_plan.plan(load_run_config(CONFIG_DIR / "llama-7b.toml", sets), 8, memory))
    assert chosen is not None and chosen.ac != "none" and chosen.micro == 1


def test_micro_batches_divide_the_replicas_batch_largest_first():
    assert layout_plan.micro_batches(12) == [12, 6, 4, 3, 2, 1]
    assert layout_plan.micro_batches(12, largest=5) == [4, 3, 2, 1]
    assert layout_plan.micro_batches(1) == [1]


def test_the_fused_head_counts_a_chunk_of_logits_not_the_whole_batchs():
    """train.fused_cross_entropy: no float32 [tokens, V] log-softmax kept, one chunk's transients instead."""
    cfg = load_run_config(CONFIG_DIR / "llama-1.3b.toml", ["data.seq_len=4096", "model.max_seq_len=4096"])
    model, layout = layout_plan.meta_model(cfg), ParallelLayout()
    kw = dict(micro=8, seq_len=4096, cp=1, tp=1, mode="none", dtype_bytes=2, sequence_parallel=False)
    plain, fused = layout_plan.activation_bytes(model, **kw), layout_plan.activation_bytes(model, **kw, fused_head=True)
    vocab = cfg.model.vocab_size
    assert plain.final - fused.final >= 8 * 4096 * (4 * vocab - 4 * cfg.model.d_model) - 4 * vocab * cfg.model.d_model
    w_plain = layout_plan.working_bytes(model, layout, micro=8, seq_len=4096, accumulation=0)
    w_fused = layout_plan.working_bytes(model, layout, micro=8, seq_len=4096, accumulation=0, fused_head=True)
    tokens, d = 8 * 4096, cfg.model.d_model
    chunk = default_chunk(tokens, vocab)  # 8192 tokens at V = 32000: a quarter of the batch's logits
    assert w_plain - w_fused == tokens * vocab * 6 - (chunk * vocab * 6 + 2 * (tokens + vocab) * d) > 0


def readme_plan_command() -> list[str]:
    """The README's one-line ``python -m launch.plan`` command (a 7B model at 32K on 64 GPUs), as argv."""
    import re
    import shlex

    from tests.conftest import REPO

    lines = [
        line
        for block in re.findall(r"```bash\n(.*?)```", (REPO / "README.md").read_text(), flags=re.S)
        for line in block.splitlines()
        if line.startswith("python -m launch.plan ")
    ]
    assert len(lines) == 1, lines
    return shlex.split(lines[0])[3:]


def test_the_readme_plans_a_7b_model_at_32k_on_64_gpus_and_picks_the_shipped_config(capsys):
    argv = readme_plan_command()
    assert "--gpus" in argv and argv[argv.index("--gpus") + 1] == "64" and "data.seq_len=32768" in argv
    assert planner.main(argv) == 0
    picked = capsys.readouterr().out.strip().splitlines()[-1]
    assert picked.startswith("picked ") and picked in (CONFIG_DIR / "llama-7b-32k.toml").read_text()


@pytest.mark.parametrize("emit", [False, True], ids=["print", "emit"])
def test_no_layout_fitting_is_exit_2_after_the_table(emit, capsys, tmp_path):
    """A plan where nothing fits prints its table (what each layout needs), then one error line, exit 2: a script
    that checks the exit status stops there, with or without --emit (which then writes nothing)."""
    argv = ["--config", str(CONFIG_DIR / "llama-7b.toml"), "--gpus", "8", "--gpu-memory", "16GiB"]
    emitted = tmp_path / "plan.toml"
    assert planner.main([*argv, *(["--emit", str(emitted)] if emit else [])]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --gpus: no layout of 8 x 16GiB fits"), err
    assert " no" in captured.out and "picked" not in captured.out and not emitted.exists()


def test_a_length_past_the_model_names_the_keys_that_change_it(capsys):
    argv = ["--config", str(CONFIG_DIR / "llama-7b.toml"), "--gpus", "64", "--gpu-memory", "80GiB"]
    assert planner.main([*argv, "--set", "data.seq_len=32768"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: data.seq_len: 32768 exceeds model.max_seq_len=2048")
    assert "--set model.max_seq_len=32768" in err and "model.rope.scaling" in err and "model.rope.factor=16" in err


def test_float8_changes_only_the_gathered_weights_and_adds_one_matmuls_casts():
    """train.float8: the same state and activations; tensorwise all-gathers the converted weights in 1 byte, not 2 (two
    blocks in flight), and each recipe adds the float8 copies of the largest linear's input and weight."""
    cfg = load_run_config(CONFIG_DIR / "llama-1.3b.toml", ["data.seq_len=4096", "model.max_seq_len=4096"])
    model, layout = layout_plan.meta_model(cfg), ParallelLayout()
    m = cfg.model
    d, f, hq, hkv, hd = m.d_model, m.ffn_dim, m.n_heads, m.kv_heads, m.head_dim
    converted = d * hq * hd + 2 * d * hkv * hd + hq * hd * d + 3 * d * f  # wq, wk, wv, wo, up, gate, down
    tokens = 8 * 4096
    casts = max(tokens * d + d * max(hq * hd, f), tokens * hq * hd + hq * hd * d, tokens * f + f * d)
    kw = dict(micro=8, seq_len=4096, accumulation=0, fused_head=True)
    none = layout_plan.working_bytes(model, layout, **kw)
    assert layout_plan.working_bytes(model, layout, **kw, float8="rowwise") - none == casts
    assert layout_plan.working_bytes(model, layout, **kw, float8="tensorwise") - none == casts - 2 * converted
    # a filtered MLP all-gathers in bf16 again
    mlp = layout_plan.working_bytes(model, layout, **kw, float8="tensorwise", float8_filter=("*.mlp.*",))
    assert mlp - none == max(tokens * d + d * hq * hd, tokens * hq * hd + hq * hd * d) - 2 * (converted - 3 * d * f)
