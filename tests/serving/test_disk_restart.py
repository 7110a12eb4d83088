"""The disk tier through the real server: links written in one life serve the next one.

Life 1: `vllm serve --plugin hybridcache` with `VLLM_HYBRIDCACHE_DISK_DIR` runs three turns of a
conversation and the first turn of a second session sharing its system prompt; every committed
tree link is written to a link file. The server is stopped with SIGTERM and started again on
the same folder, with three things planted in it: an unrelated file (kept, never read), a file
that is not a link under a link's name (refused at start) and a flipped byte in the
conversation's first link past the shared system prompt.

Life 2: the second session's next turn resumes from the disk tier (cached tokens = the deepest
cut an earlier prompt reached) and its tokens and logprobs equal a cold run of the same
messages in the same engine (a unique `cache_salt` makes that run miss), and its links are
promoted into the RAM tree. The conversation's
next turn reads the damaged file: the load fails, vLLM recomputes it cold (same tokens and
logprobs as a cold run), the miss is counted as `checksum`, the damaged file and its longer
links are deleted, and the server goes on serving. `clear?tier=disk` deletes every file.

End anchors are off here: a turn resumed from one publishes no tree links (session-exact
state), and this test is about the tree links on disk.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest
import requests

from benchmarks.servers import SYSTEMS, ServerError, ServerSettings, running_server
from demo.conversation import demo_sessions
from tests.serving.conftest import (
    GRID,
    KEY,
    MESSAGE_END_MIN,
    cache_stats,
    cached_tokens,
    chat_body,
    expected_hit,
    segmentation,
)
from vllm_hybridcache.core import PromptKeys

pytestmark = pytest.mark.slow

EXTRA = {"logprobs": True, "top_logprobs": 3}


def _disk(srv) -> dict:
    return cache_stats(srv)["tiers"].get("disk", {})


def _wait(srv, what, timeout: float = 60.0) -> dict:
    """Poll the disk tier's stats until `what(stats)` holds (stats ride on step outputs)."""
    deadline = time.monotonic() + timeout
    while True:
        st = _disk(srv)
        if what(st) or time.monotonic() > deadline:
            return st
        time.sleep(0.5)


def _same_as_cold(srv, messages) -> dict:
    """Run `messages` warm and again cold (a fresh cache_salt); assert equal tokens and
    logprobs; return the warm body."""
    warm = chat_body(srv, messages, **EXTRA)
    cold = chat_body(srv, messages, cache_salt=f"cold-{uuid.uuid4().hex}", **EXTRA)
    assert cached_tokens(cold) == 0
    assert warm["choices"][0]["message"] == cold["choices"][0]["message"]
    assert warm["choices"][0]["logprobs"]["content"] == cold["choices"][0]["logprobs"]["content"]
    return warm


def _disk_metric(text: str, name: str) -> float:
    """Sum of a metric's series labelled tier="disk"."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and 'tier="disk"' in line)


def _file(disk: Path, ids: list[int], cut: int) -> Path:
    name = f"{PromptKeys(ids).digest(cut).hex()}-{cut}.link"
    found = list(disk.rglob(name))
    assert len(found) == 1, name
    return found[0]


def test_links_on_disk_serve_the_next_life(embedded_model, tmp_path):
    disk = tmp_path / "disk"
    mp = pytest.MonkeyPatch()
    for k, v in (("GRID", GRID), ("MESSAGE_END_MIN", MESSAGE_END_MIN), ("DISK_DIR", disk),
                 ("SESSION_ANCHORS", 0), ("DISK_WRITE_FIRST_TOKENS", 0)):
        mp.setenv(f"VLLM_HYBRIDCACHE_{k}", str(v))
    settings = ServerSettings(model_path=str(embedded_model("qwen3-next-tiny")),
                              served_name="tiny", max_model_len=8192, port=8340,
                              extra_args=["--api-key", KEY])
    (_, main), (_, sub) = demo_sessions()[:2]
    try:
        # ---------------------------------------------------------------- life 1
        with running_server(SYSTEMS["ours"], settings, tmp_path / "life1.log") as srv:
            seg = segmentation(srv)
            earlier = [chat_body(srv, m)["prompt_token_ids"] for m in (*main[:3], sub[0])]

            def all_written(st: dict) -> bool:
                ram = cache_stats(srv)["tiers"].get("ram", {}).get("kinds", {}).get("tree", {})
                return st.get("links", 0) > 0 and st.get("links") == ram.get("captures")

            st = _wait(srv, all_written)
            assert all_written(st), st
            files = st["links"]
            assert files > 0
        # stopped with SIGTERM; plant an unrelated file, a non-link under a link's name, and
        # a flipped byte (in its last bytes: a view part) in the conversation's first link
        # past what it shares with the second session: every deeper link chains through it
        domain_dir = next(disk.rglob("*.link")).parent
        (domain_dir / "notes.txt").write_text("not a link")
        (domain_dir / ("00" * 16 + "-4096.link")).write_bytes(b"garbage" * 100)
        main_ids, sub_ids = earlier[2], earlier[3]
        damaged_cut = min(c for c in seg.cuts(main_ids) if c < len(main_ids)
                          and main_ids[:c] != sub_ids[:c])
        damaged = _file(disk, main_ids, damaged_cut)
        raw = bytearray(damaged.read_bytes())
        raw[-5] ^= 0x10
        damaged.write_bytes(bytes(raw))

        # ---------------------------------------------------------------- life 2
        with running_server(SYSTEMS["ours"], settings, tmp_path / "life2.log") as srv:
            # the second session's next turn resumes from disk, equal to a cold run
            body = _same_as_cold(srv, sub[1])
            want = expected_hit(seg, body["prompt_token_ids"], earlier)
            assert want > 0 and cached_tokens(body) == want
            st = _wait(srv, lambda s: s.get("tokens_served") == want)
            assert (st["hits"], st["restores"], st["tokens_served"]) == (1, 1, want)
            ram = cache_stats(srv)["tiers"]["ram"]["kinds"]["tree"]
            assert ram["promoted"] > 0  # the disk hit's links now live in the RAM tree
            assert st["misses"].get("not_a_link") == 1  # the garbage file, refused at start
            assert (domain_dir / "notes.txt").read_text() == "not a link"
            metrics = requests.get(srv.base_url + "/metrics").text
            assert _disk_metric(metrics, "vllm:hybridcache_cached_tokens_total") == want

            # the conversation's next turn meets the damaged link: the load fails, vLLM
            # recomputes it cold, the miss is counted and the file deleted with its chain
            body = _same_as_cold(srv, main[3])
            assert expected_hit(seg, body["prompt_token_ids"], earlier) > damaged_cut
            st = _wait(srv, lambda s: s.get("misses", {}).get("checksum") == 1)
            assert st["misses"]["checksum"] == 1 and st["restores_failed"] == 1
            # deleted, or written again from the recomputed (correct) state
            assert not damaged.exists() or damaged.read_bytes() != bytes(raw)
            _same_as_cold(srv, main[3])  # serving goes on

            r = requests.post(srv.base_url + "/v1/cache/clear", params={"tier": "disk"},
                              headers={"Authorization": f"Bearer {KEY}"})
            assert r.status_code == 200, r.text
            assert r.json()["links"] > 0 and not list(disk.rglob("*.link"))
    finally:
        mp.undo()


def test_an_unusable_disk_dir_stops_the_start_up(embedded_model, tmp_path):
    """A disk tier asked for and not usable is a start-up error naming the folder."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_HYBRIDCACHE_DISK_DIR", str(blocker / "disk"))
    settings = ServerSettings(model_path=str(embedded_model("qwen3-next-tiny")),
                              served_name="tiny", max_model_len=8192, port=8350,
                              startup_timeout_s=300)
    try:
        with pytest.raises(ServerError, match="exited"), running_server(
                SYSTEMS["ours"], settings, tmp_path / "bad.log"):
            pass
        log = (tmp_path / "bad.log").read_text(errors="replace")
        assert f"disk_dir '{blocker / 'disk'}' is not usable (NotADirectoryError" in log
    finally:
        mp.undo()
