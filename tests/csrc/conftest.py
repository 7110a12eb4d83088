"""Shared fixtures: the CPU twin is compiled once per session (about 30 s the first time,
then taken from torch's extension cache)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def cpu_twin():
    from vllm_hybridcache.ops.csrc_build import load_cpu_twin

    return load_cpu_twin()


@pytest.fixture
def csrc_backend(monkeypatch, cpu_twin):
    """The copy backend forced to the CPU twin for one test (selection cache reset around)."""
    from vllm_hybridcache.ops import copy_select

    monkeypatch.setenv(copy_select.ENV_VAR, "csrc")
    copy_select._select.cache_clear()
    yield
    copy_select._select.cache_clear()
