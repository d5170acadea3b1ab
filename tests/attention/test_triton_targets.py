"""Lazy's and Focus soft's Triton kernels compiled ahead of time for real GPU targets, without a GPU (issue 47).

Each kernel is launched as the product launches it: the public entry points (``elastic_triton``,
``triton_soft_attention``) run forward and backward on CPU tensors with each kernel module's jitted launch kernels
swapped for recorders (``_KERNELS``) and its ``capability`` answering the target's, so the grid, arguments,
constexprs, warps and stages are the ones its ``tile_configs`` gives for that target. Each recorded launch is
specialised with triton's own binder (pointer alignment, ints divisible by 16, ints equal to 1) and compiled with
``triton.compile(ASTSource(...), target=GPUTarget("cuda", cc, 32))`` into a fresh temporary cache, so the wheel's
ptxas runs and its ``-v`` log gives registers and spills. T does not change the specialisation (the grid only), so
the shapes are small; each distinct specialisation compiles once per session and every assertion reads it.

Asserted for every kernel and every candidate its ``tile_configs`` can pick on sm_80 and sm_90: it compiles; its
shared memory fits the family's opt-in limit per block (166,912 B sm_80, 232,448 B sm_90); every dot inside a loop
runs on the tensor cores (``mma`` / ``wgmma`` in the loops' PTX); no atomics (``atom`` / ``red``); for the default
(first) candidate, 0 spill bytes, no dot lowered to scalar FMAs and, on sm_90, ``wgmma`` (``SM90_MMA_SYNC`` names
the one default whose tiles are too small for it). Known spills and FMA dots would be listed below as strict xfails
with the measured figures (both lists are empty since the kernel rewrites of issue 47); an entry that passes fails
(XPASS strict) and is deleted then.

Tiers (both ``slow``: compilation, out of the inner loop's fast tier). CI: the default candidates at bf16 on sm_80
and sm_90, every kernel, both gates, head dims 64 and 128, MHA and GQA (72 compilations). ``--triton-targets``
(deselected otherwise, like ``long_context``) adds the second candidates, fp16 and the sm_86-89 family (compiled for
sm_86 against 101,376 B):
``python -m pytest -q -p no:xdist --triton-targets -m triton_targets tests/attention/test_triton_targets.py``.
``python -m tests.attention.test_triton_targets`` prints the measured table of docs/triton-targets.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import re
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from model.attention.common import triton as common
from model.attention.common.triton import FAMILIES, TileConfig

triton = pytest.importorskip("triton")

FAMILY = {f.target: f for f in FAMILIES}
MODULES = {"lazy": "model.attention.lazy.triton", "focus_soft": "model.attention.focus.soft.triton"}


@dataclasses.dataclass(frozen=True)
class Spec:
    """One kernel launch to compile: which kernel, for which target, at which shape and which candidate."""

    module: str  # "lazy" | "focus_soft"
    kernel: str  # e.g. "_dkv_kernel"
    gate: str  # focus soft's gate ("" for lazy)
    cc: int  # 80 | 86 | 90
    d: int  # head dim
    gqa: bool  # 16 query heads over 4 key/value heads, else 16 over 16
    dtype: str  # "bf16" | "fp16"
    index: int  # the candidate's place in tile_configs (0: the default)

    @property
    def name(self) -> str:
        gate = f"[{self.gate}]" if self.gate else ""
        return f"{self.module}.{self.kernel}{gate}"

    @property
    def id(self) -> str:
        layout = "gqa" if self.gqa else "mha"
        return f"{self.name}-sm{self.cc}-d{self.d}-{layout}-{self.dtype}-c{self.index}"

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def candidates(spec_module: str, kernel: str, cc: int, d: int, dtype: torch.dtype) -> list[TileConfig]:
    module = sys.modules.get(MODULES[spec_module]) or __import__(MODULES[spec_module], fromlist=["_"])
    return module.tile_configs(kernel, (cc // 10, cc % 10), common.padded(d), dtype)


KERNELS = {"lazy": ("_fwd_kernel", "_dq_kernel", "_dkv_kernel"),
           "focus_soft": ("_fwd_kernel", "_dq_kernel", "_dkv_kernel")}  # fmt: skip


def all_specs() -> list[Spec]:
    specs = []
    for cc in (80, 90, 86):
        for d in (128, 64):
            for gqa in (False, True):
                for dtype in ("bf16", "fp16"):
                    for module, kernels in KERNELS.items():
                        for gate in ("additive", "multiplicative") if module == "focus_soft" else ("",):
                            for kernel in kernels:
                                n = len(candidates(module, kernel, cc, d, DTYPES[dtype]))
                                for index in range(n):
                                    specs.append(Spec(module, kernel, gate, cc, d, gqa, dtype, index))
    return specs


def in_ci_tier(spec: Spec) -> bool:
    """The default candidates at bf16 on sm_80 and sm_90: every kernel, both gates, head dims 64 and 128, MHA and
    GQA (72 compilations, about 1 s each on an idle core)."""
    return spec.cc in (80, 90) and spec.index == 0 and spec.dtype == "bf16"


SPECS = all_specs()


def params(specs: list[Spec]) -> list[Any]:
    """CI tier: slow (minutes of compilation: out of the inner loop's fast tier); the rest: triton_targets."""
    marks = {True: (pytest.mark.slow,), False: (pytest.mark.slow, pytest.mark.triton_targets)}
    return [pytest.param(s, id=s.id, marks=marks[in_ci_tier(s)]) for s in specs]


# ---------------------------------------------------------------------------------------------------------------------
# known exceptions of the default candidates (measured 2026-11-28, triton 3.9.0), strict xfails: an entry that passes
# fails (XPASS) and is deleted then. Empty since the kernel rewrites of issue 47 (every default: 0 spill bytes, no
# FMA dot, on sm_80, sm_86 and sm_90, bf16 and fp16).

# spill stores + loads (bytes per thread, ptxas -v) of a default candidate that spills, by (name, cc, head dim, GQA)
KNOWN_SPILLS: dict[tuple[str, int, int, bool], int] = {}
# default candidates whose loop dots on sm_90 are tensor-core ``mma.sync``, not ``wgmma`` (a warpgroup's wgmma needs
# 64 rows: these tiles have 32 keys as rows), by (name, head dim), measured 2026-11-28: Lazy's dk/dv at head dim 128
# takes 64 x 32 tiles, the spill-free one; 64 x 64 (wgmma) spills 160-528 B (8 warps, 1-3 stages; MHA and GQA 16/4).
# Strict: an entry whose kernel lowers to wgmma fails, and is deleted then.
SM90_MMA_SYNC: dict[tuple[str, int], str] = {
    ("lazy._dkv_kernel", 128): "64 x 32 tiles (0 spills); 64 x 64 wgmma tiles spill 160-528 B",
}
# kernels with a dot lowered to scalar FMAs (operands on blocked layouts); Focus soft's gate is unrolled FMAs now
FMA_DOT_KERNELS: tuple[str, ...] = ()


# ---------------------------------------------------------------------------------------------------------------------
# recording and compiling


class _Recorder:
    def __init__(self, jit: Any, sink: list[tuple[Any, tuple[Any, ...], dict[str, Any]]]):
        self.jit, self.sink = jit, sink

    def __getitem__(self, grid: Any) -> Any:
        def launch(*args: Any, **kwargs: Any) -> None:
            self.sink.append((self.jit, args, kwargs))

        return launch


@contextlib.contextmanager
def _recording(mod: Any, spec: Spec, sink: list[Any]) -> Iterator[None]:
    """The module's launch kernels record instead of launching; its capability is the target's; its tile_configs
    gives the spec's candidate alone (the launcher's choice is then that candidate)."""
    real = mod._kernels()  # jitted for real compilation (not interpreting: this process never sets the variable)
    cache = mod._KERNELS[False]
    saved = dict(cache)
    tile_configs = mod.tile_configs
    with pytest.MonkeyPatch.context() as patch:
        for name in mod._LAUNCHED:
            cache[name] = _Recorder(real[name], sink) if name == spec.kernel else _Recorder(real[name], [])
        patch.setattr(mod, "capability", lambda device: (spec.cc // 10, spec.cc % 10))

        def one(kernel: str, cap: Any, bd: int, dtype: torch.dtype) -> list[TileConfig]:
            configs = tile_configs(kernel, cap, bd, dtype)
            return [configs[min(spec.index, len(configs) - 1)]]

        patch.setattr(mod, "tile_configs", one)
        try:
            yield
        finally:
            cache.clear()
            cache.update(saved)


def record(spec: Spec) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    """The spec's kernel launch as the product makes it (forward and backward of the public entry point)."""
    mod = __import__(MODULES[spec.module], fromlist=["_"])
    b, h, hk, t, d = 1, 16, 4 if spec.gqa else 16, 256, spec.d
    dtype = spec.torch_dtype
    sink: list[Any] = []
    q = torch.zeros(b, h, t, d, dtype=dtype, requires_grad=True)
    k = torch.zeros(b, hk, t, d, dtype=dtype, requires_grad=True)
    v = torch.zeros(b, hk, t, d, dtype=dtype, requires_grad=True)
    with _recording(mod, spec, sink):
        if spec.module == "lazy":  # the bias table and tau stay float32 parameters under autocast
            bias = torch.zeros(h, t, requires_grad=True)
            tau = torch.ones(h, requires_grad=True)
            out = mod.elastic_triton(q, k, v, bias, tau, d**-0.5, t - 1)
        else:  # FocusConfig's default n_groups = 4 (K' = 5 with the additive gate's column), window 128
            g_q = torch.rand(b, t, 4, dtype=dtype, requires_grad=True)
            g_k = torch.rand(b, t, 4, dtype=dtype, requires_grad=True)
            lam = torch.full((1,), 2.0, requires_grad=True)
            out = mod.triton_soft_attention(q, k, v, g_q, g_k, lam, window=128, scale=d**-0.5, gate=spec.gate)
        out.float().sum().backward()
    assert len(sink) == 1, f"{spec.id}: {len(sink)} launches recorded"
    return sink[0]


@dataclasses.dataclass
class Compiled:
    spec: Spec
    config: TileConfig
    shared: int
    regs: int
    spill_bytes: int  # stores + loads
    ptx: str
    ttgir: str
    seconds: float


# fresh by default: every compile runs ptxas and its -v log is read; TRITON_TARGETS_CACHE keeps compilations between
# runs (a kernel's source is part of triton's cache key), ptxas -v then reruns on the cached PTX
_CACHE_DIR = os.environ.get("TRITON_TARGETS_CACHE") or tempfile.mkdtemp(prefix="triton_targets_")
_COMPILED: dict[tuple[Any, ...], Compiled | Exception] = {}


def compile_spec(spec: Spec) -> Compiled:
    """The spec's kernel compiled for its target, once per distinct specialisation in this process."""
    import time

    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    jit, args, kwargs = record(spec)
    target = GPUTarget("cuda", spec.cc, 32)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_CACHE_DIR", _CACHE_DIR)
        patch.delenv("TRITON_INTERPRET", raising=False)
        patch.setenv("TRITON_DEFAULT_FP_FUSION", "1")  # triton 3.9's default, said: no warning
        patch.setattr(knobs.nvidia, "dump_ptxas_log", True)
        patch.setattr(knobs.cache, "dir", _CACHE_DIR, raising=False)
        backend = make_backend(target)
        binder = create_function_from_signature(jit.signature, jit.params, backend)
        bound, specialization, opts = binder(*args, **kwargs)
        options, signature, constexprs, attrs = jit._pack_args(backend, kwargs, bound, specialization, opts)
        key = (jit.fn.__name__, spec.cc, repr(signature), repr(sorted(map(repr, constexprs.items()))), repr(attrs),
               options.num_warps, options.num_stages)  # fmt: skip
        log = io.StringIO()
        start = time.perf_counter()
        if key not in _COMPILED:
            try:
                with contextlib.redirect_stdout(log):
                    kernel = triton.compile(ASTSource(jit, signature, constexprs, attrs), target=target,
                                            options=options.__dict__)  # fmt: skip
            except Exception as e:  # a compiler error is this spec's result: every test of it reports it
                _COMPILED[key] = e
        if key not in _COMPILED:
            text = log.getvalue() if "Used" in log.getvalue() else ptxas_log(kernel.asm["ptx"], spec.cc)
            number = lambda pattern: int(m.group(1)) if (m := re.search(pattern, text)) else 0  # noqa: E731
            assert "Used" in text, f"{spec.id}: no ptxas -v log: {text[-2000:]}"
            # the kernels' tile constexprs: BLOCK today, BLOCK_M / BLOCK_N once the rewrites split it
            block_m, block_n = (kwargs.get(k, kwargs.get("BLOCK")) for k in ("BLOCK_M", "BLOCK_N"))
            config = TileConfig(block_m, block_n, options.num_warps, options.num_stages)
            _COMPILED[key] = Compiled(
                spec, config, kernel.metadata.shared, number(r"Used (\d+) registers"),
                number(r"(\d+) bytes spill stores") + number(r"(\d+) bytes spill loads"),
                kernel.asm["ptx"], kernel.asm["ttgir"], time.perf_counter() - start,
            )  # fmt: skip
            _report(_COMPILED[key])  # type: ignore[arg-type]
    result = _COMPILED[key]
    if isinstance(result, Exception):
        raise AssertionError(f"{spec.id}: does not compile: {type(result).__name__}: {str(result)[:3000]}")
    return result


def ptxas_log(ptx: str, cc: int) -> str:
    """ptxas -v on ``ptx`` as triton runs it (the wheel's ptxas, its flags), for a compilation found in the cache."""
    import subprocess

    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    with tempfile.TemporaryDirectory() as folder:
        src = os.path.join(folder, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        arch = sm_arch_from_capability(cc)
        cmd = [
            get_ptxas(cc).path,
            "-lineinfo",
            "-v",
            "--regAllocOptLevel=2",
            f"--gpu-name={arch}",
            src,
            "-o",
            src + ".o",
        ]
        done = subprocess.run(cmd, capture_output=True, text=True)
    return done.stdout + done.stderr


def _report(c: Compiled) -> None:
    """One JSON line per compilation into $TRITON_TARGETS_REPORT (the measured table of docs/triton-targets.md)."""
    path = os.environ.get("TRITON_TARGETS_REPORT")
    if path:
        import json

        loops = [lowering for lowering, in_loop in dots(c.ttgir) if in_loop]
        row = {**dataclasses.asdict(c.spec), "config": dataclasses.astuple(c.config), "shared": c.shared,
               "regs": c.regs, "spill_bytes": c.spill_bytes, "loop_dots": loops, "s": round(c.seconds, 1)}  # fmt: skip
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")


# ---------------------------------------------------------------------------------------------------------------------
# reading the compiled code


def loop_lines(ptx: str) -> list[str]:
    """PTX lines inside a loop: from a label to a later branch back to it."""
    lines = ptx.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"^\s*(\$L__\w+):", line))}
    inside: set[int] = set()
    for i, line in enumerate(lines):
        m = re.search(r"\bbra(?:\.uni)?\s+(\$L__\w+);", line)
        if m and labels.get(m.group(1), i) < i:
            inside.update(range(labels[m.group(1)], i + 1))
    return [lines[i] for i in sorted(inside)]


def dots(ttgir: str) -> list[tuple[str, bool]]:
    """Each dot of the TTGIR: its lowering ("wgmma", "mma" or "fma": operands on blocked layouts, scalar FMAs) and
    whether it sits in an ``scf.for``."""
    found, opened, depth = [], [], 0
    for line in ttgir.splitlines():
        if "scf.for" in line:
            opened.append(depth)
        m = re.search(r"(tt\.dot|ttng\.warp_group_dot)\s.*?:\s*(tensor<[^>]*>)", line)
        if m:
            lowering = "wgmma" if m.group(1) == "ttng.warp_group_dot" else "mma" if "#mma" in m.group(2) else "fma"
            found.append((lowering, bool(opened)))
        depth += line.count("{") - line.count("}")
        while opened and depth <= opened[-1] and "scf.for" not in line:
            opened.pop()
    return found


TENSOR_CORE = {"mma": r"\bmma\.sync\.aligned", "wgmma": r"\bwgmma\.mma_async"}


def tensor_cores(spec: Spec) -> set[str]:
    """The tensor-core lowerings a spec's loop dots may take: ``mma`` before sm_90; on sm_90 ``wgmma`` for the
    defaults (``SM90_MMA_SYNC`` aside: ``mma`` exactly), either for the smaller fall-back candidates (tiles under 64
    rows per warpgroup lower to ``mma.sync``)."""
    if spec.cc < 90:
        return {"mma"}
    if spec.index > 0:
        return {"mma", "wgmma"}
    return {"mma"} if (spec.name, spec.d) in SM90_MMA_SYNC else {"wgmma"}


# ---------------------------------------------------------------------------------------------------------------------
# the tests


@pytest.mark.parametrize("spec", params(SPECS))
def test_compiles_fits_and_uses_tensor_cores(spec):
    """Compiles; shared memory within the family's opt-in limit per block; every dot in a loop on the tensor cores
    (the gate's FMA dots aside: ``test_default_has_no_fma_dots``) and tensor-core instructions in the loops' PTX; no
    atomics."""
    c = compile_spec(spec)
    limit = FAMILY[spec.cc].smem
    assert c.shared <= limit, f"{spec.id} ({c.config}): {c.shared} B of shared memory > {limit} B"
    in_loops = [lowering for lowering, in_loop in dots(c.ttgir) if in_loop]
    assert in_loops, f"{spec.id}: no dot inside a loop"
    allowed = tensor_cores(spec)
    not_fma = [lowering for lowering in in_loops if lowering != "fma"]
    assert not_fma and all(lowering in allowed for lowering in not_fma), f"{spec.id}: loop dots {in_loops}"
    pattern = "|".join(TENSOR_CORE[x] for x in sorted(allowed))
    assert any(re.search(pattern, line) for line in loop_lines(c.ptx)), f"{spec.id}: no {' / '.join(allowed)}"
    atomics = [line for line in c.ptx.splitlines() if re.match(r"^\s*(?:@!?%p\w+\s+)?(?:atom|red)\.", line)]
    assert not atomics, f"{spec.id}: atomics {atomics[:3]}"


DEFAULTS = [s for s in SPECS if s.index == 0]


@pytest.mark.parametrize("spec", params(DEFAULTS))
def test_default_does_not_spill(spec, request):
    """The default candidate of every kernel uses no local memory for spills (ptxas -v: 0 bytes)."""
    key = (spec.name, spec.cc, spec.d, spec.gqa)
    if key in KNOWN_SPILLS:
        why = f"known: {KNOWN_SPILLS[key]} B spilled (measured)"
        request.applymarker(pytest.mark.xfail(strict=True, reason=why))
    c = compile_spec(spec)
    assert c.spill_bytes == 0, f"{spec.id} ({c.config}): {c.spill_bytes} B spilled, {c.regs} registers"


@pytest.mark.parametrize("spec", params(DEFAULTS))
def test_default_has_no_fma_dots(spec, request):
    """No ``tt.dot`` of a default candidate lowers to scalar FMAs (dot operands on blocked layouts)."""
    if spec.name.split("[")[0] in FMA_DOT_KERNELS:
        why = "known: a dot lowered to FMA (measured)"
        request.applymarker(pytest.mark.xfail(strict=True, reason=why))
    c = compile_spec(spec)
    fma = [lowering for lowering, _ in dots(c.ttgir) if lowering == "fma"]
    assert not fma, f"{spec.id}: {len(fma)} dots lowered to FMA"


def test_every_family_candidate_is_covered():
    """Every candidate the tables can give on sm_80 / sm_86 / sm_90 is among the compiled specs (the tables and this
    test cannot drift apart), and the CI tier holds every kernel on both sm_80 and sm_90."""
    for cc in (80, 86, 90):
        for d in (64, 128):
            for module, kernels in KERNELS.items():
                for kernel in kernels:
                    n = len(candidates(module, kernel, cc, d, torch.bfloat16))
                    assert n >= 1, f"{module}.{kernel} has no candidate on sm_{cc} at head dim {d}"
                    got = {s.index for s in SPECS if (s.module, s.kernel, s.cc, s.d) == (module, kernel, cc, d)}
                    assert got == set(range(n))
    ci = {(s.name, s.cc) for s in SPECS if in_ci_tier(s)}
    assert len(ci) == 2 * (len(KERNELS["lazy"]) + 2 * len(KERNELS["focus_soft"]))


# ---------------------------------------------------------------------------------------------------------------------
# the measured table (docs/triton-targets.md): python -m tests.attention.test_triton_targets [--all]


def main(argv: list[str]) -> None:
    specs = SPECS if "--all" in argv else [s for s in SPECS if in_ci_tier(s)]
    print("| kernel | target | head dim | heads | dtype | candidate | tiles (M x N, warps, stages) | smem B | regs | "
          "spill B (st + ld) | dots in loops | s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for spec in specs:
        try:
            c = compile_spec(spec)
        except AssertionError as e:
            print(f"| {spec.name} | sm_{spec.cc} | {spec.d} | | | {spec.index} | FAILED: {str(e)[:200]} |", flush=True)
            continue
        loops = [lowering for lowering, in_loop in dots(c.ttgir) if in_loop]
        summary = ", ".join(f"{loops.count(x)} {x}" for x in ("wgmma", "mma", "fma") if x in loops)
        cfg = c.config
        print(f"| {spec.name} | sm_{spec.cc} | {spec.d} | {'16/4' if spec.gqa else '16/16'} | {spec.dtype} | "
              f"{spec.index} | {cfg.block_m} x {cfg.block_n}, {cfg.num_warps}, {cfg.num_stages} | {c.shared} | "
              f"{c.regs} | {c.spill_bytes} | {summary} | {c.seconds:.1f} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    os.environ.pop("TRITON_INTERPRET", None)
    main(sys.argv[1:])
