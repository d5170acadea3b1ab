"""A new variant is one package with the rooms of every variant: nothing else needs an edit.

A throwaway variant (a name with an underscore, like ``prescored_hyper``) is registered by a pytest
plugin loaded into a subprocess; the shared attention suite, the config and launch-preset tests
then collect it from the registry and pass, with no test file edited.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import REPO

# The variant's package, room by room (docs/architecture.md: "A variant's package").
PACKAGE = {
    "__init__.py": '''
        """A test's throwaway variant: plain causal softmax with a learnable per-head scale."""
        from model.attention import register_attention
        from toy_scaled.config import ToyConfig
        from toy_scaled.module import ToyScaled

        register_attention("toy_scaled", ToyConfig)(ToyScaled)

        __all__ = ["ToyConfig", "ToyScaled"]
    ''',
    "config.py": """
        from dataclasses import dataclass

        from core.errors import check_min
        from model.attention import VariantConfig


        @dataclass
        class ToyConfig(VariantConfig):
            scale: float = 1.0

            def validate(self, prefix):
                check_min(prefix + "scale", self.scale, 0.0, strict=True)
    """,
    "naive.py": '''
        from model.attention.common import reference as ref


        def attention(q, k, v, q_pos, k_pos, scale):
            """Causal softmax with per-head logit scales ``scale`` [H, 1, 1]."""
            p = ref.masked_softmax(ref.scores(q, k, scale), ref.causal_mask(q_pos, k_pos))
            return ref.weighted_values(p, v, q.dtype)
    ''',
    "module.py": """
        import torch
        from torch import nn

        from model.attention import Attention, AttnOut
        from toy_scaled.naive import attention


        class ToyScaled(Attention):
            description = "a test's throwaway variant"
            no_weight_decay = ("log_scale",)

            def __init__(self, cfg, spec):
                super().__init__(cfg, spec)
                self.log_scale = nn.Parameter(torch.zeros(spec.n_heads, 1, 1))

            def reference(self, q, k, v, *, hidden, q_pos, k_pos, cache):
                scale = self.cfg.scale * self.log_scale.exp() / q.shape[-1] ** 0.5
                return AttnOut(attention(q, k, v, q_pos, k_pos, scale))
    """,
}


@pytest.fixture(scope="module")
def plugin_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("plugin")
    (directory / "toy_scaled").mkdir()
    for name, text in PACKAGE.items():
        (directory / "toy_scaled" / name).write_text(textwrap.dedent(text).lstrip())
    (directory / "toy_variant.py").write_text("import toy_scaled  # noqa: F401  (registers the variant)\n")
    return directory


def run_with_plugin(plugin_dir, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(plugin_dir), str(REPO)])}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "toy_variant", "-p", "no:cacheprovider", "-rA", *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_the_shared_suite_and_the_presets_cover_a_registered_variant(plugin_dir):
    proc = run_with_plugin(
        plugin_dir,
        "tests/attention/test_suite.py",
        "tests/attention/test_rooms.py",
        "tests/pretrain/test_presets.py",
        "-k",
        "toy_scaled or every",
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    passed = [line for line in proc.stdout.splitlines() if line.startswith("PASSED") and "toy_scaled" in line]
    kinds = {"test_causality", "test_kv_cache_generation_matches_full_forward"}
    kinds |= {"test_chunked_prefill_matches_full_forward", "test_derived_config_validates"}
    kinds |= {"test_init_only_exposes_names_and_registers", "test_config_module_and_naive_rooms"}
    # a reference-only variant: its fast-path comparison is not generated (not a skip, which CI would fail)
    assert not any("test_fast_path_matches_reference" in line and "toy_scaled" in line for line in passed)
    for kind in kinds:
        assert any(kind in line for line in passed), f"{kind} did not run for the new variant:\n{proc.stdout[-3000:]}"
