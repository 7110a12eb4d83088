"""Lower tiers by name: how each one is opened on the scheduler side, and its worker handler.

In the spirit of vLLM's OffloadingSpecFactory: a tier registers two import paths under its
name (a Tier value), so the adapter opens and drives tiers without importing or naming any of
them, and a tier's modules load only when it is used (the cluster tier's Ray stays unimported
without a cluster). `open` is called with an `OpenContext` (adapter/composition.py) and returns
a LowerTier (core/tiers/lower.py) or None when the settings do not ask for it; the handler is a
TierHandler class (core/tiers/handler.py), created in a worker by the first plan that carries
that tier's operations. Tiers are searched in registration order.
"""

from __future__ import annotations

import importlib
from typing import Any, NamedTuple

__all__ = ["TierEntry", "handler_class", "register_tier", "registered", "resolve"]


class TierEntry(NamedTuple):
    name: str
    open: str      # "module:function" -> LowerTier | None
    handler: str   # "module:Class" (a TierHandler)


_TIERS: dict[str, TierEntry] = {}


def register_tier(name: str, open: str, handler: str) -> None:
    """Register a lower tier; a name registered twice is an error (two tiers, one plan key)."""
    if name in _TIERS:
        raise ValueError(f"a lower tier named {name!r} is registered already")
    for path in (open, handler):
        if ":" not in path:
            raise ValueError(f"{path!r} is not a 'module:attribute' path")
    _TIERS[name] = TierEntry(name, open, handler)


def registered() -> list[TierEntry]:
    return list(_TIERS.values())


def resolve(path: str) -> Any:
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


def handler_class(name: str) -> Any:
    """The worker handler class of the lower tier `name`; KeyError for an unknown name."""
    return resolve(_TIERS[name].handler)


register_tier("disk", "vllm_hybridcache.adapter.disk_setup:open_disk",
              "vllm_hybridcache.core.disk.handler:DiskHandler")
register_tier("cluster", "vllm_hybridcache.cluster.engine:open_cluster",
              "vllm_hybridcache.cluster.handler:ClusterHandler")
