"""The plugin from the Python API: `vllm.LLM(model, **llm_kwargs(grid=512))`.

`llm_kwargs` returns the same settings `--plugin hybridcache` adds on the command line (the
connector, the segmentation scheduler, vLLM's own prefix caching off), with plugin settings
passed as the connector's extra config.
"""

from __future__ import annotations

from typing import Any

from vllm_hybridcache.compat import (
    inproc_scheduler_connector,
    require_supported_vllm,
    worker_connector,
)
from vllm_hybridcache.config import load_settings
from vllm_hybridcache.serving.flags import CONNECTOR_CONFIG, SCHEDULER_CLS


def llm_kwargs(**settings: Any) -> dict[str, Any]:
    """Keyword arguments for `vllm.LLM` that turn the snapshot cache on (settings validated).

    With the cache off (`budget_bytes=0` or `enabled=False`, here or in the environment) this
    returns no arguments at all: the engine is exactly vLLM without the plugin.
    """
    from vllm.config import KVTransferConfig

    # fail here, with the unsupported vLLM version or the setting's name, not in the engine
    require_supported_vllm()
    if not load_settings(settings).active:
        return {}
    return {
        "enable_prefix_caching": False,
        "scheduler_cls": SCHEDULER_CLS,
        "kv_transfer_config": KVTransferConfig(**CONNECTOR_CONFIG,
                                               kv_connector_extra_config=dict(settings)),
    }


def engine_parts(llm) -> tuple[Any, Any]:
    """(scheduler side, worker side) of an in-process engine's connector, for introspection.

    Needs `VLLM_ENABLE_V1_MULTIPROCESSING=0` (engine core and worker in this process); the
    reach into vLLM's engine goes through `compat`.
    """
    return inproc_scheduler_connector(llm)._sched, worker_connector()._worker
