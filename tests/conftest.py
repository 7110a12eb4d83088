"""Shared fixtures: embedded models are written once per machine (user cache), engines once per
module. Tests never download anything."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Triton kernels are tested on the CPU through Triton's interpreter, which `@triton.jit` reads
# when a function is decorated. Set it before anything in this process imports a kernel module,
# so every test folder sees the same (interpreted) kernels; vLLM's own Triton detection is
# unaffected (it still finds no CPU backend).
os.environ.setdefault("TRITON_INTERPRET", "1")
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
