"""The disk tier through the real server: links written in one life serve the next one, and a
second server on the same folder.

Life 1: two servers (`vllm serve --plugin hybridcache`, same model and settings, so the same
engine fingerprint) share one `VLLM_HYBRIDCACHE_DISK_DIR`. Server A runs three turns of a
conversation and the first turn of a second session sharing its system prompt; every committed
tree link is written to a link file. Server B then serves that first turn from the files A
wrote (a disk hit: cached tokens = the deepest cut A reached), and its tokens and logprobs
equal B's own cold run of it (a unique `cache_salt`). Then both servers run the conversation's
fourth turn at the same time (interleaved traffic: both read the same files and write the same
new links), each equal to its own cold run. B is then killed with SIGKILL right after a cold
run whose links its writer is writing, A stopped with SIGTERM: every link file left verifies
in full (header and every part's CRC-32; a cut write leaves only a temporary).

One server is started again on the same folder, with three
things planted in it: an unrelated file (kept, never read), a file that is not a link under a
link's name (refused at start) and a flipped byte in the conversation's first link past the
shared system prompt.

Life 2: the second session's next turn resumes from the disk tier (cached tokens = the deepest
cut an earlier prompt reached) and its tokens and logprobs equal a cold run of the same
messages in the same engine (a unique `cache_salt` makes that run miss), and its links are
promoted into the RAM tree. The conversation's
next turn reads the damaged file: the load fails, vLLM recomputes it cold (same tokens and
logprobs as a cold run), the miss is counted as `checksum`, the damaged file and its longer
links are deleted, and the server goes on serving. `clear?tier=disk` deletes every file.

Negative control of the disk route, end to end: life 1 also serves the second session's first
turn under two salts of their own (two domains, files of their own). In life 2 each is served
from those files again: one equals its cold run; the other's restored state is corrupted in
the worker after every check of the file passed (header, CRCs: the fault injection's
`RestoreCorruption`), and the same comparison calls it different. The comparisons here can
fail, and what makes one fail is the state, not the route.

End anchors are off here: a turn resumed from one publishes no tree links (session-exact
state), and this test is about the tree links on disk.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec
import pytest
import requests

from benchmarks.servers import (
    SYSTEMS,
    ServerError,
    ServerSettings,
    running_server,
    running_servers,
)
from demo.conversation import demo_sessions
from tests.keys import KEY_FILE, TEST_KEY
from tests.serving.conftest import (
    ADMIN,
    GRID,
    KEY,
    MESSAGE_END_MIN,
    TOOLS,
    cache_stats,
    cached_tokens,
    chat_body,
    expected_hit,
    segmentation,
)
from tests.serving.disk_files import link_file
from tests.serving.worker_extensions import corrupt_next_restore, corruption_result
from vllm_hybridcache.core import PromptKeys
from vllm_hybridcache.core.linkformat.linkfile import _PRE, TMP_PREFIX, LinkFileHeader, read_header

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


def _warm_and_cold(srv, messages, salt: str | None = None, **extra) -> tuple[dict, dict]:
    """Run `messages` warm (in `salt`'s domain, the shared one by default) and again cold (a
    fresh cache_salt, which must miss); both response bodies. `extra`: more request fields."""
    warm = chat_body(srv, messages, **EXTRA, **extra, **({"cache_salt": salt} if salt else {}))
    cold = chat_body(srv, messages, cache_salt=f"cold-{uuid.uuid4().hex}", **EXTRA, **extra)
    assert cached_tokens(cold) == 0
    return warm, cold


def _assert_same(warm: dict, cold: dict) -> None:
    """The comparison: equal tokens and logprobs."""
    assert warm["choices"][0]["message"] == cold["choices"][0]["message"]
    assert warm["choices"][0]["logprobs"]["content"] == cold["choices"][0]["logprobs"]["content"]


def _same_as_cold(srv, messages, salt: str | None = None, **extra) -> dict:
    """Run `messages` warm and again cold (`_warm_and_cold`); assert equal tokens and
    logprobs; return the warm body. `extra`: more request fields (other tools)."""
    warm, cold = _warm_and_cold(srv, messages, salt, **extra)
    _assert_same(warm, cold)
    return warm


def _disk_metric(text: str, name: str) -> float:
    """Sum of a metric's series labelled tier="disk"."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and 'tier="disk"' in line)


def _file(domain_dir: Path, ids: list[int], cut: int) -> Path:
    """The link file of `ids[:cut]` in one domain's folder (cold runs with a unique
    `cache_salt` write the same names in folders of their own)."""
    return link_file(domain_dir, PromptKeys(ids).digest(cut), cut)


def _all_links_verify(disk: Path) -> int:
    """Every link file under `disk` is complete: header and every part's CRC-32 verify.
    Temporaries (a write a kill cut short) are skipped: never read, swept when stale."""
    n = 0
    for p in disk.rglob("*.link"):
        if p.name.startswith(TMP_PREFIX):
            continue
        raw = p.read_bytes()
        _, hlen, _, _ = _PRE.unpack(raw[:_PRE.size])
        fp = msgspec.msgpack.decode(raw[_PRE.size:_PRE.size + hlen],
                                    type=LinkFileHeader).fingerprint
        header, base = read_header(p, fp, TEST_KEY)
        for e in header.parts:
            assert zlib.crc32(raw[base + e.offset:base + e.offset + e.nbytes]) == e.crc32, p
        n += 1
    return n


def test_links_on_disk_serve_the_next_life(embedded_model, tmp_path):
    disk = tmp_path / "disk"
    mp = pytest.MonkeyPatch()
    # step mode on purpose (INNER_CAPTURES 0): the expected hits are the grid and message-end
    # cuts (`expected_hit`), as in the folder's shared server (tests/serving/conftest.py)
    for k, v in (("GRID", GRID), ("MESSAGE_END_MIN", MESSAGE_END_MIN), ("DISK_DIR", disk),
                 ("DISK_KEY_FILE", KEY_FILE),
                 ("SESSION_ANCHORS", 0), ("DISK_WRITE_FIRST_TOKENS", 0),
                 ("INNER_CAPTURES", 0)):
        mp.setenv(f"VLLM_HYBRIDCACHE_{k}", str(v))
    # the fault injection (test-only worker extension): the negative control's corruption
    settings = ServerSettings(model_path=str(embedded_model("qwen3-next-tiny")),
                              served_name="tiny", max_model_len=8192, port=8340,
                              extra_args=["--api-key", KEY, "--worker-extension-cls",
                                          "vllm_hybridcache.testing.instrumentation.FaultInjection"])
    other = msgspec.structs.replace(settings, port=8345)  # server B: same engine, another port
    # the negative control's two domains: one restored as is, one corrupted (life 2)
    intact, corrupted = f"intact-{uuid.uuid4().hex}", f"corrupted-{uuid.uuid4().hex}"
    (_, main), (_, sub) = demo_sessions()[:2]
    try:
        # ------------------------------------------- life 1: servers A and B, one folder
        with running_servers((SYSTEMS["ours"], settings, tmp_path / "life1-a.log"),
                             (SYSTEMS["ours"], other, tmp_path / "life1-b.log")) as (srv, srv_b):
            seg = segmentation(srv)
            earlier = [chat_body(srv, m)["prompt_token_ids"] for m in (*main[:3], sub[0])]

            def all_written(st: dict) -> bool:
                ram = cache_stats(srv)["tiers"].get("ram", {}).get("kinds", {}).get("tree", {})
                return st.get("links", 0) > 0 and st.get("links") == ram.get("captures")

            st = _wait(srv, all_written)
            assert all_written(st), st
            assert st["links"] > 0
            # the one domain so far (no cache_salt yet): cold runs below add folders of theirs
            (domain_dir,) = {p.parent for p in disk.rglob("*.link")}
            # the negative control's domains, written like the shared one
            for salt in (intact, corrupted):
                chat_body(srv, sub[0], cache_salt=salt, **EXTRA)
            assert all_written(_wait(srv, all_written))

            # B serves the second session's first turn from the links A wrote (B's RAM is
            # empty: every cached token comes from A's files), equal to B's cold run
            body = _same_as_cold(srv_b, sub[0])
            want_b = expected_hit(seg, body["prompt_token_ids"], earlier)
            assert want_b > 0 and cached_tokens(body) == want_b
            st_b = _wait(srv_b, lambda s: s.get("tokens_served") == want_b)
            assert (st_b["hits"], st_b["restores"], st_b["tokens_served"]) == (1, 1, want_b)
            assert st_b.get("restores_failed", 0) == 0

            # interleaved traffic: both servers run the conversation's next turn at once (both
            # read A's files, both write its new links under the same names), each equal to
            # its own cold run
            with ThreadPoolExecutor(2) as pool:
                bodies = list(pool.map(lambda s: _same_as_cold(s, main[3]), (srv, srv_b)))
            earlier.append(bodies[0]["prompt_token_ids"])
            for s in (srv, srv_b):
                assert _disk(s).get("restores_failed", 0) == 0

            # kill -9 of server B with its writer busy: a cold run (fresh salt) has just
            # committed links the writer writes in the background; SIGKILL the whole process
            # group at once (no drain)
            chat_body(srv_b, main[3], cache_salt=f"killed-{uuid.uuid4().hex}")
            os.killpg(srv_b.pid, signal.SIGKILL)
        # whatever the kill cut short left no torn link: every `.link` verifies in full
        assert _all_links_verify(disk) > 0
        # B killed, A stopped with SIGTERM; plant an unrelated file, a non-link under a link's
        # name, and a flipped byte (in its last bytes: a view part) in the conversation's first
        # link past what it shares with the second session: every deeper link chains through it
        (domain_dir / "notes.txt").write_text("not a link")
        (domain_dir / ("00" * 16 + "-4096.link")).write_bytes(b"garbage" * 100)
        main_ids, sub_ids = earlier[2], earlier[3]
        damaged_cut = min(c for c in seg.cuts(main_ids) if c < len(main_ids)
                          and main_ids[:c] != sub_ids[:c])
        damaged = _file(domain_dir, main_ids, damaged_cut)
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

            # the same turn with the last tool left out parts from that chain inside it: its
            # hit ends at a promoted link whose state the disk hit did not read (only the
            # deepest link's is needed then, core/linkformat/reader.py), served from RAM with the
            # state read from its file now, equal to a cold run
            hits = cache_stats(srv)["tiers"]["ram"]["kinds"]["tree"]["hits"]
            body = _same_as_cold(srv, sub[0], tools=TOOLS[:-1])
            shared = expected_hit(seg, body["prompt_token_ids"], earlier)
            assert 0 < shared < want and cached_tokens(body) == shared
            assert cache_stats(srv)["tiers"]["ram"]["kinds"]["tree"]["hits"] == hits + 1

            # the conversation's next turn meets the damaged link: the load fails, vLLM
            # recomputes it cold, the miss is counted and the file deleted with its chain
            body = _same_as_cold(srv, main[3])
            assert expected_hit(seg, body["prompt_token_ids"], earlier) > damaged_cut
            st = _wait(srv, lambda s: s.get("misses", {}).get("checksum") == 1)
            assert st["misses"]["checksum"] == 1 and st["restores_failed"] == 1
            # deleted, or written again from the recomputed (correct) state
            assert not damaged.exists() or damaged.read_bytes() != bytes(raw)
            _same_as_cold(srv, main[3])  # serving goes on

            # negative control: the second session's first turn in the two salted domains life
            # 1 wrote, each served from its files (disk hits, this life's RAM holds neither);
            # the comparison passes as is and fails with the restored state corrupted after the
            # file's checks passed
            hits = _disk(srv)["hits"]
            body = _same_as_cold(srv, sub[0], salt=intact)
            want = cached_tokens(body)
            assert want > 0 and _wait(srv, lambda s: s["hits"] == hits + 1)["hits"] == hits + 1
            tag = f"negative-control-{uuid.uuid4().hex}"
            corrupt_next_restore(srv, tag, {"Authorization": f"Bearer {KEY}"})
            warm, cold = _warm_and_cold(srv, sub[0], salt=corrupted, request_id=tag)
            done = corruption_result(srv, tag, {"Authorization": f"Bearer {KEY}"})
            assert done is not None and done["corrupted"]
            assert (done["tier"], done["tokens"]) == ("disk", want) == ("disk", cached_tokens(warm))
            with pytest.raises(AssertionError):
                _assert_same(warm, cold)
            assert _wait(srv, lambda s: s["hits"] == hits + 2)["hits"] == hits + 2

            r = requests.post(srv.base_url + "/v1/cache/clear", params={"tier": "disk"},
                              headers=ADMIN)
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
