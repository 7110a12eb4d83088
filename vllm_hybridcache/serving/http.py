"""`/v1/cache/stats` and `/v1/cache/clear`: an endpoint plugin (`vllm.endpoint_plugins`).

Both routes live under /v1, so vLLM's `--api-key` middleware guards them like every OpenAI
route: with an API key set, clearing the cache needs it (admin). Stats come from the snapshots
the connector's stats carry to this process (see adapter/stats.py); clearing goes through the
public `EngineClient.reset_prefix_cache(reset_connector=True)`, which reaches the connector's
`reset_cache()` in the engine process. Links being restored at that moment stay until their
restore ends, so a clear never breaks a request in flight.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse

TIERS = ("ram",)


def aggregate(snapshots: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Sum the tiers of every engine (counters and gauges alike add across engines)."""
    tiers: dict[str, dict[str, Any]] = {}
    for data in snapshots.values():
        for tier, stats in data.get("tiers", {}).items():
            acc = tiers.setdefault(tier, {})
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
                    h["counts"] = [a + b for a, b in zip(h["counts"], value["counts"],
                                                         strict=True)]
                    h["sum"] += value["sum"]
                    h["count"] += value["count"]
    return {"tiers": tiers, "engines": len(snapshots)}


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
        async def cache_clear(request: Request, tier: str = "all") -> JSONResponse:
            if tier not in (*TIERS, "all"):
                return JSONResponse(
                    {"error": f"unknown tier {tier!r}; use one of {[*TIERS, 'all']}"},
                    status_code=400)
            client = self.engine_client or getattr(request.app.state, "engine_client", None)
            if client is None:
                return JSONResponse({"error": "no engine behind this server"}, status_code=503)
            ok = await client.reset_prefix_cache(reset_connector=True)
            return JSONResponse({"cleared": bool(ok), "tier": tier},
                                status_code=200 if ok else 409)

        app.include_router(router)

    async def init_state(self, engine_client, state, args) -> None:
        self.engine_client = engine_client


def plugin() -> HybridCacheEndpoints:
    """Entry point for `vllm.endpoint_plugins`."""
    return HybridCacheEndpoints()
