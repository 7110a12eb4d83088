"""`/v1/cache/stats` and `/v1/cache/clear`: an endpoint plugin (`vllm.endpoint_plugins`).

Both routes live under /v1, so vLLM's `--api-key` middleware guards them like every OpenAI
route; on top of it, serving/admin.py decides what needs the admin key
(`X-Hybridcache-Admin-Key`): clearing every tenant's links does, a tenant's own clear
(`{"cache_salt": ...}` in the body) does not, and only the admin's stats carry the domain count
(docs/security.md). Stats come from the snapshots the connector's stats carry to this process
(see adapter/stats.py). Clearing goes to every engine as a utility call
(`adapter.connector.clear_utility`, through compat), so the `tier`, `kind` and tenant asked
for reach the cache and only those links are dropped; the engines answer with the tiers they
have, and a tier or kind they do not have is a 400. Links being restored at that moment leave
lookups at once and their payload when the restore ends, so a clear never breaks a request in
flight.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse

from vllm_hybridcache.serving.admin import ADMIN_HEADER, Access, api_key_set, startup_warnings

logger = logging.getLogger("vllm_hybridcache")

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
    "segmentation": {engine index: mode}, "overhead": {...}}. `tier` is where the bytes live
    (ram), `kind` what kind of link (tree, anchor); a tier's totals are what it holds and
    serves whatever the kind. The mode is `step` (links where a prefill step ends) or `fine`
    (also at 64-aligned positions inside steps, on a split-invariant forward;
    docs/split-invariance.md). `overhead`: the plugin's own seconds by side and phase beside
    the engines' busy seconds, summed over engines, with the plugin's `share` of the step time
    (adapter/overhead.py).
    """
    from vllm_hybridcache.adapter.overhead import share

    tiers: dict[str, dict[str, Any]] = {}
    overhead: dict[str, Any] = {}
    modes = {str(k): d["segmentation"] for k, d in snapshots.items() if "segmentation" in d}
    for data in snapshots.values():
        for tier, kinds in data.get("tiers", {}).items():
            acc = tiers.setdefault(tier, {"kinds": {}})
            for kind, stats in kinds.items():
                _add(acc["kinds"].setdefault(kind, {}), stats)
                _add(acc, stats)
        _add(overhead, data.get("overhead", {}))
    out = {"tiers": tiers, "engines": len(snapshots), "segmentation": modes}
    if overhead:
        out["overhead"] = {**overhead, "share": share(overhead)}
    return out


ADMIN_ONLY_STATS = ("domains",)  # how many domains (tenants x adapters x routes) hold links


def public_stats(agg: dict[str, Any]) -> dict[str, Any]:
    """The aggregate stats without the figures only the admin sees (docs/security.md): the
    number of domains tells how many tenants use the cache; every other figure is a sum over
    all tenants, the operator's dashboard (the same as /metrics)."""
    tiers = {}
    for tier, acc in agg.get("tiers", {}).items():
        kinds = {k: {f: v for f, v in st.items() if f not in ADMIN_ONLY_STATS}
                 for k, st in acc.get("kinds", {}).items()}
        tiers[tier] = {**{f: v for f, v in acc.items() if f not in ADMIN_ONLY_STATS},
                       "kinds": kinds}
    return {**agg, "tiers": tiers}


def _refused(why: str) -> JSONResponse:
    return JSONResponse({"error": why}, status_code=403)


WRONG_KEY = f"wrong admin key in {ADMIN_HEADER} (or this server has no admin key)"


class HybridCacheEndpoints:
    name = "hybridcache_http"
    required_tasks = None

    def __init__(self) -> None:
        self.engine_client = None
        # until init_state runs: guarded, with no admin key (fails closed)
        self.access = Access(api_key=True, admin_digest=None)

    def attach_router(self, app: FastAPI) -> None:
        router = APIRouter()

        @router.get("/v1/cache/stats")
        async def cache_stats(request: Request) -> JSONResponse:
            from vllm_hybridcache.adapter.stats import latest_snapshots

            admin = self.access.admin(request.headers)
            if admin is None:
                return _refused(WRONG_KEY)
            agg = aggregate(latest_snapshots())
            return JSONResponse(agg if admin else public_stats(agg))

        @router.post("/v1/cache/clear")
        async def cache_clear(request: Request, tier: str = ALL, kind: str = ALL
                              ) -> JSONResponse:
            admin = self.access.admin(request.headers)
            if admin is None:
                return _refused(WRONG_KEY)
            cache_salt, problem = await _salt_of(request)
            if problem is not None:
                return JSONResponse({"error": problem}, status_code=400)
            if not admin and cache_salt is None:
                return _refused(f"clearing every tenant's links needs the admin key in "
                                f"{ADMIN_HEADER}; a tenant clears its own links with "
                                f"{{\"cache_salt\": ...}} in the body")
            if not admin and cache_salt == "":
                return _refused(f"the links of requests without a cache_salt are shared by "
                                f"every such client: clearing them needs the admin key in "
                                f"{ADMIN_HEADER}")
            # the engine client comes through the plugin interface's init_state (vLLM calls it
            # for every endpoint plugin; None on an engine-less render server)
            client = self.engine_client
            if client is None:
                return JSONResponse({"error": "no engine behind this server"}, status_code=503)
            return await clear(client, tier, kind, cache_salt)

        app.include_router(router)

    async def init_state(self, engine_client, state, args) -> None:
        """The engine client, and the credentials this server was started with: vLLM's API
        key (`args`) and the admin key (config.admin_key; an unusable one stops the start-up,
        SettingsError). Says at start-up who may clear."""
        from vllm_hybridcache.compat import require_supported_vllm
        from vllm_hybridcache.config import admin_key, load_settings

        require_supported_vllm()
        self.engine_client = engine_client
        settings = load_settings(_our_extra_config(args))
        self.access = Access.of(api_key_set(args), admin_key(settings))
        for line in startup_warnings(self.access,
                                     os.environ.get("VLLM_SERVER_DEV_MODE", "0") == "1"):
            logger.warning(line)


async def _salt_of(request: Request) -> tuple[str | None, str | None]:
    """(the tenant's `cache_salt` from the JSON body, or None for every tenant; a problem to
    answer with a 400). Never from the query string: a URL lands in access logs (uvicorn's,
    a proxy's), and a salt is the tenant's secret."""
    if "cache_salt" in request.query_params:
        return None, ("send cache_salt in the JSON body ({\"cache_salt\": ...}), not in the "
                      "query string: URLs are written to access logs")
    raw = await request.body()
    if not raw.strip():
        return None, None
    try:
        body = json.loads(raw)
    except ValueError:
        return None, "the body must be a JSON object"
    if not isinstance(body, dict):
        return None, "the body must be a JSON object"
    unknown = sorted(set(body) - {"cache_salt"})
    if unknown:
        return None, f"unknown field(s) {unknown}; the body may carry cache_salt only"
    salt = body.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        return None, "cache_salt must be a string"
    return salt, None


def _our_extra_config(args) -> dict[str, Any]:
    """The plugin's settings given in `--kv-transfer-config` (when its connector is ours)."""
    from vllm_hybridcache.adapter.connector import CONNECTOR_NAME

    cfg = getattr(args, "kv_transfer_config", None)
    if cfg is None or getattr(cfg, "kv_connector", None) != CONNECTOR_NAME:
        return {}
    return dict(getattr(cfg, "kv_connector_extra_config", None) or {})


async def clear(client: Any, tier: str, kind: str, cache_salt: str | None = None
                ) -> JSONResponse:
    """Ask every engine to clear `tier`/`kind` (only the tenant of `cache_salt` when given);
    400 names what the engines have instead."""
    from vllm_hybridcache.adapter.connector import CLEAR_UTILITY
    from vllm_hybridcache.compat import call_connector_utility

    request: dict[str, Any] = {"tier": tier, "kind": kind}
    if cache_salt is not None:
        request["cache_salt"] = cache_salt
    try:
        answers = await call_connector_utility(client, CLEAR_UTILITY, request)
    except NotImplementedError as e:
        return JSONResponse({"error": f"cannot reach the engines' cache: {e}"}, status_code=501)
    errors = [a["error"] for a in answers if "error" in a]
    have = sorted({t for a in answers for t in a.get("tiers", ())})
    if errors:
        unknown = tier not in (*have, ALL)
        msg = (f"unknown tier {tier!r}; use one of {[*have, ALL]}" if unknown else errors[0])
        return JSONResponse({"error": msg, "tiers": have}, status_code=400)
    out = {"cleared": True, "links": sum(a["cleared"] for a in answers), "tier": tier,
           "kind": kind, "tiers": have}
    if cache_salt is not None:
        out["tenant"] = True  # only that tenant's links (the salt is not echoed)
    return JSONResponse(out)


def plugin() -> HybridCacheEndpoints:
    """Entry point for `vllm.endpoint_plugins`."""
    return HybridCacheEndpoints()
