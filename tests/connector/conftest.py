"""One in-process vLLM engine per module (engine core and worker in this process), so tests can
reach the scheduler-side tree and the worker-side store directly."""

from __future__ import annotations

import os
from contextlib import contextmanager

import pytest

from tests.conftest import vllm_engine
from vllm_hybridcache.serving.python_api import engine_parts, llm_kwargs

__all__ = ["connector_engine", "engine_parts"]


@contextmanager
def cpu_attention_pinned(monkeypatch):
    """The CPU attention pin (opt-in: VLLM_HYBRIDCACHE_CPU_ATTN_SPLIT_INVARIANT=1) and the
    GDN bend put in place for the engines made inside, so vLLM's Qwen3-Next runs in fine mode.
    vLLM loads the plugin once per process, possibly earlier without the pin, so both are
    installed here, and the process's previous state is put back afterwards: no later engine
    of this process runs pinned unasked."""
    from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention as gdn
    from vllm.v1.attention.backends import cpu_attn

    from vllm_hybridcache import compat
    from vllm_hybridcache.config import CPU_ATTN_SPLIT_INVARIANT_ENV

    monkeypatch.setenv(CPU_ATTN_SPLIT_INVARIANT_ENV, "1")
    build, nonspec = cpu_attn.CPUAttentionMetadataBuilder.build, gdn._cpu_gdn_attention_nonspec
    compat.pin_cpu_attention_split()
    compat.install_cpu_gdn_inner_states()
    try:
        yield
    finally:
        cpu_attn.CPUAttentionMetadataBuilder.build = build
        gdn._cpu_gdn_attention_nonspec = nonspec


@contextmanager
def connector_engine(model_path, extra: dict | None = None, plugin: bool = True, **kw):
    """An engine with the plugin's settings (`extra`), built and shut down by `vllm_engine`."""
    args = dict(max_model_len=8192, max_num_batched_tokens=2048, enforce_eager=True, seed=0)
    args.update(kw)
    if plugin:
        args.update(llm_kwargs(**(extra or {})))
    with vllm_engine(model_path, **args) as llm:
        yield llm


@pytest.fixture(scope="module")
def inproc(monkeypatch_module):
    monkeypatch_module.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    yield


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
