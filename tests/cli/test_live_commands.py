"""`vllm-hybridcache cache stats|clear URL` against the plugin's real routes over a real socket:
the routes of serving/http.py behind vLLM's own `--api-key` middleware, on uvicorn in a thread,
reaching a real scheduler side through the engine-utility path (no model, no engine). What is
printed, what is cleared, which credential each refusal asks for, the salt in the body and
never in the URL, exit codes for refusals, bad requests and unreachable servers."""

from __future__ import annotations

import asyncio
import io
import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
from fastapi import FastAPI, Request

from tests.adapter.test_unkeyed_inputs import TOKENS
from tests.keys import write_key_file
from tests.prom_registry import private_prom
from tests.unit.test_admin_routes import ADMIN, API, OTHER, _hits, _tenants
from tests.unit.test_tiered_cache_adapter import (  # noqa: F401 (clear_utility: a fixture)
    _connector,
    _FakeCore,
    clear_utility,
)
from vllm_hybridcache.cli import live
from vllm_hybridcache.cli.tools import main
from vllm_hybridcache.config import ADMIN_KEY_ENV

SALT = "tenant-a"
pytestmark = pytest.mark.usefixtures("clear_utility")  # the engines' clear utility, as served


@contextmanager
def _uvicorn(app: FastAPI) -> Iterator[str]:
    """`app` served on a free port of 127.0.0.1 in a thread; its base URL."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                           lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@pytest.fixture
def served(monkeypatch):
    """Factory: (api_key, admin) -> (URL, the scheduler side, the (URL, body) of every
    request the server got). The tenants of test_admin_routes: tenant A, tenant B and the
    unsalted clients each hold a tree link and an end anchor; their stats are what the
    engine last reported."""
    from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware

    from vllm_hybridcache.adapter import stats as stats_mod
    from vllm_hybridcache.adapter.stats import encode
    from vllm_hybridcache.serving.http import HybridCacheEndpoints

    monkeypatch.setattr(stats_mod, "_latest", {})  # this test's engine only
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    monkeypatch.delenv(ADMIN_KEY_ENV, raising=False)
    monkeypatch.delenv(live.ADMIN_KEY_FILE_ENV, raising=False)
    servers = []

    def make(api_key: bool = True, admin: bool = True):
        side = _tenants()
        assert _hits(side, [*TOKENS, 9, 9], SALT) > 0  # a lookup that hits, and misses:
        assert _hits(side, [1, 2, 3] * 70, SALT) == 0
        prom, _ = private_prom()
        prom.observe(encode(side.cache.stats(), 1, "epoch", side.segmentation_mode), 0)
        if admin:
            monkeypatch.setenv(ADMIN_KEY_ENV, ADMIN)
        app = FastAPI()
        seen: list[tuple[str, bytes]] = []

        @app.middleware("http")
        async def record(request: Request, call_next):
            seen.append((str(request.url), await request.body()))
            return await call_next(request)

        ep = HybridCacheEndpoints()
        ep.attach_router(app)
        client = SimpleNamespace(engine_core=_FakeCore([_connector(side)]))
        args = SimpleNamespace(api_key=[API] if api_key else None, kv_transfer_config=None)
        asyncio.run(ep.init_state(client, SimpleNamespace(), args))
        monkeypatch.delenv(ADMIN_KEY_ENV, raising=False)  # the server read it; the CLI not
        if api_key:
            app.add_middleware(AuthenticationMiddleware, tokens=[API])
        cm = _uvicorn(app)
        url = cm.__enter__()
        servers.append(cm)
        return url, side, seen

    yield make
    for cm in servers:
        cm.__exit__(None, None, None)


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["cache", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def _admin_file(tmp_path, key: str = ADMIN):
    return write_key_file(tmp_path / "admin.key", key.encode())


# ---------------------------------------------------------------------------- stats


def test_stats_are_printed_per_tier_and_kind(served, capsys, monkeypatch):
    url, side, _ = served()
    monkeypatch.setenv("VLLM_API_KEY", API)
    rc, out, err = cli(capsys, "stats", url)
    assert rc == 0, err
    tree = side.cache.stats()[("ram", "tree")]
    anchor = side.cache.stats()[("ram", "anchor")]
    row = next(line.split() for line in out.splitlines() if line.startswith("ram      tree"))
    assert row[2] == str(tree.links) == "3"
    assert int(row[-1]) == tree.tokens_served and int(row[-2]) == tree.hits
    assert next(line for line in out.splitlines() if line.startswith("ram      anchor")
                ).split()[2] == str(anchor.links) == "3"
    assert "ram: hit rate" in out and "lookups" in out
    assert "misses by reason:" in out and "ram/tree: no_prefix" in out
    assert "domains" not in out  # the admin's figure only
    # --json is the server's answer itself
    rc, out, _ = cli(capsys, "stats", url, "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["tiers"]["ram"]["kinds"]["tree"]["links"] == 3
    assert "domains" not in doc["tiers"]["ram"]


def test_the_admin_sees_the_domain_count(served, capsys, monkeypatch, tmp_path):
    url, _, _ = served()
    rc, out, _ = cli(capsys, "stats", url, "--api-key", API, "--admin-key-file",
                     str(_admin_file(tmp_path)))
    assert rc == 0 and "domains holding links (admin only): ram/anchor 3, ram/tree 3" in out
    # the key in the variable the server reads works the same
    monkeypatch.setenv(ADMIN_KEY_ENV, ADMIN)
    rc, out, _ = cli(capsys, "stats", url, "--api-key", API, "--json")
    assert rc == 0 and json.loads(out)["tiers"]["ram"]["kinds"]["tree"]["domains"] == 3


def test_stats_without_the_api_key_say_which_key_is_missing(served, capsys):
    url, _, _ = served()
    rc, _, err = cli(capsys, "stats", url)
    assert rc == live.EXIT_ERROR and "401" in err and "--api-key" in err
    rc, _, err = cli(capsys, "stats", url, "--api-key", "not-" + API)
    assert rc == live.EXIT_ERROR and "not one of the server's --api-key keys" in err


# ---------------------------------------------------------------------------- clear


def test_clearing_every_tenant_needs_both_keys(served, capsys, tmp_path):
    url, side, _ = served()
    rc, _, err = cli(capsys, "clear", url)
    assert rc == 1 and "401" in err
    rc, _, err = cli(capsys, "clear", url, "--api-key", API)
    assert rc == 1 and "403" in err and "--admin-key-file" in err
    wrong = _admin_file(tmp_path, "not-" + ADMIN)
    rc, _, err = cli(capsys, "clear", url, "--api-key", API, "--admin-key-file", str(wrong))
    assert rc == 1 and "wrong admin key" in err
    assert len(side.tree) == 3 and len(side.anchors) == 3  # none of them cleared anything
    good = _admin_file(tmp_path)
    rc, out, _ = cli(capsys, "clear", url, "--api-key", API, "--admin-key-file", str(good))
    assert rc == 0 and "cleared 6 links (every tenant's; tier all, kind all" in out
    assert len(side.tree) == 0 and len(side.anchors) == 0


def test_a_tenant_clears_its_own_links_and_the_salt_stays_out_of_the_url(served, capsys):
    url, side, seen = served()
    rc, out, err = cli(capsys, "clear", url, "--api-key", API, "--cache-salt", SALT,
                       "--kind", "tree")
    assert rc == 0, err
    assert "cleared 1 links (one tenant's; tier all, kind tree" in out and SALT not in out
    assert _hits(side, TOKENS, SALT) == 0 and _hits(side, TOKENS, "tenant-b") > 0
    assert _hits(side, OTHER, None) > 0
    url_sent, body = seen[-1]
    assert SALT not in url_sent and json.loads(body) == {"cache_salt": SALT}
    assert "kind=tree" in url_sent  # the control: the URL is what the server saw
    # the shared unsalted links: the admin's (an empty salt is still a body, never omitted)
    rc, _, err = cli(capsys, "clear", url, "--api-key", API, "--cache-salt", "")
    assert rc == 1 and "403" in err and _hits(side, OTHER, None) > 0
    assert json.loads(seen[-1][1]) == {"cache_salt": ""}


def test_the_salt_can_come_from_stdin(served, capsys, monkeypatch):
    url, side, seen = served()
    monkeypatch.setattr("sys.stdin", io.StringIO(SALT + "\n"))
    rc, out, _ = cli(capsys, "clear", url, "--api-key", API, "--cache-salt-file", "-",
                     "--json")
    assert rc == 0 and json.loads(out) == {"cleared": True, "links": 2, "tier": "all",
                                           "kind": "all", "tiers": ["ram"], "tenant": True}
    assert json.loads(seen[-1][1]) == {"cache_salt": SALT}
    assert len(side.tree) == 2


def test_an_unknown_tier_is_the_servers_400(served, capsys, tmp_path):
    url, side, _ = served()
    rc, _, err = cli(capsys, "clear", url, "--api-key", API, "--admin-key-file",
                     str(_admin_file(tmp_path)), "--tier", "disk")
    assert rc == 1 and "400" in err and "unknown tier 'disk'" in err and "ram" in err
    assert len(side.tree) == 3


def test_an_open_server_needs_no_key(served, capsys):
    url, side, _ = served(api_key=False, admin=False)
    rc, out, _ = cli(capsys, "clear", url, "--tier", "ram", "--kind", "anchor")
    assert rc == 0 and "cleared 3 links" in out and len(side.anchors) == 0
    assert len(side.tree) == 3


# ---------------------------------------------------------------------------- failures


def test_an_unreachable_server_is_exit_3(capsys):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rc, _, err = cli(capsys, "stats", f"127.0.0.1:{port}", "--timeout", "5")
    assert rc == live.EXIT_UNREACHABLE and "cannot reach http://127.0.0.1:" in err


def test_a_server_without_the_routes_is_a_404_that_says_so(capsys):
    with _uvicorn(FastAPI()) as url:
        rc, _, err = cli(capsys, "stats", url)
    assert rc == 1 and "404" in err and "--plugin hybridcache" in err


def test_an_admin_key_file_follows_the_servers_rules(served, capsys, tmp_path, monkeypatch):
    url, side, _ = served()
    loose = _admin_file(tmp_path)
    os.chmod(loose, 0o622)
    rc, _, err = cli(capsys, "clear", url, "--api-key", API, "--admin-key-file", str(loose))
    assert rc == live.EXIT_USAGE and "writable by group or others" in err
    short = write_key_file(tmp_path / "short.key", b"tooshort")
    rc, _, err = cli(capsys, "clear", url, "--api-key", API, "--admin-key-file", str(short))
    assert rc == live.EXIT_USAGE and "key file" in err
    # a file named by the flag wins over a key left in the variable
    monkeypatch.setenv(ADMIN_KEY_ENV, "not-" + ADMIN)
    good = write_key_file(tmp_path / "good.key", ADMIN.encode())
    rc, _, _ = cli(capsys, "clear", url, "--api-key", API, "--admin-key-file", str(good))
    assert rc == 0 and len(side.tree) == 0


@pytest.mark.parametrize("given,expect", [
    ("localhost:8000", "http://localhost:8000"),
    ("http://host:8000/", "http://host:8000"),
    ("https://host/base/v1/", "https://host/base"),
])
def test_server_urls(given, expect):
    assert live.base_url(given) == expect


@pytest.mark.parametrize("given", ["http://host:8000/?cache_salt=x", "ftp://host", "http://"])
def test_urls_that_are_refused(given, capsys):
    rc, _, err = cli(capsys, "stats", given)
    assert rc == live.EXIT_USAGE and "vllm-hybridcache cache: error" in err


def test_argument_errors(capsys):
    with pytest.raises(SystemExit) as e:
        main(["cache", "clear", "http://x", "--cache-salt", "a", "--cache-salt-file", "-"])
    assert e.value.code == 2 and "not allowed with" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["cache", "stats"])
    assert e.value.code == 2 and "url" in capsys.readouterr().err


def test_render_stats_without_any_snapshot():
    text = live.render_stats({"tiers": {}, "engines": 0, "segmentation": {}})
    assert "no stats yet" in text
