"""End to end through the real server: `vllm serve MODEL --plugin hybridcache` + OpenAI client.

A 4-turn agent conversation (system prompt, tools, tool calls and results) and a second session
sharing the system prompt. Cached tokens must equal what the segmentation allows (the deepest
cut shared with an earlier prompt), /metrics and /v1/cache/stats must agree with the responses'
usage, and clearing the cache (an admin route behind --api-key) makes the next turn miss.
"""

from __future__ import annotations

import re
import time

import pytest
import requests

from demo.conversation import demo_sessions
from tests.serving.conftest import (
    KEY,
    cache_stats,
    chat,
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
    _, turns = demo_sessions()[0]
    chat(server, turns[1])
    _, _, cached = chat(server, turns[1])
    assert cached > 0
    r = requests.post(server.base_url + "/v1/cache/clear")
    assert r.status_code == 401                      # --api-key guards the admin route
    r = requests.post(server.base_url + "/v1/cache/clear", params={"tier": "disk"},
                      headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400 and "unknown tier" in r.json()["error"]
    r = requests.post(server.base_url + "/v1/cache/clear",
                      headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200 and r.json()["cleared"] is True
    _, _, cached = chat(server, turns[1])
    assert cached == 0
