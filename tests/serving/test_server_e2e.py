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

from benchmarks.servers import SYSTEMS, ServerSettings, running_server
from demo.conversation import TOOLS, demo_sessions
from vllm_hybridcache.segmentation import Segmentation

pytestmark = pytest.mark.slow

GRID = 256
KEY = "test-admin-key"


@pytest.fixture(scope="module")
def server(embedded_model, tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_HYBRIDCACHE_GRID", str(GRID))
    settings = ServerSettings(model_path=str(embedded_model("qwen3-next-tiny")),
                              served_name="tiny", max_model_len=8192, port=8300,
                              extra_args=["--api-key", KEY])
    log = tmp_path_factory.mktemp("server") / "ours.log"
    with running_server(SYSTEMS["ours"], settings, log) as srv:
        yield srv
    mp.undo()


def chat(srv, messages):
    r = requests.post(srv.base_url + "/v1/chat/completions",
                      headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": "tiny", "messages": messages, "tools": TOOLS,
                            "tool_choice": "none", "max_tokens": 4, "temperature": 0,
                            "return_token_ids": True}, timeout=300)
    assert r.status_code == 200, r.text
    body = r.json()
    usage = body["usage"]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return body["prompt_token_ids"], usage["prompt_tokens"], cached


def expected_hit(seg: Segmentation, prompt: list[int], earlier: list[list[int]]) -> int:
    """Deepest cut of `prompt` (leaving a token to prefill) that an earlier prompt reached."""
    best = 0
    for c in seg.cuts(prompt, len(prompt) - 1):
        if any(len(e) >= c and e[:c] == prompt[:c] and c in seg.cuts(e) for e in earlier):
            best = c
    return best


def metric_sum(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def im_end_id(srv) -> int:
    r = requests.post(srv.base_url + "/tokenize", headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": "tiny", "prompt": "<|im_end|>", "add_special_tokens": False})
    ids = r.json()["tokens"]
    assert len(ids) == 1
    return ids[0]


def test_conversation_hits_grow_and_metrics_agree(server):
    seg = Segmentation(grid=GRID, message_end_ids=(im_end_id(server),), message_end_min=256)
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
        stats = requests.get(server.base_url + "/v1/cache/stats",
                             headers={"Authorization": f"Bearer {KEY}"}).json()
        ram = stats["tiers"].get("ram", {})
        if ram.get("tokens_served") == served or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert ram["tokens_served"] == served
    assert ram["hits"] == hits
    assert ram["links"] > 0 and ram["bytes_held"] > 0
    metrics = requests.get(server.base_url + "/metrics").text
    assert metric_sum(metrics, "vllm:hybridcache_cached_tokens_total") == served
    assert metric_sum(metrics, "vllm:hybridcache_hits_total") == hits
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
