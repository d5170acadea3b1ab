"""One extra per journey: ``core.errors.EXTRAS`` (the optional import -> the extra a missing one names) equals
setup.cfg's extras, ``[dev]`` holds every extra (CI installs it), and the README names each extra. What each CLI
says without one: tests/e2e/test_fresh_install.py."""

from __future__ import annotations

import configparser

from core.errors import EXTRAS, install_hint, missing_extra
from tests.conftest import REPO
from tests.e2e.test_fresh_install import _requirements

JOURNEY_EXTRAS = {"hf", "eval", "deepspeed", "flash", "float8"}


def extras() -> dict[str, set[str]]:
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    return {name: _requirements(value) for name, value in cfg["options.extras_require"].items()}


def test_the_table_names_each_optional_import_with_the_extra_that_installs_it():
    found = extras()
    assert JOURNEY_EXTRAS <= found.keys() and set(EXTRAS.values()) <= found.keys()
    dist = {"lm_eval": "lm-eval", "flash_attn": "flash-attn"}
    for module, extra in EXTRAS.items():
        assert dist.get(module, module) in found[extra], (module, extra, found[extra])
    named = {dist.get(m, m) for m in EXTRAS}
    for extra, requirements in found.items():
        if extra != "dev":
            assert requirements <= named, f"[{extra}] installs {requirements - named}: add it to core.errors.EXTRAS"


def test_dev_installs_every_extra_but_the_cuda_only_one():
    found = extras()
    for extra, requirements in found.items():
        if extra not in ("dev", "flash"):  # flash-attn builds against CUDA only
            assert requirements <= found["dev"], (extra, requirements - found["dev"])


def test_the_readme_names_each_extra_beside_its_journey():
    readme = (REPO / "README.md").read_text()
    for extra in JOURNEY_EXTRAS:
        assert f'pip install -e ".[{extra}]"' in readme or f"`[{extra}]`" in readme, extra
    hf = readme.split("### Hugging Face in and out", 1)[1].split("\n### ", 1)[0]
    assert 'pip install -e ".[hf]"' in hf


def test_the_message_is_one_line_naming_the_extra():
    assert str(missing_extra("transformers", "--format hf")) == (
        "--format hf needs transformers, which is not installed: " + install_hint("hf")
    )
    assert install_hint("eval") == "pip install -e '.[eval]'"
