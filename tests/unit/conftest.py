"""Fixtures shared by the client package's tests (tests/unit)."""

from __future__ import annotations

import sys

import pytest

import moegrad.numerics
from moegrad.numerics import _fast


@pytest.fixture
def without_numba(monkeypatch):
    """As if numba were not installed: its import fails and the fast module has not loaded it yet."""
    monkeypatch.setitem(sys.modules, "numba", None)
    monkeypatch.setitem(sys.modules, "moegrad.numerics._fast_jit", None)
    monkeypatch.delattr(moegrad.numerics, "_fast_jit", raising=False)  # else `from moegrad.numerics import` finds it
    monkeypatch.setattr(_fast, "_KERNELS", _fast.CompiledModule("moegrad.numerics._fast_jit"))
