"""Shared fixtures: embedded models are written once per machine (user cache), engines once per
module. Tests never download anything."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


@pytest.fixture(scope="session")
def embedded_model():
    """Factory: name -> folder of the embedded checkpoint (written on first use)."""
    from vllm_hybridcache.models import ensure_model

    cache: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in cache:
            cache[name] = ensure_model(name)
        return cache[name]

    return get
