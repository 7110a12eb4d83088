"""The engine's insides: the forward context a model layer reads its attention metadata from,
the connector objects of an in-process engine and of a worker, utility calls to every engine
core (the cache routes use them), and how the multiprocess executor binds CPU workers to cores.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from vllm_hybridcache.compat.registry import checked

logger = logging.getLogger("vllm_hybridcache")


# --------------------------------------------------------------------- model layers


@checked("0.32.0", "0.33.0")
def register_forward_layer(vllm_config: Any, name: str, layer: Any) -> None:
    """Register a custom layer in the config's static forward context under `name`.

    vLLM binds KV-cache tensors to, and builds per-layer attention metadata for, the layers in
    `compilation_config.static_forward_context` (its own Attention and Mamba layers register
    themselves the same way in `__init__`). A duplicate name is a model bug: ValueError.
    """
    ctx = vllm_config.compilation_config.static_forward_context
    if name in ctx:
        raise ValueError(f"Duplicate layer name: {name}")
    ctx[name] = layer


@checked("0.32.0", "0.33.0")
def forward_layers(vllm_config: Any) -> dict[str, Any]:
    """Layer name -> layer object of the model this config built (its static forward context).

    The worker side reads each recurrent layer's bound `kv_cache` tensors from it.
    """
    return vllm_config.compilation_config.static_forward_context


@checked("0.32.0", "0.33.0")
def layer_attn_metadata(name: str) -> Any | None:
    """The current forward pass's attention metadata for layer `name`, None if there is none.

    None outside a forward (profiling, dummy runs) and with micro-batching (DBO), where vLLM
    passes a list of per-microbatch dicts that our layers do not consume.
    """
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return None
    attn = get_forward_context().attn_metadata
    return attn.get(name) if isinstance(attn, dict) else None


# --------------------------------------------------------------------- in-process engine


@checked("0.32.0", "0.33.0")
def inproc_scheduler_connector(llm: Any) -> Any:
    """The scheduler-side KV connector of an in-process `vllm.LLM` engine.

    Needs VLLM_ENABLE_V1_MULTIPROCESSING=0: `LLM.llm_engine.engine_core` is then the in-process
    client whose `engine_core` holds the scheduler (`Scheduler.get_kv_connector()` is public,
    the path to the scheduler is not).
    """
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    if core is None:
        raise RuntimeError("the engine core runs in another process; set "
                           "VLLM_ENABLE_V1_MULTIPROCESSING=0 to reach the connector")
    return core.scheduler.get_kv_connector()


@checked("0.32.0", "0.33.0")
def worker_connector() -> Any:
    """This process's worker-side KV connector (vLLM's public kv-transfer group accessor)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group()


# --------------------------------------------------------------------- engine utility calls


@checked("0.32.0", "0.33.0")
def expose_connector_utility(name: str, fn: Callable[[Any, dict], Any]) -> None:
    """Make `fn(scheduler_connector, request)` callable from the API server as utility `name`.

    Why: `POST /v1/cache/clear?tier=` must reach the cache in the engine process with its
    arguments, and vLLM 0.32.0's only public route there, `reset_prefix_cache(reset_connector=
    True)`, takes none. vLLM 0.32.0 runs a client's utility call as the EngineCore method of
    that name (`EngineCoreProc._handle_client_request`, looked up with getattr), so we add one
    method to EngineCore; it runs on the engine's busy-loop thread, the scheduler's thread,
    which is the only thread that may touch the cache. Checked on vLLM 0.32.0: the method
    takes one plain argument (utility arguments are checked against its signature), and the
    connector is reached through `EngineCore.scheduler.get_kv_connector()`.
    """
    from vllm.v1.engine.core import EngineCore

    def utility(core: Any, request: dict) -> Any:
        return fn(core.scheduler.get_kv_connector(), request)

    utility.__name__ = name
    setattr(EngineCore, name, utility)


@checked("0.32.0", "0.33.0")
async def call_connector_utility(engine_client: Any, name: str, request: dict) -> list[Any]:
    """Call utility `name` (see expose_connector_utility) on every engine; one result each.

    vLLM 0.32.0's `AsyncLLM.engine_core` is the multiprocess client whose
    `call_utility_all_async` sends a utility call to every engine core it manages. Raises
    NotImplementedError when the client has no such path (another engine client type).
    """
    core = getattr(engine_client, "engine_core", None)
    call_all = getattr(core, "call_utility_all_async", None)
    if call_all is None:
        raise NotImplementedError(f"{type(engine_client).__name__} cannot call engine utilities")
    return list(await call_all(name, request))


# --------------------------------------------------------------------- CPU worker binding


class _WithoutConnector:
    """A VllmConfig as `OMPProcessManager` should read it for our connector: every attribute
    the config's own, but no `kv_transfer_config`."""

    def __init__(self, config: Any) -> None:
        self._config = config

    def __getattr__(self, name: str) -> Any:
        if name == "kv_transfer_config":
            return None
        return getattr(self._config, name)


@checked("0.32.0", "0.33.0")
def reserve_cpus_as_without_connector(connectors: frozenset[str]) -> bool:
    """On vLLM's CPU platform, bind a worker running one of `connectors` (our KV connector)
    as vLLM binds a worker without a KV connector.

    Why: vLLM's `OMPProcessManager` (vllm/utils/ompmultiprocessing.py, built by the
    multiprocess executor before it starts each CPU worker) reserves `local_world_size` cores
    for the engine-core process, which busy-polls its workers' replies, and gives the rest to
    the workers' OpenMP threads; whenever `kv_transfer_config` is set it reserves as many
    again, "for nixl_connector under p/d case" (a transfer thread). Our connector has no such
    thread: its work runs on the scheduler's and the workers' own threads. The extra
    reservation then costs a large host a core of OpenMP threads, and on a small one it cannot
    be met at all: vLLM gives up reserving and binds the worker's OpenMP threads to every
    core, the polling engine-core process among them. On the 2-core test host a request of
    256 greedy tokens on qwen3-next-tiny then took 2.76x native vLLM's time, and 0.98x with the
    reservation vLLM makes without a connector (docs/benchmarks/decode.md). The wrapped
    constructor computes the
    binding from the config as if no connector were set when the connector is one of ours;
    `VLLM_CPU_NUM_OF_RESERVED_CPU`, read inside, still overrides both. Returns False when
    already installed.
    """
    from vllm.utils.ompmultiprocessing import OMPProcessManager

    original = OMPProcessManager.__init__
    if getattr(original, "_hybridcache_reserve", False):
        return False

    def __init__(self: Any, config: Any) -> None:
        kv = getattr(config, "kv_transfer_config", None)
        if kv is not None and getattr(kv, "kv_connector", None) in connectors:
            config = _WithoutConnector(config)
        original(self, config)

    __init__._hybridcache_reserve = True  # type: ignore[attr-defined]
    __init__._hybridcache_original = original  # type: ignore[attr-defined]
    OMPProcessManager.__init__ = __init__
    return True
