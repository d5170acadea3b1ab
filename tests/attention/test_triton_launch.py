"""The Triton kernels' launch parameters per target (model/attention/common/triton.py, issue 47): the family table,
the launcher's fall-through on ``OutOfResources`` and its cached choice, and the variants' fallback where nothing
fits (a pre-Ampere or unknown device, a head dim past the table, a device with less shared memory than its family's
row is sized for): ``triton_supports`` answers False with one warning, never a crash. No GPU: the capability and the
device's shared memory are faked."""

from __future__ import annotations

import warnings

import pytest
import torch

from model.attention import LayerSpec, build_attention
from model.attention.common import triton as common
from model.attention.common.triton import FAMILIES, TileConfig, family
from model.attention.focus import FocusConfig
from model.attention.focus.soft import triton as soft_triton
from model.attention.lazy import LazyConfig
from model.attention.lazy import triton as lazy_triton

FAMILY_LIMITS = {"sm_80": 166_912, "sm_86-89": 101_376, "sm_90": 232_448, "sm_100+": 101_376}


@pytest.fixture(autouse=True)
def fresh():
    common.clear_choices()
    common.forget_support()
    common._WARNED.clear()
    yield
    common.clear_choices()
    common.forget_support()
    common._WARNED.clear()


def test_families_and_their_tables():
    """Capabilities map to the families (none before Ampere); the limits are the hardware's opt-in per block. Each
    kernel module's table has candidates for every kernel on every family at head dims up to 128 (none past it, none
    before Ampere); the interpreter gets its small tile; sm_86-89 take sm_80's rows but Lazy's dq at head dim 128
    (compiled for sm_86 against its 99 KB: tests/attention/test_triton_targets.py); sm_100+ takes sm_90's
    candidates, then sm_86's (the launcher falls through to the ones a 99 KB part has); float32 inputs get smaller
    tiles."""
    assert {f.name: f.smem for f in FAMILIES} == FAMILY_LIMITS
    names = {cap: (family(cap).name if family(cap) else None) for cap in [(7, 5), (8, 0), (8, 6), (8, 9), (9, 0),
                                                                          (10, 0), (12, 0)]}  # fmt: skip
    assert names == {(7, 5): None, (8, 0): "sm_80", (8, 6): "sm_86-89", (8, 9): "sm_86-89", (9, 0): "sm_90",
                     (10, 0): "sm_100+", (12, 0): "sm_100+"}  # fmt: skip
    for module in (lazy_triton, soft_triton):
        for kernel in module._LAUNCHED:
            tc = module.tile_configs
            assert tc(kernel, None, 128, torch.bfloat16) == [common.INTERPRETER_TILES]
            assert tc(kernel, (7, 5), 64, torch.bfloat16) == [] and tc(kernel, (9, 0), 256, torch.bfloat16) == []
            for bd in (16, 32, 64, 128):
                rows = {cap: tc(kernel, cap, bd, torch.bfloat16) for cap in [(8, 0), (8, 6), (9, 0), (10, 0)]}
                assert all(row and len(set(row)) == len(row) for row in rows.values()), (kernel, bd)
                if (module, kernel, bd) != (lazy_triton, "_dq_kernel", 128):  # sm_86's ptxas spills sm_80's there
                    assert rows[(8, 6)] == rows[(8, 0)]
                assert rows[(10, 0)] == list(dict.fromkeys(rows[(9, 0)] + rows[(8, 6)]))
                wide = tc(kernel, (9, 0), bd, torch.float32)
                assert wide and rows[(9, 0)][0] not in wide
    # A100 at head dim 128: two stages everywhere (three asked for 168-176 KB in the old backward kernels)
    for module in (lazy_triton, soft_triton):
        assert all(module.tile_configs(k, (8, 0), 128, torch.bfloat16)[0].num_stages <= 2 for k in module._LAUNCHED)


def test_launcher_falls_through_refused_candidates_and_keeps_its_choice(monkeypatch):
    """A candidate triton refuses (``OutOfResources``: more shared memory than the device has, raised before
    anything runs) passes to the next; the choice is kept per (kernel, device, bd, dtype, candidates); when every
    candidate is refused, one error naming them."""
    from triton.runtime.errors import OutOfResources

    monkeypatch.setattr(common, "interpreting", lambda: False)
    a, b, c = TileConfig(64, 64, 8, 3), TileConfig(64, 64, 8, 2), TileConfig(32, 32, 4, 2)
    tried = []

    def launch(config):
        tried.append(config)
        if config.num_stages == 3:
            raise OutOfResources(200_000, 166_912, "shared memory")
        return config.block_m

    device = torch.device("cpu")
    assert common.launch_tiles("k", device, 128, torch.bfloat16, [a, b, c], launch) == 64
    assert tried == [a, b]
    tried.clear()
    assert common.launch_tiles("k", device, 128, torch.bfloat16, [a, b, c], launch) == 64
    assert tried == [b]  # the kept choice, no retry
    with pytest.raises(common.NoTileConfig, match="no candidate fits"):
        common.launch_tiles("k", device, 128, torch.bfloat16, [a], launch)


def _lazy():
    spec = LayerSpec(64, 4, 2, 16, max_seq_len=64, layer_idx=0, n_layers=1)
    return build_attention("lazy", LazyConfig(), spec)


def _focus():
    spec = LayerSpec(d_model=32, n_heads=4, n_kv_heads=2, head_dim=16, max_seq_len=64, layer_idx=0, n_layers=1)
    return build_attention("focus", FocusConfig(window=6), spec)


class _Cuda(torch.Tensor):
    """A meta tensor that says it is on CUDA (the path choice reads ``is_cuda``, the device, dtype and head dim)."""

    @property
    def is_cuda(self):
        return True

    @property
    def device(self):
        return torch.device("cuda", 0)


def _cuda_q(head_dim=128):
    return torch.zeros(1, 4, 16, head_dim, dtype=torch.bfloat16, device="meta").as_subclass(_Cuda)


@pytest.mark.parametrize(
    "cap, smem, head_dim, why",
    [
        ((7, 5), 65_536, 128, "no tile configuration for sm_75"),
        ((9, 0), 232_448, 256, "at head dim 256"),
        ((9, 0), 101_376, 128, "offers 101376 B"),  # a device with less than its family's row is sized for
        ((8, 0), 101_376, 64, "offers 101376 B"),
    ],
    ids=["pre-ampere", "head-dim-256", "small-sm90", "small-sm80"],
)
def test_variants_fall_back_with_one_warning_where_nothing_fits(monkeypatch, cap, smem, head_dim, why):
    """Lazy and Focus soft answer ``triton_supports`` False where no tiles fit (their FlexAttention path then runs),
    with one warning line per process however often they are asked; where tiles fit, True and no warning."""
    pytest.importorskip("triton")
    monkeypatch.setattr(common, "capability", lambda device: cap)
    monkeypatch.setattr(common, "max_shared_mem", lambda device: smem)
    lazy, focus = _lazy(), _focus()
    q = _cuda_q(head_dim)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            assert not lazy.triton_supports(q)
            assert not focus.soft_triton_supports(q)
    lines = [str(w.message) for w in caught]
    assert len(lines) == 2, lines
    assert lines[0].startswith("lazy: the Triton kernels do not run here (") and "FlexAttention" in lines[0]
    assert lines[1].startswith("focus soft: the Triton kernels do not run here (")
    assert all(why in line for line in lines), lines
    assert all("\n" not in line for line in lines)


@pytest.mark.parametrize("cap, smem", [((8, 0), 166_912), ((8, 6), 101_376), ((9, 0), 232_448), ((12, 0), 101_376)])
def test_variants_take_triton_where_tiles_fit(monkeypatch, cap, smem):
    pytest.importorskip("triton")
    monkeypatch.setattr(common, "capability", lambda device: cap)
    monkeypatch.setattr(common, "max_shared_mem", lambda device: smem)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for head_dim in (64, 128):
            assert _lazy().triton_supports(_cuda_q(head_dim))
            assert _focus().soft_triton_supports(_cuda_q(head_dim))


def test_fit_question_is_a_constant_to_dynamo(monkeypatch):
    """``triton_fits`` runs once at trace time and is a constant in the graph (no break, no host sync): the
    variants ask it inside compiled blocks."""
    pytest.importorskip("triton")
    monkeypatch.setattr(common, "capability", lambda device: (7, 5))
    device = torch.device("cuda", 0)

    def f(x):
        fits = common.triton_fits(lazy_triton.tile_configs, lazy_triton._LAUNCHED, device, 128, torch.bfloat16,
                                  "lazy", "FlexAttention")  # fmt: skip
        return x + 1 if fits else x - 1

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = torch.compile(f, backend="eager", fullgraph=True)(torch.zeros(3))
    assert torch.equal(out, torch.full((3,), -1.0))
    assert len(caught) == 1
