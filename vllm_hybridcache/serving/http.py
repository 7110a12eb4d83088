"""`/v1/cache/stats` and `/v1/cache/clear`: an endpoint plugin (`vllm.endpoint_plugins`).

Both routes live under /v1, so vLLM's `--api-key` middleware guards them like every OpenAI
route: with an API key set, clearing the cache needs it (admin). Stats come from the snapshots
the connector's stats carry to this process (see adapter/stats.py). Clearing goes to every
engine as a utility call (`adapter.connector.clear_utility`, through compat.py), so the `tier`
and `kind` asked for reach the cache and only those links are dropped; the engines answer with
the tiers they have, and a tier or kind they do not have is a 400. Links being restored at
that moment leave lookups at once and their payload when the restore ends, so a clear never
breaks a request in flight.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, FastAPI
from fastapi.responses import JSONResponse

ALL = "all"


def _add(acc: dict[str, Any], stats: dict[str, Any]) -> None:
    """Add one CacheStats (as builtins) into `acc`: numbers, reason maps and histograms."""
    for key, value in stats.items():
        if isinstance(value, bool):
            continue
        if isinstance(value, (int, float)):
            acc[key] = acc.get(key, 0) + value
        elif isinstance(value, dict) and "counts" not in value:
            sub = acc.setdefault(key, {})
            for k, v in value.items():
                sub[k] = sub.get(k, 0) + v
        elif isinstance(value, dict):  # histogram
            h = acc.setdefault(key, {"bounds": value["bounds"],
                                     "counts": [0] * len(value["counts"]),
                                     "sum": 0.0, "count": 0})
            h["counts"] = [a + b for a, b in zip(h["counts"], value["counts"], strict=True)]
            h["sum"] += value["sum"]
            h["count"] += value["count"]


def aggregate(snapshots: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Sum every engine's stats (counters and gauges alike add across engines).

    Shape: {"tiers": {tier: {<totals over kinds>, "kinds": {kind: {...}}}}, "engines": n,
    "segmentation": {engine index: mode}}. `tier` is where the bytes live (ram), `kind` what
    kind of link (tree, anchor); a tier's totals are what it holds and serves whatever the
    kind. The mode is `step` (links where a prefill step ends) or `fine` (also at 64-aligned
    positions inside steps, on a split-invariant forward; docs/split-invariance.md).
    """
    tiers: dict[str, dict[str, Any]] = {}
    modes = {str(k): d["segmentation"] for k, d in snapshots.items() if "segmentation" in d}
    for data in snapshots.values():
        for tier, kinds in data.get("tiers", {}).items():
            acc = tiers.setdefault(tier, {"kinds": {}})
            for kind, stats in kinds.items():
                _add(acc["kinds"].setdefault(kind, {}), stats)
                _add(acc, stats)
    return {"tiers": tiers, "engines": len(snapshots), "segmentation": modes}


class HybridCacheEndpoints:
    name = "hybridcache_http"
    required_tasks = None

    def __init__(self) -> None:
        self.engine_client = None

    def attach_router(self, app: FastAPI) -> None:
        router = APIRouter()

        @router.get("/v1/cache/stats")
        async def cache_stats() -> JSONResponse:
            from vllm_hybridcache.adapter.stats import latest_snapshots

            return JSONResponse(aggregate(latest_snapshots()))

        @router.post("/v1/cache/clear")
        async def cache_clear(tier: str = ALL, kind: str = ALL) -> JSONResponse:
            # the engine client comes through the plugin interface's init_state (vLLM calls it
            # for every endpoint plugin; None on an engine-less render server)
            client = self.engine_client
            if client is None:
                return JSONResponse({"error": "no engine behind this server"}, status_code=503)
            return await clear(client, tier, kind)

        app.include_router(router)

    async def init_state(self, engine_client, state, args) -> None:
        self.engine_client = engine_client


async def clear(client: Any, tier: str, kind: str) -> JSONResponse:
    """Ask every engine to clear `tier`/`kind`; 400 names what the engines have instead."""
    from vllm_hybridcache.adapter.connector import CLEAR_UTILITY
    from vllm_hybridcache.compat import call_connector_utility

    try:
        answers = await call_connector_utility(client, CLEAR_UTILITY,
                                               {"tier": tier, "kind": kind})
    except NotImplementedError as e:
        return JSONResponse({"error": f"cannot reach the engines' cache: {e}"}, status_code=501)
    errors = [a["error"] for a in answers if "error" in a]
    have = sorted({t for a in answers for t in a.get("tiers", ())})
    if errors:
        unknown = tier not in (*have, ALL)
        msg = (f"unknown tier {tier!r}; use one of {[*have, ALL]}" if unknown else errors[0])
        return JSONResponse({"error": msg, "tiers": have}, status_code=400)
    return JSONResponse({"cleared": True, "links": sum(a["cleared"] for a in answers),
                         "tier": tier, "kind": kind, "tiers": have})


def plugin() -> HybridCacheEndpoints:
    """Entry point for `vllm.endpoint_plugins`."""
    return HybridCacheEndpoints()
