"""One real server for the whole folder: `vllm serve MODEL --plugin hybridcache --api-key ...`
on the tiny model (grid 256, message-end cuts 64 tokens after the previous cut, so both kinds of
cut fall inside these short conversations), and the OpenAI-client helpers the tests share.

Every server started in this folder has an admin key (docs/security.md), read from a file
(`admin_key_file`, through its environment variable): clearing every tenant's links needs it
once a server has --api-key."""

from __future__ import annotations

import pytest
import requests

from benchmarks.servers import SYSTEMS, ServerSettings, running_server
from demo.conversation import TOOLS
from vllm_hybridcache.segmentation import Segmentation

GRID = 256
MESSAGE_END_MIN = 64
KEY = "test-admin-key"  # vLLM's --api-key, every API user's
ADMIN_KEY = "test-admin-key-of-the-operator-0123"  # the cache's admin key (its own header)
ADMIN = {"Authorization": f"Bearer {KEY}", "X-Hybridcache-Admin-Key": ADMIN_KEY}


@pytest.fixture(scope="package", autouse=True)
def admin_key_file(tmp_path_factory):
    """The admin key of every server this folder starts, in a file its setting names."""
    path = tmp_path_factory.mktemp("admin") / "admin.key"
    path.write_text(ADMIN_KEY + "\n")
    path.chmod(0o600)
    mp = pytest.MonkeyPatch()
    mp.delenv("VLLM_HYBRIDCACHE_ADMIN_KEY", raising=False)
    mp.setenv("VLLM_HYBRIDCACHE_ADMIN_KEY_FILE", str(path))
    yield path
    mp.undo()


@pytest.fixture(scope="package")
def server(embedded_model, tmp_path_factory, admin_key_file):
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_HYBRIDCACHE_GRID", str(GRID))
    mp.setenv("VLLM_HYBRIDCACHE_MESSAGE_END_MIN", str(MESSAGE_END_MIN))
    # Step mode on purpose: the tests here count hits at the grid and message-end cuts
    # (`expected_hit`); fine mode (the CPU attention pin on) adds links at each prompt's last
    # 64-aligned position and at junctions with remembered prompts, which depend on every
    # prompt this shared server saw. Fine mode is checked bit for bit in
    # tests/connector/test_fine_cuts_qwen3_next.py and test_attention_in_place.py.
    mp.setenv("VLLM_HYBRIDCACHE_INNER_CAPTURES", "0")
    settings = ServerSettings(model_path=str(embedded_model("qwen3-next-tiny")),
                              served_name="tiny", max_model_len=8192, port=8300,
                              extra_args=["--api-key", KEY])
    log = tmp_path_factory.mktemp("server") / "ours.log"
    with running_server(SYSTEMS["ours"], settings, log) as srv:
        yield srv
    mp.undo()


def chat_body(srv, messages, **extra) -> dict:
    """One greedy chat completion (4 tokens) with the demo's tools; the response body."""
    body = {"model": "tiny", "messages": messages, "tools": TOOLS, "tool_choice": "none",
            "max_tokens": 4, "temperature": 0, "return_token_ids": True, **extra}
    r = requests.post(srv.base_url + "/v1/chat/completions",
                      headers={"Authorization": f"Bearer {KEY}"}, json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def cached_tokens(body: dict) -> int:
    return (body["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def chat(srv, messages) -> tuple[list[int], int, int]:
    """(prompt token ids, prompt tokens in usage, cached tokens in usage)."""
    body = chat_body(srv, messages)
    return body["prompt_token_ids"], body["usage"]["prompt_tokens"], cached_tokens(body)


def clear_cache(srv) -> None:
    r = requests.post(srv.base_url + "/v1/cache/clear", headers=ADMIN)
    assert r.status_code == 200 and r.json()["cleared"] is True


def cache_stats(srv) -> dict:
    return requests.get(srv.base_url + "/v1/cache/stats",
                        headers={"Authorization": f"Bearer {KEY}"}).json()


def segmentation(srv) -> Segmentation:
    """The server's segmentation, as the tests compute expected hits with it."""
    return Segmentation(grid=GRID, message_end_ids=(im_end_id(srv),),
                        message_end_min=MESSAGE_END_MIN)


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


