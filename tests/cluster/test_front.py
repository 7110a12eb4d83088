"""The cluster front without replicas: httpx's mock transport stands in for two `vllm serve`
replicas. Retries before the first byte (and none after an answer), a dead replica's links
handed to `on_down`, summed stats, relabelled metrics."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from vllm_hybridcache.fleet.front import Front, sum_stats
from vllm_hybridcache.fleet.relabel import merge
from vllm_hybridcache.fleet.routing import Router

ENDPOINTS = {"r0": "http://r0", "r1": "http://r1"}


def replica_stats(lookups: int) -> dict:
    st = {"lookups": lookups, "hits": 1, "misses": {"no_link": lookups - 1},
          "ttft": {"bounds": [1.0], "counts": [lookups, 0], "sum": 0.5, "count": lookups}}
    return {"tiers": {"ram": {**st, "kinds": {"tree": st}}}, "engines": 1}


METRICS = """# HELP vllm:hybridcache_lookups Lookups.
# TYPE vllm:hybridcache_lookups counter
vllm:hybridcache_lookups_total{kind="tree",tier="ram"} %d
"""


def answer(status: int, payload: dict | str) -> httpx.Response:
    """A streamed response, as a real replica's arrives (read by the front chunk by chunk)."""
    data = payload.encode() if isinstance(payload, str) else json.dumps(payload).encode()
    kind = "text/plain" if isinstance(payload, str) else "application/json"
    return httpx.Response(status, headers={"content-type": kind},
                          stream=httpx.ByteStream(data))


class Replicas:
    """The mock replicas: `broken[name]` is what goes wrong there (None: it answers)."""

    def __init__(self) -> None:
        self.broken: dict[str, str | None] = {"r0": None, "r1": None}
        self.seen: list[tuple[str, str, dict]] = []

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        name = request.url.host
        how = self.broken[name]
        if how == "refused":
            raise httpx.ConnectError("connection refused", request=request)
        if how == "reset":
            raise httpx.RemoteProtocolError("peer closed connection", request=request)
        if how == "500":
            return answer(500, {"error": "engine dead"})
        if request.url.path == "/v1/cache/stats":
            return answer(200, replica_stats(3 if name == "r0" else 5))
        if request.url.path == "/metrics":
            return answer(200, METRICS % (3 if name == "r0" else 5))
        if request.url.path == "/health":
            return answer(200, "")
        if request.url.path == "/v1/cache/clear":
            self.seen.append((name, f"{request.url.path}?{request.url.query.decode()}",
                              {**dict(request.headers), "body": request.content.decode()}))
            return answer(200, {"cleared": True, "links": 2})
        body = json.loads(request.content)
        self.seen.append((name, request.url.path, dict(request.headers)))
        if body.get("bad"):
            return answer(400, {"error": "bad request"})
        return answer(200, {"served_by": name})


@pytest.fixture
def setup():
    replicas = Replicas()
    dead: list[str] = []
    alive = {"r0": True, "r1": True}

    async def is_alive(name: str) -> bool:
        return alive[name]

    async def on_down(name: str) -> None:
        dead.append(name)

    router = Router(list(ENDPOINTS))
    front = Front(ENDPOINTS, router, is_alive, on_down, health_interval_s=3600,
                  client=httpx.AsyncClient(transport=httpx.MockTransport(replicas)))
    with TestClient(front.app()) as client:
        yield client, replicas, router, alive, dead


def chat(client, session="s", **headers):
    return client.post("/v1/chat/completions",
                       json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
                       headers={"x-session-id": session, **headers})


def test_a_request_that_failed_before_its_first_byte_is_retried_on_another_replica(setup):
    client, replicas, router, alive, dead = setup
    owner = chat(client).headers["x-hybridcache-replica"]
    other = "r1" if owner == "r0" else "r0"
    replicas.broken[owner] = "reset"
    alive[owner] = False
    r = chat(client)
    assert r.status_code == 200 and r.json() == {"served_by": other}
    assert r.headers["x-hybridcache-replica"] == other
    assert router.up[owner] is False
    for _ in range(100):  # the liveness check runs beside the request
        if dead:
            break
        time.sleep(0.01)
    assert dead == [owner]  # a dead replica's links are dropped, once
    snap = router.snapshot()
    assert snap["retries"] == 1 and snap["requests"] == 2
    assert all(s["inflight"] == 0 for s in snap["replicas"].values())
    assert chat(client).headers["x-hybridcache-route"] == "owner"  # the survivor owns it now


def test_a_5xx_is_retried_and_a_4xx_is_the_answer(setup):
    client, replicas, router, _, dead = setup
    replicas.broken["r0"] = "500"
    r = chat(client, **{"x-hybridcache-replica": "r0"})
    assert r.status_code == 200 and r.json() == {"served_by": "r1"}
    assert router.up["r0"] is True and not dead  # an answer is not a dead replica
    bad = client.post("/v1/completions", json={"model": "m", "prompt": "x", "bad": True},
                      headers={"x-hybridcache-replica": "r1"})
    assert bad.status_code == 400 and router.snapshot()["retries"] == 1


def test_no_live_replica_is_a_503(setup):
    client, replicas, router, _, _ = setup
    replicas.broken = {"r0": "refused", "r1": "refused"}
    r = chat(client)
    assert r.status_code == 503 and sorted(r.json()["error"]["tried"]) == ["r0", "r1"]
    assert router.up == {"r0": False, "r1": False}
    assert client.get("/health").status_code == 503


def test_the_request_reaches_the_replica_unchanged_with_its_headers(setup):
    client, replicas, _, _, _ = setup
    chat(client, authorization="Bearer k")
    _, path, headers = replicas.seen[-1]
    assert path == "/v1/chat/completions"
    assert headers["authorization"] == "Bearer k" and headers["x-session-id"] == "s"
    assert "x-hybridcache-replica" not in headers


def test_a_clear_reaches_every_replica_with_both_keys_and_the_tenants_salt(setup):
    """Issue 29: the admin key travels in its own header beside the API key, and a tenant's
    clear names its salt in the body: the front passes on both headers, the query and the
    body, and nothing else of the caller's."""
    client, replicas, _, _, _ = setup
    r = client.post("/v1/cache/clear", params={"kind": "tree"}, json={"cache_salt": "t-1"},
                    headers={"Authorization": "Bearer k", "X-Hybridcache-Admin-Key": "a" * 20,
                             "X-Other": "no"})
    assert r.status_code == 200 and r.json()["links"] == 4
    seen = {name: (path, headers) for name, path, headers in replicas.seen}
    assert set(seen) == {"r0", "r1"}
    for path, headers in seen.values():
        assert path == "/v1/cache/clear?kind=tree"
        assert headers["authorization"] == "Bearer k"
        assert headers["x-hybridcache-admin-key"] == "a" * 20
        assert json.loads(headers["body"]) == {"cache_salt": "t-1"}
        assert "x-other" not in headers


def test_stats_sum_the_replicas_and_list_each(setup):
    client, replicas, _, _, _ = setup
    s = client.get("/v1/cache/stats").json()
    assert s["tiers"]["ram"]["lookups"] == 8 and s["engines"] == 2
    assert s["tiers"]["ram"]["kinds"]["tree"]["misses"] == {"no_link": 6}
    assert s["tiers"]["ram"]["ttft"]["counts"] == [8, 0]
    assert s["replicas"]["r1"]["tiers"]["ram"]["lookups"] == 5
    replicas.broken["r1"] = "refused"
    s = client.get("/v1/cache/stats").json()
    assert s["tiers"]["ram"]["lookups"] == 3 and "error" in s["replicas"]["r1"]


def test_metrics_carry_the_replica_label(setup):
    client, _, _, _, _ = setup
    chat(client)
    text = client.get("/metrics").text
    assert 'vllm:hybridcache_lookups_total{kind="tree",replica="r0",tier="ram"} 3.0' in text
    assert 'vllm:hybridcache_lookups_total{kind="tree",replica="r1",tier="ram"} 5.0' in text
    assert 'vllm:hybridcache_cluster_routed_total{outcome="no_owner"} 1.0' in text
    assert 'vllm:hybridcache_cluster_replica_up{replica="r0"} 1.0' in text


def test_sum_stats_and_merge_of_nothing():
    empty = sum_stats({})
    assert empty["tiers"] == {} and empty["engines"] == 0
    assert merge({"r0": "not a metrics page {"}) == b""
