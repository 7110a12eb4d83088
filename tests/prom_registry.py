"""The plugin's Prometheus collector on a registry of its own, for tests that read its samples.

Why: `HybridCacheProm` registers its metrics on prometheus-client's global registry the way
vLLM's stat loggers do; a test binds every metric type to a fresh `CollectorRegistry` so its
samples start at zero and never meet another test's.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any


def private_prom() -> tuple[Any, Any]:
    """(a `HybridCacheProm` for one engine labelled "0", the registry it writes to)."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    from vllm_hybridcache.adapter.stats import HybridCacheProm

    reg = CollectorRegistry()

    def bind(cls):
        return lambda **kw: cls(registry=reg, **kw)

    types = {Gauge: bind(Gauge), Counter: bind(Counter), Histogram: bind(Histogram)}
    prom = HybridCacheProm(SimpleNamespace(kv_transfer_config=None), types, ["engine"],
                           {0: ["0"]})
    return prom, reg
