"""Session spill through the real server: live conversations survive a SIGTERM restart.

`vllm serve --plugin hybridcache` (flash-next-tiny in float32, the greedy gate's dtype) with
`VLLM_HYBRIDCACHE_DISK_DIR` and `--shutdown-timeout` (vLLM's graceful shutdown: without it vLLM
kills the engine process at once and nothing can drain). Prompts are token ids, so a next turn
is exactly the previous prompt + its answer + new tokens.

Life 1, session spill off: conversation A's first turn; SIGTERM writes no end anchor.
Life 2, spill on: A's second turn finds only tree links (the anchor was not spilled), then
conversation B's first turn; SIGTERM: the connector's shutdown hook writes both live end
anchors (the log says so).
Life 3: B's second turn and A's third turn resume at their end anchors from the disk tier
(cached tokens = the anchor's depth, kind `anchor`), and each passes the greedy gate against
a cold run of its prompt in the same engine (a unique `cache_salt` makes that run miss).
"""

from __future__ import annotations

import time
import uuid

import pytest
import requests

from benchmarks.servers import SYSTEMS, ServerSettings, running_server
from tests.connector.test_end_anchors import greedy_gate
from tests.keys import KEY_FILE
from tests.serving.conftest import KEY, cache_stats

pytestmark = pytest.mark.slow

OUT = 6  # tokens per answer
GRID = 256


def _complete(srv, prompt: list[int], **extra) -> dict:
    """One greedy completion of token ids with top-5 logprobs keyed by token id."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": OUT, "temperature": 0,
            "logprobs": 5, "return_tokens_as_token_ids": True, "return_token_ids": True,
            "ignore_eos": True, **extra}
    r = requests.post(srv.base_url + "/v1/completions", json=body, timeout=300,
                      headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200, r.text
    out = r.json()
    choice = out["choices"][0]
    lp = choice["logprobs"]
    return {"ids": choice["token_ids"], "tokens": lp["tokens"],
            "logprobs": [dict(d) for d in lp["top_logprobs"]],
            "cached": ((out["usage"].get("prompt_tokens_details") or {})
                       .get("cached_tokens") or 0)}


def _anchors(srv) -> dict:
    return cache_stats(srv)["tiers"].get("disk", {}).get("kinds", {}).get("anchor", {})


def _wait_anchors(srv, n: int) -> None:
    """End anchors are captured one step after the answer: wait until n are committed."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        ram = cache_stats(srv)["tiers"]["ram"]["kinds"].get("anchor", {})
        if ram.get("captures", 0) >= n:
            return
        time.sleep(0.3)
    raise AssertionError(f"{n} end anchors not committed: {cache_stats(srv)}")


def _turn(prompt: list[int], answer: dict, new: list[int]) -> list[int]:
    return [*prompt, *answer["ids"], *new]


def test_live_conversations_resume_at_their_end_anchors_after_a_restart(embedded_model,
                                                                         tmp_path):
    disk = tmp_path / "disk"
    mp = pytest.MonkeyPatch()
    for k, v in (("GRID", GRID), ("MESSAGE_END_IDS", -1), ("DISK_DIR", disk),
                 ("DISK_KEY_FILE", KEY_FILE),
                 ("DISK_WRITE_FIRST_TOKENS", 0)):  # every tree link written: life 2 counts them
        mp.setenv(f"VLLM_HYBRIDCACHE_{k}", str(v))
    settings = ServerSettings(model_path=str(embedded_model("flash-next-tiny")),
                              served_name="tiny", max_model_len=4096, port=8360,
                              extra_args=["--api-key", KEY, "--dtype", "float32",
                                          "--shutdown-timeout", "25"])
    a1 = [1000 + (i * 37) % 2000 for i in range(700)]
    b1 = [500 + (i * 53) % 2500 for i in range(600)]
    try:
        # ------------------------------------------------ life 1: session spill off
        mp.setenv("VLLM_HYBRIDCACHE_SESSION_SPILL", "0")
        with running_server(SYSTEMS["ours"], settings, tmp_path / "life1.log") as srv:
            ans_a1 = _complete(srv, a1)
            _wait_anchors(srv, 1)
        assert not list(disk.rglob("a-*/*.link"))  # off: no end anchor was written
        a2 = _turn(a1, ans_a1, [7, 8, 9, 10])

        # ------------------------------------------------ life 2: spill on
        mp.setenv("VLLM_HYBRIDCACHE_SESSION_SPILL", "1")
        with running_server(SYSTEMS["ours"], settings, tmp_path / "life2.log") as srv:
            ans_a2 = _complete(srv, a2)
            # only the tree links of life 1 (grid cuts) serve: not the anchor's depth
            assert ans_a2["cached"] == (len(a1) // GRID) * GRID
            ans_b1 = _complete(srv, b1)
            _wait_anchors(srv, 2)
        log = (tmp_path / "life2.log").read_text(errors="replace")
        assert "session spill wrote 2 of 2 end anchors" in log, log[-3000:]
        assert len(list(disk.rglob("a-*/*.link"))) == 2

        # ------------------------------------------------ life 3: resumed at the anchors
        b2 = _turn(b1, ans_b1, [11, 12, 13])
        a3 = _turn(a2, ans_a2, [14, 15])
        with running_server(SYSTEMS["ours"], settings, tmp_path / "life3.log") as srv:
            agreed = []
            for prompt, prev_len in ((b2, len(b1) + OUT - 1), (a3, len(a2) + OUT - 1)):
                warm = _complete(srv, prompt)
                assert warm["cached"] == prev_len  # the end anchor: prompt + answer - 1
                cold = _complete(srv, prompt, cache_salt=f"cold-{uuid.uuid4().hex}")
                assert cold["cached"] == 0
                agreed.append(greedy_gate(warm, cold))
            st = _anchors(srv)
            assert (st.get("hits"), st.get("restores")) == (2, 2), st
            assert sum(agreed) >= OUT, agreed  # a cold tie may end one comparison early
    finally:
        mp.undo()
