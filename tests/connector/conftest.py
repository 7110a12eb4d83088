"""One in-process vLLM engine per module (engine core and worker in this process), so tests can
reach the scheduler-side tree and the worker-side store directly."""

from __future__ import annotations

import os

import pytest

from vllm_hybridcache.serving.python_api import engine_parts, llm_kwargs

__all__ = ["engine_parts", "make_llm"]


def make_llm(model_path, extra: dict | None = None, plugin: bool = True, **kw):
    from vllm import LLM

    args = dict(model=str(model_path), max_model_len=8192, max_num_batched_tokens=2048,
                enforce_eager=True, seed=0)
    args.update(kw)
    if plugin:
        args.update(llm_kwargs(**(extra or {})))
    return LLM(**args)


@pytest.fixture(scope="module")
def inproc(monkeypatch_module):
    monkeypatch_module.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch_module.setenv("VLLM_HYBRIDCACHE_PROBE_STATES", "1")
    yield


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
