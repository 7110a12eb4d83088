"""The cluster's one OpenAI port: an ASGI app that routes each request to a replica's
`vllm serve`, retries what failed before its first byte, sums the replicas' cache stats and
labels their metrics.

- **OpenAI routes** (`/v1/chat/completions`, `/v1/completions`, every other path): the body
  goes unchanged to the replica the Router picks (routing.py: the conversation's owner by the
  `x-session-id` header or prefix affinity, bounded by load; `x-hybridcache-replica: NAME`
  pins a live replica). The response streams back as the replica sends it, with the replica's
  name in `x-hybridcache-replica`. A replica that cannot be reached, drops the connection or
  answers 5xx before the first byte of its response is left out and the request goes to the
  next one (a generation is only ever streamed from one replica, so no token is mixed or
  repeated); a replica that fails after the first byte ends that response.
- `GET /v1/cache/stats`: every replica's stats summed (the shape of a single server's, plus
  `replicas`: each one's own stats, or why it did not answer, and `routing`: the Router's
  counts, among them `owner_share`, the share of turns with a known owner that went to it).
- `POST /v1/cache/clear`: sent to every live replica, with its query, its body (a tenant's
  clear names the salt there) and the caller's `Authorization` and `X-Hybridcache-Admin-Key`
  headers (as for the stats).
- `GET /metrics`: every replica's Prometheus page with a `replica` label (relabel.py) and the
  front's routing counters.
- Liveness: a background loop asks `alive(name)` (the launcher: is the replica's Ray actor and
  its server process alive); a replica found dead is marked down and `on_down(name)` runs (the
  launcher removes its links from the cluster directory). A reachable replica marked down after
  a transport error comes back once its `/health` answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily

from vllm_hybridcache.serving.admin import ADMIN_HEADER
from vllm_hybridcache.serving.http import aggregate

from .relabel import merge
from .routing import Router, prefix_keys

logger = logging.getLogger("vllm_hybridcache")

SESSION_HEADER = "x-session-id"
REPLICA_HEADER = "x-hybridcache-replica"
OUTCOME_HEADER = "x-hybridcache-route"
_DROP_REQUEST = {"host", "content-length", "connection", "keep-alive", "transfer-encoding",
                 "accept-encoding", "upgrade", REPLICA_HEADER}
_KEEP_RESPONSE = ("content-type", "content-encoding")
_NOT_TURNS = ("/v1/models", "/health", "/version", "/ping", "/tokenize", "/detokenize")


class _Retry(Exception):
    pass


def sum_stats(per_replica: Mapping[str, dict[str, Any]]) -> dict[str, Any]:
    """Sum the `/v1/cache/stats` answers of several servers (each already summed over its
    engines) into the same shape."""
    raw = {i: {"tiers": {t: v.get("kinds", {}) for t, v in s.get("tiers", {}).items()}}
           for i, s in enumerate(per_replica.values())}
    out = aggregate(raw)
    out["engines"] = sum(int(s.get("engines", 0)) for s in per_replica.values())
    # anything else a server reports per engine (e.g. its segmentation) stays per replica
    for key in {k for s in per_replica.values() for k in s} - {"tiers", "engines"}:
        out[key] = {name: s[key] for name, s in per_replica.items() if key in s}
    return out


class Front:
    """Routing, retries, fan-out and liveness over named replicas (name -> base URL)."""

    def __init__(self, endpoints: Mapping[str, str], router: Router,
                 alive: Callable[[str], Awaitable[bool]],
                 on_down: Callable[[str], Awaitable[None]],
                 health_interval_s: float = 2.0, connect_timeout_s: float = 10.0,
                 client: httpx.AsyncClient | None = None) -> None:
        self.endpoints = dict(endpoints)
        self.router = router
        self.alive = alive
        self.on_down = on_down
        self.health_interval_s = health_interval_s
        self.connect_timeout_s = connect_timeout_s
        self.client = client  # made on first use (tests pass one with a mock transport)
        self._health: asyncio.Task | None = None
        self.dead: set[str] = set()  # replicas found dead (on_down ran for them)
        self._tasks: set[asyncio.Task] = set()

    # ------------------------------------------------------------------ liveness
    async def check(self, name: str) -> None:
        """Settle one replica's state: dead -> down (once, with on_down); a live one that was
        marked down is re-admitted when its /health answers."""
        try:
            alive = await self.alive(name)
        except Exception as e:  # the check itself failed: decide nothing
            logger.warning("hybridcache front: liveness of %s unknown: %s", name, e)
            return
        if not alive:
            self.router.set_up(name, False)
            if name not in self.dead:
                logger.warning("hybridcache front: replica %s is dead; its links leave the "
                               "directory", name)
                self.dead.add(name)
                await self.on_down(name)
            return
        if not self.router.up[name]:
            try:
                r = await self._http().get(self.endpoints[name] + "/health", timeout=5)
                if r.status_code == 200:
                    self.router.set_up(name, True)
            except httpx.HTTPError:
                pass

    def _later(self, coro) -> None:
        """Run `coro` beside the request (a reference is kept until it ends)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _ensure_health(self) -> None:
        """Start the liveness loop once (from the app's lifespan, or the first request where
        the ASGI host runs no lifespan)."""
        if self._health is None or self._health.done():
            self._health = asyncio.get_running_loop().create_task(self._health_loop())

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            await asyncio.gather(*(self.check(n) for n in self.endpoints))

    def _http(self) -> httpx.AsyncClient:
        if self.client is None:
            self.client = httpx.AsyncClient(
                timeout=httpx.Timeout(None, connect=self.connect_timeout_s),
                limits=httpx.Limits(max_connections=1024, max_keepalive_connections=64))
        return self.client

    # ------------------------------------------------------------------ proxying
    async def proxy(self, request: Request, path: str) -> Response:
        self._ensure_health()
        body = await request.body()
        payload: Any = None
        if body and request.headers.get("content-type", "").startswith("application/json"):
            with contextlib.suppress(ValueError):
                payload = json.loads(body)
        turn = request.method == "POST" and not path.startswith(_NOT_TURNS)
        keys = prefix_keys(payload) if turn else []
        session = request.headers.get(SESSION_HEADER) if turn else None
        forced = request.headers.get(REPLICA_HEADER)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _DROP_REQUEST}
        tried: list[str] = []
        while True:
            d = self.router.choose(session, keys, tried, forced)
            if d is None:
                return JSONResponse({"error": {"message": "no replica could take the request",
                                               "type": "ServiceUnavailable", "code": 503,
                                               "tried": tried}}, status_code=503)
            tried.append(d.replica)
            url = self.endpoints[d.replica] + path
            resp = None
            try:
                req = self._http().build_request(request.method, url, content=body,
                                                 headers=headers,
                                                 params=request.query_params.multi_items())
                resp = await self._http().send(req, stream=True)
                if resp.status_code >= 500:
                    raise _Retry(f"status {resp.status_code}")
                chunks = resp.aiter_raw()
                try:
                    first = await chunks.__anext__()
                except StopAsyncIteration:
                    first = b""
            except (httpx.HTTPError, _Retry) as e:
                logger.warning("hybridcache front: %s %s failed on %s before its first byte "
                               "(%s: %s); retrying elsewhere", request.method, path, d.replica,
                               type(e).__name__, e)
                if resp is not None:
                    await resp.aclose()
                self.router.finished(d.replica, ok=False)
                if isinstance(e, httpx.TransportError):
                    self.router.set_up(d.replica, False)
                    self._later(self.check(d.replica))
                continue
            ok_status = resp.status_code < 400
            return StreamingResponse(
                self._rest(resp, first, chunks, d.replica, ok_status, session, keys),
                status_code=resp.status_code,
                headers={**{k: resp.headers[k] for k in _KEEP_RESPONSE if k in resp.headers},
                         REPLICA_HEADER: d.replica, OUTCOME_HEADER: d.outcome.value})

    async def _rest(self, resp: httpx.Response, first: bytes, chunks, replica: str,
                    ok_status: bool, session: str | None, keys: list[bytes]):
        ok = False
        try:
            if first:
                yield first
            async for chunk in chunks:
                yield chunk
            ok = ok_status
        except httpx.HTTPError as e:
            logger.warning("hybridcache front: replica %s failed mid-response: %s", replica, e)
            self.router.set_up(replica, False)
            self._later(self.check(replica))
        finally:
            await resp.aclose()
            self.router.finished(replica, ok, session, keys)

    # ------------------------------------------------------------------ fan-out
    async def _each(self, method: str, path: str, request: Request, **kw
                    ) -> dict[str, httpx.Response | Exception]:
        self._ensure_health()
        # the API key for vLLM's middleware, the admin key for the cache routes, and the type
        # of a body passed on (a tenant's clear names its salt there)
        auth = {k: v for k, v in request.headers.items()
                if k.lower() in ("authorization", ADMIN_HEADER.lower(), "content-type")}
        live = [n for n in self.endpoints if self.router.up[n]]

        async def one(name: str) -> httpx.Response | Exception:
            try:
                return await self._http().request(method, self.endpoints[name] + path,
                                                  headers=auth, timeout=60, **kw)
            except httpx.HTTPError as e:
                return e

        answers = await asyncio.gather(*(one(n) for n in live))
        out: dict[str, httpx.Response | Exception] = dict(zip(live, answers, strict=True))
        for n in self.endpoints:
            out.setdefault(n, RuntimeError("replica down"))
        return out

    async def cache_stats(self, request: Request) -> Response:
        answers = await self._each("GET", "/v1/cache/stats", request)
        good: dict[str, dict[str, Any]] = {}
        listed: dict[str, Any] = {}
        for name, a in answers.items():
            if isinstance(a, httpx.Response) and a.status_code == 200:
                good[name] = listed[name] = a.json()
            elif isinstance(a, httpx.Response):
                if a.status_code in (401, 403):
                    return Response(a.content, status_code=a.status_code,
                                    media_type=a.headers.get("content-type"))
                listed[name] = {"error": f"status {a.status_code}"}
            else:
                listed[name] = {"error": f"{type(a).__name__}: {a}"}
        return JSONResponse({**sum_stats(good), "replicas": listed,
                             "routing": self.router.snapshot()})

    async def cache_clear(self, request: Request) -> Response:
        answers = await self._each("POST", "/v1/cache/clear", request,
                                   params=request.query_params.multi_items(),
                                   content=await request.body())
        per: dict[str, Any] = {}
        links = 0
        status = 200
        for name, a in answers.items():
            if isinstance(a, httpx.Response):
                try:
                    per[name] = a.json()
                except ValueError:
                    per[name] = {"error": a.text}
                if a.status_code != 200:
                    status = max(status, a.status_code)
                else:
                    links += int(per[name].get("links", 0))
            else:
                per[name] = {"error": f"{type(a).__name__}: {a}"}
        return JSONResponse({"cleared": status == 200, "links": links, "replicas": per},
                            status_code=status)

    def _own_metrics(self) -> list:
        snap = self.router.snapshot()
        routed = CounterMetricFamily("vllm:hybridcache_cluster_routed",
                                     "Requests routed by the cluster front, by outcome "
                                     "(owner, passed_over, owner_down, no_owner, forced, "
                                     "round_robin).", labels=["outcome"])
        for o, n in snap["outcomes"].items():
            routed.add_metric([o], n)
        retries = CounterMetricFamily("vllm:hybridcache_cluster_retries",
                                      "Request attempts retried on another replica after a "
                                      "failure before the first byte.")
        retries.add_metric([], snap["retries"])
        up = GaugeMetricFamily("vllm:hybridcache_cluster_replica_up",
                               "1 when the front routes to the replica.", labels=["replica"])
        for r, s in snap["replicas"].items():
            up.add_metric([r], 1.0 if s["up"] else 0.0)
        return [routed, retries, up]

    async def metrics(self, request: Request) -> Response:
        answers = await self._each("GET", "/metrics", request)
        pages = {n: a.text for n, a in answers.items()
                 if isinstance(a, httpx.Response) and a.status_code == 200}
        return Response(merge(pages, self._own_metrics()),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    # ------------------------------------------------------------------ the app
    def app(self) -> FastAPI:
        @contextlib.asynccontextmanager
        async def lifespan(_: FastAPI):
            self._ensure_health()
            try:
                yield
            finally:
                if self._health is not None:
                    self._health.cancel()
                if self.client is not None:
                    await self.client.aclose()
                    self.client = None

        app = FastAPI(title="vllm-hybridcache cluster", lifespan=lifespan)

        @app.get("/health")
        async def health() -> Response:
            up = [n for n in self.endpoints if self.router.up[n]]
            return JSONResponse({"replicas_up": up}, status_code=200 if up else 503)

        app.add_api_route("/v1/cache/stats", self.cache_stats, methods=["GET"])
        app.add_api_route("/v1/cache/clear", self.cache_clear, methods=["POST"])
        app.add_api_route("/metrics", self.metrics, methods=["GET"])

        @app.api_route("/{path:path}", methods=["GET", "POST", "DELETE"])
        async def forward(path: str, request: Request) -> Response:
            return await self.proxy(request, "/" + path)

        return app
