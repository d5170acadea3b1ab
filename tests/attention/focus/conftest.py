"""Fixtures shared by the Focus tests."""

from __future__ import annotations

import warnings

import pytest


@pytest.fixture
def eager_flex_backward(monkeypatch):
    """FlexAttention refuses backward on CPU up front; its eager math implementation has one, which is what the CPU
    check of the GPU code's logic uses."""
    import torch.nn.attention.flex_attention as fa

    monkeypatch.setattr(fa, "_validate_device", lambda *args: None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
