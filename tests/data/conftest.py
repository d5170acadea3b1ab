"""Data tests never touch ~/.cache: a stray default cache_dir lands in a temporary folder."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _no_home_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("FOCUSED_PRETRAIN_CACHE", str(tmp_path_factory.getbasetemp() / "default-cache"))
