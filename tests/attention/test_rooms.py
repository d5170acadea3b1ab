"""Every registered variant is a package with the same rooms (issue 39, item 1; docs/architecture.md):

- ``__init__.py`` only exposes names and registers the variant (imports, ``register_attention(...)(...)``,
  ``__all__``, a docstring: no ``def``, no ``class``, nothing else);
- ``config.py`` holds the variant's config class, ``module.py`` its module class;
- ``naive.py`` holds the reference as plain functions, and ``module.py`` imports it;
- the product's variants keep all their tests in ``tests/attention/<name>/`` (tests mirror the source).

Driven by the registry, so a new variant (a plugin's too: tests/attention/test_new_variant.py) is held to it.
"""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import pytest
import torch

from model.attention import registry
from tests.conftest import ATTENTION_TESTS


def _package(name: str) -> str:
    module = registry[name].cls.__module__
    assert module.endswith(".module"), f"{name}: its class lives in {module}, not in <package>.module"
    return module.rsplit(".", 1)[0]


def _source_tree(module_name: str) -> ast.Module:
    return ast.parse(Path(inspect.getfile(importlib.import_module(module_name))).read_text())


def _is_registration(node: ast.stmt) -> bool:
    """``register_attention("name", Config)(Class)`` as a statement."""
    if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)):
        return False
    inner = node.value.func
    return isinstance(inner, ast.Call) and isinstance(inner.func, ast.Name) and inner.func.id == "register_attention"


@pytest.mark.parametrize("name", sorted(registry))
def test_init_only_exposes_names_and_registers(name):
    package = _package(name)
    tree = _source_tree(package)
    registrations = []
    for index, node in enumerate(tree.body):
        if index == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # the docstring
        if isinstance(node, ast.Import | ast.ImportFrom):
            continue
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["__all__"]:
            continue
        if _is_registration(node):
            registrations.append(node)
            continue
        pytest.fail(f"{package}/__init__.py line {node.lineno}: only imports, __all__ and the registration belong here")
    assert len(registrations) == 1, f"{package}/__init__.py: registers {len(registrations)} variants, not one"
    first = registrations[0].value.func.args[0]  # type: ignore[attr-defined]
    assert isinstance(first, ast.Constant) and first.value == name, f"{package}/__init__.py registers {first}"


@pytest.mark.parametrize("name", sorted(registry))
def test_config_module_and_naive_rooms(name):
    package = _package(name)
    entry = registry[name]
    assert entry.config_cls.__module__ == f"{package}.config", f"{name}: config class not in {package}.config"
    naive = importlib.import_module(f"{package}.naive")
    functions = [f for f in vars(naive).values() if inspect.isfunction(f) and f.__module__ == naive.__name__]
    assert functions, f"{package}.naive defines no reference function"
    classes = [c for c in vars(naive).values() if inspect.isclass(c) and c.__module__ == naive.__name__]
    assert not any(issubclass(c, torch.nn.Module) for c in classes), f"{package}.naive: plain functions"
    imports = set()
    for node in ast.walk(_source_tree(f"{package}.module")):
        if isinstance(node, ast.ImportFrom):
            imports.add(node.module or "")
            imports.update(f"{node.module}.{alias.name}" for alias in node.names)
    assert f"{package}.naive" in imports, f"{package}/module.py does not import its naive.py reference"


@pytest.mark.parametrize(
    "name", sorted(n for n in registry if registry[n].cls.__module__.startswith(f"model.attention.{n}"))
)
def test_tests_mirror_the_source(name):
    folder = ATTENTION_TESTS / name
    assert sorted(folder.glob("test_*.py")), f"tests/attention/{name}/ holds no tests"
    flat = sorted(p.name for p in ATTENTION_TESTS.glob(f"test_{name}*.py"))
    assert not flat, f"tests of {name} outside tests/attention/{name}/: {flat}"
    package = f"model.attention.{name}"

    def imports_naive(path: Path) -> bool:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == f"{package}.naive":
                return True
            if isinstance(node, ast.ImportFrom) and node.module == package:
                if "naive" in {alias.name for alias in node.names}:
                    return True
        return False

    uses_naive = any(imports_naive(path) for path in folder.glob("*.py"))
    assert uses_naive, f"no test in tests/attention/{name}/ imports its naive reference"
