"""Who may clear and read the cache over HTTP (issue 29), route by route: the plugin's routes
on a FastAPI app behind vLLM's own `--api-key` middleware, reaching a real scheduler side
through the engine-utility path (no model, no engine).

- a server with an API key: clearing every tenant's links needs the admin key (403 and nothing
  cleared without it), in its own header beside the API key;
- a tenant clears its own links with the API key and its salt; the shared unsalted links need
  the admin key;
- a server with an admin key only guards the same way; one with neither is open and warns;
- the domain count is the admin's only.
"""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from tests.adapter.test_unkeyed_inputs import TOKENS, _commit_cuts, _request
from tests.unit.test_tiered_cache_adapter import (  # noqa: F401 (clear_utility: a fixture)
    _connector,
    _FakeCore,
    _no_steps,
    _report,
    _side,
    clear_utility,
)
from vllm_hybridcache.config import ADMIN_KEY_ENV

API = "api-key-of-every-user"
ADMIN = "admin-key-0123456789abcdef"
OTHER = [7 + (i * 11) % 800 for i in range(200)]


def _salted(req_id: str, tokens: list[int], salt: str | None):
    req = _request(req_id, tokens)
    req.cache_salt = salt
    return req


def _finish(side, req_id: str, tokens: list[int], salt: str | None) -> None:
    """A request of tenant `salt` that forwarded `tokens` finishes; its end anchor commits."""
    from vllm.v1.request import RequestStatus

    req = _salted(req_id, tokens, salt)
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    req.num_computed_tokens = len(tokens)
    assert side.request_finished(req, ([0], [1, 2])) is True
    (job,) = side.build_plan(_no_steps()).captures
    side.apply_report(_report(saved={job.addr: 0.0}, saved_count={job.addr: 1}))


def _hits(side, tokens: list[int], salt: str | None) -> int:
    """Tokens a new request of tenant `salt` with `tokens` + 3 more would be served."""
    req = _salted(f"probe-{len(side._live)}", [*tokens, 1, 2, 3], salt)
    n, _ = side.get_num_new_matched_tokens(req, 0)
    side.request_finished(req)
    return n


def _tenants():
    """A scheduler side holding a tree link and an end anchor for tenants A, B and the
    unsalted one, on different prompts."""
    side = _side()
    for i, (salt, toks) in enumerate((("tenant-a", TOKENS), ("tenant-b", TOKENS), (None, OTHER))):
        assert _commit_cuts(side, _salted(f"t{i}", toks, salt), toks) == 1
        _finish(side, f"f{i}", [*toks, 9, 9], salt)
    assert len(side.tree) == 3 and len(side.anchors) == 3
    return side


def _server(side, monkeypatch, api_key: bool, admin: bool) -> TestClient:
    """The plugin's routes as vLLM serves them: attached to the app, init_state called with
    the server's args, vLLM's AuthenticationMiddleware when it has an API key."""
    from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware

    from vllm_hybridcache.serving.http import HybridCacheEndpoints

    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    if admin:
        monkeypatch.setenv(ADMIN_KEY_ENV, ADMIN)
    else:
        monkeypatch.delenv(ADMIN_KEY_ENV, raising=False)
    app = FastAPI()
    ep = HybridCacheEndpoints()
    ep.attach_router(app)
    client = SimpleNamespace(engine_core=_FakeCore([_connector(side)]))
    args = SimpleNamespace(api_key=[API] if api_key else None, kv_transfer_config=None)
    asyncio.run(ep.init_state(client, SimpleNamespace(), args))
    if api_key:
        app.add_middleware(AuthenticationMiddleware, tokens=[API])
    return TestClient(app)


def _headers(api: bool = True, admin: str | None = None) -> dict[str, str]:
    out = {"Authorization": f"Bearer {API}"} if api else {}
    if admin is not None:
        out["X-Hybridcache-Admin-Key"] = admin
    return out


@pytest.mark.usefixtures("clear_utility")
def test_with_an_api_key_clearing_everything_needs_the_admin_key(monkeypatch):
    side = _tenants()
    http = _server(side, monkeypatch, api_key=True, admin=True)
    assert http.post("/v1/cache/clear").status_code == 401  # vLLM's middleware, first
    r = http.post("/v1/cache/clear", headers=_headers())
    assert r.status_code == 403 and "admin key" in r.json()["error"]
    r = http.post("/v1/cache/clear", headers=_headers(admin="not-" + ADMIN))
    assert r.status_code == 403 and "wrong admin key" in r.json()["error"]
    # the admin key alone does not pass vLLM's middleware: both headers are needed
    assert http.post("/v1/cache/clear", headers=_headers(api=False, admin=ADMIN)
                     ).status_code == 401
    assert len(side.tree) == 3 and len(side.anchors) == 3  # nothing cleared by any of them
    assert _hits(side, TOKENS, "tenant-a") > 0
    r = http.post("/v1/cache/clear", headers=_headers(admin=ADMIN))
    assert r.status_code == 200 and r.json()["links"] == 6
    assert len(side.tree) == 0 and len(side.anchors) == 0


@pytest.mark.usefixtures("clear_utility")
def test_a_tenant_clears_only_its_own_links_with_the_api_key(monkeypatch):
    side = _tenants()
    http = _server(side, monkeypatch, api_key=True, admin=True)
    b_before = _hits(side, [*TOKENS, 9, 9], "tenant-b")
    r = http.post("/v1/cache/clear", json={"cache_salt": "tenant-a"}, headers=_headers())
    assert r.status_code == 200, r.text
    assert r.json()["links"] == 2 and r.json()["tenant"] is True
    assert "tenant-a" not in r.text  # the salt is not echoed
    assert _hits(side, TOKENS, "tenant-a") == 0
    assert _hits(side, [*TOKENS, 9, 9], "tenant-a") == 0  # its anchor went too
    assert _hits(side, [*TOKENS, 9, 9], "tenant-b") == b_before > 0
    assert _hits(side, OTHER, None) > 0
    dropped = side.build_plan(_no_steps()).drops
    assert len(dropped) == 2 and {a.kind for a in dropped} == {"tree", "anchor"}
    # the unsalted links are every unsalted client's: the admin's to clear
    r = http.post("/v1/cache/clear", json={"cache_salt": ""}, headers=_headers())
    assert r.status_code == 403 and _hits(side, OTHER, None) > 0
    r = http.post("/v1/cache/clear", params={"kind": "tree"}, json={"cache_salt": ""},
                  headers=_headers(admin=ADMIN))
    assert r.status_code == 200 and r.json()["links"] == 1
    assert len(side.tree) == 1 and len(side.anchors) == 2  # B's link, B's and U's anchors
    # a tier the engines lack is still a 400, for a tenant's clear too
    r = http.post("/v1/cache/clear", params={"tier": "disk"}, json={"cache_salt": "tenant-b"},
                  headers=_headers())
    assert r.status_code == 400 and len(side.tree) == 1


@pytest.mark.usefixtures("clear_utility")
def test_a_salt_travels_in_the_body_never_in_the_url(monkeypatch):
    """A URL is written to access logs (uvicorn's, a proxy's): a salt in the query string is
    refused (400, nothing cleared), as is a body that is not what the route reads."""
    side = _tenants()
    http = _server(side, monkeypatch, api_key=True, admin=True)
    for kw in ({"params": {"cache_salt": "tenant-a"}}, {"content": b"[1]"},
               {"content": b"not json"}, {"json": {"cache_salt": 7}},
               {"json": {"cache_salt": "tenant-a", "tier": "ram"}}):
        r = http.post("/v1/cache/clear", headers=_headers(admin=ADMIN), **kw)
        assert r.status_code == 400, (kw, r.text)
    assert len(side.tree) == 3 and len(side.anchors) == 3


@pytest.mark.usefixtures("clear_utility")
def test_an_admin_key_alone_guards_the_clear_too(monkeypatch):
    side = _tenants()
    http = _server(side, monkeypatch, api_key=False, admin=True)
    assert http.post("/v1/cache/clear").status_code == 403
    assert len(side.tree) == 3
    assert http.post("/v1/cache/clear", json={"cache_salt": "tenant-a"}).status_code == 200
    assert len(side.tree) == 2
    r = http.post("/v1/cache/clear", headers={"X-Hybridcache-Admin-Key": ADMIN})
    assert r.status_code == 200 and len(side.tree) == 0


@pytest.mark.usefixtures("clear_utility")
def test_an_api_key_without_an_admin_key_refuses_every_tenants_clear(monkeypatch, caplog):
    side = _tenants()
    with caplog.at_level(logging.WARNING, logger="vllm_hybridcache"):
        http = _server(side, monkeypatch, api_key=True, admin=False)
    assert any("no admin key" in r.getMessage() for r in caplog.records)
    assert http.post("/v1/cache/clear", headers=_headers()).status_code == 403
    r = http.post("/v1/cache/clear", headers=_headers(admin="anything-at-all-here"))
    assert r.status_code == 403 and len(side.tree) == 3  # no key to match: refused
    r = http.post("/v1/cache/clear", json={"cache_salt": "tenant-b"}, headers=_headers())
    assert r.status_code == 200 and len(side.tree) == 2


@pytest.mark.usefixtures("clear_utility")
def test_a_server_with_neither_credential_is_open_and_says_so(monkeypatch, caplog):
    side = _tenants()
    with caplog.at_level(logging.WARNING, logger="vllm_hybridcache"):
        http = _server(side, monkeypatch, api_key=False, admin=False)
    assert any("open to anyone" in r.getMessage() for r in caplog.records)
    r = http.post("/v1/cache/clear")
    assert r.status_code == 200 and r.json()["links"] == 6 and len(side.tree) == 0


@pytest.mark.usefixtures("clear_utility")
def test_a_guarded_server_does_not_warn_that_it_is_open(monkeypatch, caplog):
    """Negative control of the warning above."""
    with caplog.at_level(logging.WARNING, logger="vllm_hybridcache"):
        _server(_tenants(), monkeypatch, api_key=True, admin=True)
    assert not any("open to anyone" in r.getMessage() or "no admin key" in r.getMessage()
                   for r in caplog.records)


@pytest.mark.usefixtures("clear_utility")
def test_the_admin_key_is_never_logged(monkeypatch, caplog):
    with caplog.at_level(logging.DEBUG):
        http = _server(_tenants(), monkeypatch, api_key=True, admin=True)
        http.post("/v1/cache/clear", headers=_headers(admin=ADMIN))
        http.post("/v1/cache/clear", json={"cache_salt": "tenant-a"}, headers=_headers())
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "cleared" in text  # the clears were logged ...
    assert ADMIN not in text and "tenant-a" not in text  # ... without the key or the salt


def test_only_the_admin_sees_the_domain_count(monkeypatch):
    from vllm_hybridcache.adapter import stats
    from vllm_hybridcache.core import CacheStats

    side = _tenants()
    payload = stats.encode(side.cache.stats(), 1, "e")
    assert payload["tiers"]["ram"]["tree"]["domains"] == 3
    monkeypatch.setattr(stats, "_latest", {0: payload})
    http = _server(side, monkeypatch, api_key=True, admin=True)
    public = http.get("/v1/cache/stats", headers=_headers()).json()
    admin = http.get("/v1/cache/stats", headers=_headers(admin=ADMIN)).json()
    assert "domains" not in repr(public)
    assert admin["tiers"]["ram"]["domains"] == 6  # 3 tree domains + 3 anchor domains
    assert admin["tiers"]["ram"]["kinds"]["anchor"]["domains"] == 3
    assert public["tiers"]["ram"]["hits"] == admin["tiers"]["ram"]["hits"]  # the rest: all
    assert set(CacheStats.__struct_fields__) - {"domains"} <= set(public["tiers"]["ram"])
    assert http.get("/v1/cache/stats", headers=_headers(admin="x" * 20)).status_code == 403


def test_before_init_state_the_routes_fail_closed():
    """Negative control of the open server: an endpoint whose credentials were never read is
    guarded (a global clear is refused), not open."""
    from vllm_hybridcache.serving.http import HybridCacheEndpoints

    app = FastAPI()
    HybridCacheEndpoints().attach_router(app)
    assert TestClient(app).post("/v1/cache/clear").status_code == 403
