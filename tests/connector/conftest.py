"""One in-process vLLM engine per module (engine core and worker in this process), so tests can
reach the scheduler-side tree and the worker-side store directly."""

from __future__ import annotations

import os

import pytest


def make_llm(model_path, extra: dict | None = None, plugin: bool = True, **kw):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    args = dict(model=str(model_path), max_model_len=8192, max_num_batched_tokens=2048,
                enforce_eager=True, seed=0)
    args.update(kw)
    if plugin:
        from vllm_hybridcache.serving.flags import CONNECTOR_CONFIG, SCHEDULER_CLS

        cfg = {k: v for k, v in CONNECTOR_CONFIG.items() if k != "kv_connector_module_path"}
        args.update(
            enable_prefix_caching=False,
            scheduler_cls=SCHEDULER_CLS,
            kv_transfer_config=KVTransferConfig(**cfg, kv_connector_extra_config=extra or {}),
        )
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


def engine_parts(llm):
    """(scheduler-side SchedulerSide, worker-side WorkerSide) of an in-process engine."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    core = llm.llm_engine.engine_core.engine_core
    return core.scheduler.connector._sched, get_kv_transfer_group()._worker


os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
