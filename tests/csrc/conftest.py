"""Shared fixtures: the CPU twin is compiled once per session (about 30 s the first time,
then taken from torch's extension cache)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def cpu_twin():
    from vllm_hybridcache.ops.csrc_build import load_cpu_twin

    return load_cpu_twin()
