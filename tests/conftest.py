"""Shared fixtures: embedded models are written once per machine (user cache), engines once per
module. Tests never download anything."""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

# Triton kernels are tested on the CPU through Triton's interpreter, which `@triton.jit` reads
# when a function is decorated. Set it before anything in this process imports a kernel module,
# so every test folder sees the same (interpreted) kernels; vLLM's own Triton detection is
# unaffected (it still finds no CPU backend).
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# The disk tier's default key file lives under XDG_CONFIG_HOME (docs/security.md): in tests, a
# private folder of this run, inherited by every engine and server the tests start, so they
# share one default key and never write into the user's own config folder.
if "HYBRIDCACHE_TEST_CONFIG_HOME" not in os.environ:
    import tempfile

    os.environ["HYBRIDCACHE_TEST_CONFIG_HOME"] = tempfile.mkdtemp(prefix="hybridcache-xdg-")
os.environ["XDG_CONFIG_HOME"] = os.environ["HYBRIDCACHE_TEST_CONFIG_HOME"]

# Test-only switch: `HYBRIDCACHE_TEST_CPU_ISA=avx2` runs the AVX2 kernels an AVX2-only x86-64
# machine runs, on an AVX-512/AMX machine: in this process (set before anything imports vLLM's
# kernels; this file loads first) and, through tests/isa_emulation/sitecustomize.py on
# PYTHONPATH, in every process the tests spawn (engine cores, workers, servers). Production code
# has no such switch.
_ISA_DIR = str(Path(__file__).resolve().parent / "isa_emulation")
_EMULATED_ISA = os.environ.get("HYBRIDCACHE_TEST_CPU_ISA", "")
if _EMULATED_ISA:
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (_ISA_DIR, os.environ.get("PYTHONPATH", "")) if p)
    sys.path.insert(0, _ISA_DIR)
    import sitecustomize

    sitecustomize.apply()


def emulated_cpu_isa() -> str | None:
    """The ISA `HYBRIDCACHE_TEST_CPU_ISA` emulates in this process (None: the machine's own)."""
    return _EMULATED_ISA or None


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


def engine_state_left() -> list[str]:
    """What an engine built in this process leaves in vLLM's process-wide state until it is shut
    down: the distributed groups, the worker-side KV connector, the frozen environment cache."""
    from vllm import envs
    from vllm.distributed import parallel_state
    from vllm.distributed.kv_transfer import kv_transfer_state

    left = [name for name in ("_WORLD", "_TP", "_PP", "_DP", "_EP", "_DCP", "_PCP")
            if getattr(parallel_state, name, None) is not None]
    if kv_transfer_state._KV_CONNECTOR_AGENT is not None:
        left.append("kv connector agent")
    if envs._is_envs_cache_enabled():
        left.append("envs cache")
    return left


@contextmanager
def vllm_engine(model_path, **kwargs) -> Iterator:
    """A `vllm.LLM` for a block of tests, shut down explicitly when the block ends.

    Every engine of the test suite is built here. With `VLLM_ENABLE_V1_MULTIPROCESSING=0` the
    engine core and its worker live in this process and put their state in vLLM's globals (the
    distributed groups, the worker's KV connector, the environment cache); only
    `EngineCore.shutdown` takes it down again. vLLM calls that from a `weakref.finalize` on the
    engine client, which runs whenever the client happens to be collected: a reference kept by
    a failed test's traceback (or any cycle) delays it until a later `gc.collect()`, typically
    inside the next module's engine start-up, where it destroys the *new* engine's groups
    ("tensor model parallel group is not initialized"). Shutting down here detaches that
    finalizer, so no engine can reach into the next one and module order never matters.
    """
    from vllm import LLM

    left = engine_state_left()
    assert not left, f"an earlier engine was not shut down (left: {left}); use vllm_engine"
    try:
        llm = LLM(model=str(model_path), **kwargs)
    except BaseException:
        _reset_engine_state()           # a failed start-up must not poison the next engine
        raise
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        _reset_engine_state()
        left = engine_state_left()
        assert not left, f"engine shutdown left {left}"


def _reset_engine_state() -> None:
    """Take down what a half-built engine left behind (a no-op after a clean shutdown)."""
    from vllm.distributed.kv_transfer import ensure_kv_transfer_shutdown
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    ensure_kv_transfer_shutdown()
    cleanup_dist_env_and_memory()
