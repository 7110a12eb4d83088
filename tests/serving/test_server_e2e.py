"""End to end through the real server: `vllm serve MODEL --plugin hybridcache` + OpenAI client.

A 4-turn agent conversation (system prompt, tools, tool calls and results) and a second session
sharing the system prompt. Cached tokens must equal what the segmentation allows (the deepest
cut shared with an earlier prompt), /metrics and /v1/cache/stats must agree with the responses'
usage, and clearing the cache (behind --api-key and the admin key) makes the next turn miss;
a tenant clears its own links only, and the admin's secrets stay out of the stats and the log.
"""

from __future__ import annotations

import re
import time
import uuid
from pathlib import Path

import pytest
import requests

from demo.conversation import demo_sessions
from tests.serving.conftest import (
    ADMIN,
    ADMIN_KEY,
    KEY,
    cache_stats,
    cached_tokens,
    chat,
    chat_body,
    clear_cache,
    expected_hit,
    metric_sum,
    segmentation,
)

pytestmark = pytest.mark.slow


def test_conversation_hits_grow_and_metrics_agree(server):
    """Counters are cumulative over the server's life (other tests share it): compare deltas."""
    seg = segmentation(server)
    clear_cache(server)
    time.sleep(1.0)  # the last stats snapshot before the clear has arrived
    ram0 = cache_stats(server)["tiers"].get("ram", {})
    metrics0 = requests.get(server.base_url + "/metrics").text
    served0 = ram0.get("tokens_served", 0)
    hits0 = ram0.get("hits", 0)
    seen: list[list[int]] = []
    served = 0
    hits = 0
    for _, turns in demo_sessions():
        for messages in turns[:4]:
            ids, n_prompt, cached = chat(server, messages)
            assert n_prompt == len(ids)
            assert cached == expected_hit(seg, ids, seen), (len(ids), cached)
            served += cached
            hits += cached > 0
            seen.append(ids)
    assert hits >= 4 and served > 0

    deadline = time.monotonic() + 30
    while True:  # stats travel with the engine's step outputs: allow them to arrive
        ram = cache_stats(server)["tiers"].get("ram", {})
        if ram.get("tokens_served") == served0 + served or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert ram["tokens_served"] - served0 == served
    assert ram["hits"] - hits0 == hits
    assert ram["links"] > 0 and ram["bytes_held"] > 0
    metrics = requests.get(server.base_url + "/metrics").text
    for name, expected in (("vllm:hybridcache_cached_tokens_total", served),
                           ("vllm:hybridcache_hits_total", hits)):
        assert metric_sum(metrics, name) - metric_sum(metrics0, name) == expected, name
    assert "# HELP vllm:hybridcache_misses_total" in metrics
    assert re.search(r'vllm:hybridcache_misses_total\{[^}]*reason="no_prefix"', metrics)


def test_clear_is_admin_and_empties_the_cache(server):
    """With --api-key, clearing every tenant's links needs the admin key too (issue 29): the
    API key alone is a 403 that clears nothing; both keys clear."""
    _, turns = demo_sessions()[0]
    chat(server, turns[1])
    _, _, cached = chat(server, turns[1])
    assert cached > 0
    r = requests.post(server.base_url + "/v1/cache/clear")
    assert r.status_code == 401                      # vLLM's --api-key middleware
    r = requests.post(server.base_url + "/v1/cache/clear",
                      headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 403 and "admin key" in r.json()["error"]
    r = requests.post(server.base_url + "/v1/cache/clear",
                      headers={**ADMIN, "X-Hybridcache-Admin-Key": "not-the-admin-key-at-all"})
    assert r.status_code == 403
    _, _, cached = chat(server, turns[1])
    assert cached > 0                                # nothing was cleared
    r = requests.post(server.base_url + "/v1/cache/clear", params={"tier": "disk"},
                      headers=ADMIN)
    assert r.status_code == 400 and "unknown tier" in r.json()["error"]
    r = requests.post(server.base_url + "/v1/cache/clear", headers=ADMIN)
    assert r.status_code == 200 and r.json()["cleared"] is True
    _, _, cached = chat(server, turns[1])
    assert cached == 0


def test_a_tenant_clears_its_own_links_and_only_those(server):
    """Two tenants (cache salts) warm on the same conversation; tenant A clears its links with
    the API key alone and its salt in the body: A's next turn misses, B's still hits. The
    links of unsalted requests are everyone's: their clear needs the admin key."""
    _, turns = demo_sessions()[1]
    salts = {"a": f"tenant-a-{uuid.uuid4().hex}", "b": f"tenant-b-{uuid.uuid4().hex}"}
    for salt in salts.values():
        chat_body(server, turns[1], cache_salt=salt)
        assert cached_tokens(chat_body(server, turns[1], cache_salt=salt)) > 0
    chat(server, turns[1])  # and unsalted
    r = requests.post(server.base_url + "/v1/cache/clear", json={"cache_salt": salts["a"]},
                      headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200 and r.json()["links"] > 0, r.text
    assert salts["a"] not in r.text
    assert cached_tokens(chat_body(server, turns[1], cache_salt=salts["a"])) == 0
    assert cached_tokens(chat_body(server, turns[1], cache_salt=salts["b"])) > 0
    r = requests.post(server.base_url + "/v1/cache/clear", json={"cache_salt": ""},
                      headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 403
    assert chat(server, turns[1])[2] > 0
    r = requests.post(server.base_url + "/v1/cache/clear", json={"cache_salt": ""},
                      headers=ADMIN)
    assert r.status_code == 200 and chat(server, turns[1])[2] == 0
    assert cached_tokens(chat_body(server, turns[1], cache_salt=salts["b"])) > 0


def test_the_stats_and_the_log_keep_the_admins_secrets(server):
    """The domain count is in the admin's stats only, and the server's log never shows the
    admin key nor a salt a tenant cleared (the start-up line names the key's file only)."""
    public = cache_stats(server)
    admin = requests.get(server.base_url + "/v1/cache/stats", headers=ADMIN).json()
    assert "domains" not in repr(public) and "domains" in admin["tiers"]["ram"]
    salt = f"tenant-log-{uuid.uuid4().hex}"
    r = requests.post(server.base_url + "/v1/cache/clear", json={"cache_salt": salt},
                      headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200
    log = Path(server.log_path).read_text(errors="replace")
    assert "VLLM_HYBRIDCACHE_ADMIN_KEY_FILE=" in log  # the start-up line was written ...
    assert "one tenant" in log                       # ... and the tenants' clears
    assert ADMIN_KEY not in log and salt not in log
