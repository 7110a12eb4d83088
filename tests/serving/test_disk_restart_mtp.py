"""The disk tier through a SIGTERM restart of the real server with MTP on, and routes that
never cross on one folder.

`vllm serve --plugin hybridcache` on flash-next-tiny in float32 (the greedy gate's dtype) with
its MTP head (`--speculative-config`, k = 2 draft tokens), `VLLM_HYBRIDCACHE_DISK_DIR` and
`--shutdown-timeout` (vLLM's graceful shutdown, where session spill drains). Beside it, on the
same folder, an AR-route server: the same model and settings without speculative decoding.
Prompts are token ids: a system prompt (two grid cuts) shared by a conversation and a
sub-agent, so a next turn is exactly the previous prompt + its answer + new tokens.

Life 1: the MTP server (M1) and the AR server (A) start together. M1 runs the conversation's
first two turns (the second resumes at the first's end anchor in RAM) and a sub-agent call
with the same system prompt; its writer writes the system prompt's tree links, each file
tagged `DraftStep` and holding the hidden-row part. M1 is stopped with SIGTERM: the drain
writes the two live end anchors (tag `RebuiltAnchor`, hidden row and draft-pass parts), the
log says so. A keeps running.

Life 2: M2 (same command, same folder) starts while A holds its folder: M2 sweeps nothing and
keeps A's (in use). The sub-agent's next call (the system prompt + another task) resumes from
the tree links on disk (cached tokens = the deepest grid cut of the system prompt) and equals
a cold run of it in the same engine bit for bit (tokens and logprobs; a unique `cache_salt`
makes that run miss). The conversation's third turn resumes at its spilled end anchor (cached
tokens = prompt + answer - 1 of turn two, the disk anchor tier) and passes the float32 greedy
gate against a cold run (session-exact: held to the same gate as in RAM).

Routes never cross. The routes' files sit under different fingerprint folders (the layout and
the speculative setup are fingerprint fields, docs/disk-tier.md) and carry different headers
(tagged and hidden-row parts vs untagged) and other names (keyed digests of a domain that holds
the route). A, asked the same two prompts while the MTP files for them lie in the folder, gets
no disk hit (tree or anchor) and equals its own cold runs. Even an MTP file copied to the very
name A looks up is refused by its header's fingerprint (a counted `foreign` miss, deleted,
never restored), and the same for an AR file copied to M2's name: M2 refuses it and equals its
cold run.

Negative control: the conversation's spilled anchor rewritten with its recurrent states changed
(every CRC and MAC valid: made with the engines' disk key) is restored (cached tokens at the
anchor), and the greedy gate against the cold run then fails: the comparison catches a bad
restore.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import msgspec
import pytest
import requests
import torch

from benchmarks.servers import SYSTEMS, ServerSettings, running_server
from tests.connector.test_end_anchors import greedy_gate
from tests.keys import KEY_FILE, TEST_KEY
from tests.serving.conftest import ADMIN, KEY, cache_stats
from tests.serving.disk_files import link_file
from tests.serving.test_disk_session_spill import OUT, _complete, _turn
from vllm_hybridcache.adapter.draft_rows import DRAFT_INPUT, DRAFT_PASS
from vllm_hybridcache.core import PromptKeys
from vllm_hybridcache.core.linkformat.linkfile import (
    _PRE,
    LinkFileHeader,
    read_header,
    read_parts,
    write_link_file,
)

pytestmark = pytest.mark.slow

GRID = 256
K = 2  # draft tokens
SYS = [900 + (i * 29) % 2100 for i in range(600)]    # the shared system prompt: cuts 256, 512
C1 = SYS + [40 + (i * 7) % 900 for i in range(100)]  # the conversation's first turn
T1 = [1200 + (i * 11) % 800 for i in range(90)]      # the sub-agent's tasks
T2 = [300 + (i * 13) % 700 for i in range(80)]
T3 = [2300 + (i * 17) % 500 for i in range(70)]
assert len({T1[0], T2[0], T3[0], C1[len(SYS)]}) == 4  # every prompt parts from SYS at once
SYS_CUTS = [GRID, 2 * GRID]


def _stats(srv, tier: str, kind: str) -> dict:
    return cache_stats(srv)["tiers"].get(tier, {}).get("kinds", {}).get(kind, {})


def _wait(srv, what, timeout: float = 120.0) -> None:
    """Poll /v1/cache/stats until `what(srv)` holds (stats ride on step outputs)."""
    deadline = time.monotonic() + timeout
    while not what(srv):
        assert time.monotonic() < deadline, f"not reached: {cache_stats(srv)}"
        time.sleep(0.3)


def _settled(srv, anchors: int) -> bool:
    """`anchors` end anchors committed and every committed tree link written to a file."""
    ram_tree = _stats(srv, "ram", "tree").get("captures", 0)
    return (_stats(srv, "ram", "anchor").get("captures", 0) >= anchors
            and _stats(srv, "disk", "tree").get("links", 0) == ram_tree > 0)


def _cold(srv, prompt: list[int]) -> dict:
    out = _complete(srv, prompt, cache_salt=f"cold-{uuid.uuid4().hex}")
    assert out["cached"] == 0
    return out


def _same(warm: dict, cold: dict) -> None:
    """Bit for bit: the same tokens and the same top-5 logprobs at every position."""
    assert warm["ids"] == cold["ids"]
    assert warm["logprobs"] == cold["logprobs"]


def _clear_ram(srv) -> None:
    r = requests.post(srv.base_url + "/v1/cache/clear", params={"tier": "ram"},
                      headers=ADMIN)
    assert r.status_code == 200, r.text


def _fingerprint(path: Path) -> bytes:
    """The fingerprint a link file's header names (read without verifying it)."""
    raw = path.read_bytes()
    _, hlen, _, _ = _PRE.unpack(raw[:_PRE.size])
    return msgspec.msgpack.decode(raw[_PRE.size:_PRE.size + hlen],
                                  type=LinkFileHeader).fingerprint


def _route_files(disk: Path, fp_dir: str, anchors: bool = False) -> dict[int, Path]:
    """One fingerprint folder's link files of the unsalted domain, by end (tree links, or
    spilled end anchors). Cold runs with a unique `cache_salt` have domain folders of their
    own: the unsalted domain's folder is the one holding the system prompt's 256 link."""
    sys_link = link_file(disk / fp_dir, PromptKeys(SYS).digest(GRID), GRID,
                         pattern=f"*/*-{GRID}.link")
    dom = sys_link.parent.name
    sub = disk / fp_dir / (f"a-{dom}" if anchors else dom)
    return {int(p.stem.rsplit("-", 1)[1]): p for p in sub.glob("*.link")}


def _corrupt_states(path: Path) -> None:
    """Rewrite a link file with its recurrent states changed (x -> 0.5 - x in every GDN
    layer's conv tail and recurrent state, sections #0 and #1, float32; Flash-Next's PLE
    sections, which hold token ids, are left alone) and every CRC valid: a bad restore no
    check can see."""
    fp = _fingerprint(path)
    h, base = read_header(path, fp, TEST_KEY)
    parts = {e.name: torch.empty(e.nbytes, dtype=torch.uint8) for e in h.parts}
    read_parts(path, h, base, parts, TEST_KEY)
    states = [n for n in parts if ".linear_attn#" in n and n.endswith(("#0", "#1"))]
    assert states, sorted(parts)
    for n in states:
        parts[n].view(torch.float32).mul_(-1.0).add_(0.5)
    write_link_file(path, fingerprint=h.fingerprint, domain=h.domain, digest=h.digest,
                    parent_digest=h.parent_digest, start=h.start, end=h.end,
                    tokens=h.token_ids(), rows=h.rows, parts=parts, created=h.created,
                    kind=h.kind, tag=h.tag, key=TEST_KEY)


def _start_together(*servers: tuple[ExitStack, object]) -> list:
    """Enter several `running_server`s at once (their start-ups overlap); each one's stop is
    pushed on its own stack (so one can be stopped alone), and a failed start still stops
    the others."""
    with ThreadPoolExecutor(len(servers)) as pool:
        futures = [pool.submit(cm.__enter__) for _, cm in servers]
        started, error = [], None
        for (stack, cm), fut in zip(servers, futures, strict=True):
            try:
                started.append(fut.result())
                stack.push(cm.__exit__)
            except BaseException as e:
                error = error or e
    if error is not None:
        raise error
    return started


def test_mtp_route_survives_a_restart_and_never_crosses_the_ar_route(embedded_model,
                                                                       tmp_path):
    disk = tmp_path / "disk"
    mp = pytest.MonkeyPatch()
    for k, v in (("GRID", GRID), ("MESSAGE_END_IDS", -1), ("DISK_DIR", disk),
                 ("DISK_KEY_FILE", KEY_FILE),
                 ("DISK_WRITE_FIRST_TOKENS", 0)):  # every committed tree link is written
        mp.setenv(f"VLLM_HYBRIDCACHE_{k}", str(v))
    ar = ServerSettings(model_path=str(embedded_model("flash-next-tiny")), served_name="tiny",
                        max_model_len=4096, port=8390,
                        extra_args=["--api-key", KEY, "--dtype", "float32",
                                    "--shutdown-timeout", "25"])
    spec = json.dumps({"method": "mtp", "num_speculative_tokens": K})
    mtp = msgspec.structs.replace(ar, port=8380,
                                  extra_args=[*ar.extra_args, "--speculative-config", spec])
    ours = SYSTEMS["ours"]
    try:
        with ExitStack() as a_stack:
            m1_stack = a_stack.enter_context(ExitStack())
            m1, a = _start_together(
                (m1_stack, running_server(ours, mtp, tmp_path / "m1.log")),
                (a_stack, running_server(ours, ar, tmp_path / "ar.log")))
            # ---------------------------------------------- life 1: M1 (A idle beside it)
            ans1 = _complete(m1, C1)
            c2 = _turn(C1, ans1, [15 + i for i in range(40)])
            ans2 = _complete(m1, c2)
            assert ans2["cached"] == len(C1) + OUT - 1  # turn 1's end anchor, in RAM
            s1 = _complete(m1, SYS + T1)
            assert s1["cached"] == 2 * GRID             # C1's tree links, in RAM
            _wait(m1, lambda s: _settled(s, 3))
            (fp_m,) = {p.relative_to(disk).parts[0] for p in disk.rglob("*.link")}
            tree_m = _route_files(disk, fp_m)
            assert sorted(tree_m) == SYS_CUTS
            for end, path in tree_m.items():  # tagged, with the hidden row: the MTP route
                h, _ = read_header(path, _fingerprint(path), TEST_KEY)
                assert h.tag == ("DraftStep", (end - GRID,)), h.tag
                assert DRAFT_INPUT in {e.name for e in h.parts}
            m1_stack.close()  # SIGTERM: the drain writes the live end anchors
            log = (tmp_path / "m1.log").read_text(errors="replace")
            assert "session spill wrote 2 of 2 end anchors" in log, log[-3000:]
            anchors_m = _route_files(disk, fp_m, anchors=True)
            n2 = len(c2) + OUT - 1                      # the conversation's live anchor
            assert sorted(anchors_m) == sorted([n2, len(SYS + T1) + OUT - 1])
            h, _ = read_header(anchors_m[n2], _fingerprint(anchors_m[n2]), TEST_KEY)
            assert h.kind == "anchor" and h.tag == ("RebuiltAnchor", ())
            assert {DRAFT_INPUT, DRAFT_PASS} <= {e.name for e in h.parts}

            # ---------------------------------------------- life 2: M2 on the same folder
            m2 = a_stack.enter_context(running_server(ours, mtp, tmp_path / "m2.log"))
            log = (tmp_path / "m2.log").read_text(errors="replace")
            # A's folder is in use: kept, and M2 (another fingerprint) never reads it
            assert re.search(r"disk tier on .*: 4 files, \d+ bytes; swept 0 foreign folders "
                             r"\(1 kept: in use\)", log), log[-3000:]
            # the sub-agent's next call: from the tree links on disk, equal to cold
            s2 = SYS + T2
            warm = _complete(m2, s2)
            assert warm["cached"] == 2 * GRID
            _same(warm, _cold(m2, s2))
            _wait(m2, lambda s: _stats(s, "disk", "tree").get("tokens_served") == 2 * GRID)
            st = _stats(m2, "disk", "tree")
            assert (st["hits"], st["restores"], st["tokens_served"]) == (1, 1, 2 * GRID), st
            assert st.get("restores_failed", 0) == 0 and not st.get("misses", {}).get("draft_tag")
            # the conversation's next turn: at its spilled end anchor, the greedy gate
            c3 = _turn(c2, ans2, [60 + i for i in range(30)])
            warm_c3 = _complete(m2, c3)
            assert warm_c3["cached"] == n2
            cold_c3 = _cold(m2, c3)
            assert greedy_gate(warm_c3, cold_c3) == OUT
            _wait(m2, lambda s: _stats(s, "disk", "anchor").get("tokens_served") == n2)
            st = _stats(m2, "disk", "anchor")
            assert (st["hits"], st["restores"], st["tokens_served"]) == (1, 1, n2), st

            # ---------------------------------------------- routes never cross
            # A (AR route): the MTP files of these prompts lie in the folder, in M's
            # fingerprint folder; A gets no disk hit (tree or anchor) and equals its own cold
            # runs
            ar_s2 = _complete(a, s2)
            assert ar_s2["cached"] == 0
            _wait(a, lambda s: _stats(s, "disk", "tree").get("links", 0)
                  == _stats(s, "ram", "tree").get("captures", 0) > 0)
            fps = {p.relative_to(disk).parts[0] for p in disk.rglob("*.link")}
            (fp_a,) = fps - {fp_m}
            tree_a = _route_files(disk, fp_a)  # (before a cold run adds salted folders)
            assert sorted(tree_a) == SYS_CUTS
            ar_c3 = _complete(a, c3)
            assert ar_c3["cached"] == 2 * GRID  # A's own RAM links (s2's), not M's anchor
            cold_ar_s2 = _cold(a, s2)
            _same(ar_s2, cold_ar_s2)
            _same(ar_c3, _cold(a, c3))
            for kind in ("tree", "anchor"):
                st = _stats(a, "disk", kind)
                assert st.get("hits", 0) == 0 and st.get("restores", 0) == 0, (kind, st)
            for end in SYS_CUTS:  # untagged, no hidden row: the AR route; and other names
                # (a name is a keyed digest of the domain, which holds the route)
                assert tree_a[end].name != tree_m[end].name
                h, _ = read_header(tree_a[end], _fingerprint(tree_a[end]), TEST_KEY)
                assert h.tag is None and DRAFT_INPUT not in {e.name for e in h.parts}
                assert h.fingerprint != _fingerprint(tree_m[end])
            ar_bytes = {end: tree_a[end].read_bytes() for end in SYS_CUTS}
            mtp_bytes = {end: tree_m[end].read_bytes() for end in SYS_CUTS}
            # an MTP file at the very name A looks up: refused by its header's fingerprint
            for end in SYS_CUTS:
                tree_a[end].write_bytes(mtp_bytes[end])
            _clear_ram(a)
            out = _complete(a, s2)
            _wait(a, lambda s: _stats(s, "disk", "tree")["misses"].get("foreign") == 2)
            st = _stats(a, "disk", "tree")
            assert out["cached"] == 0 and st["misses"].get("foreign") == 2, st
            assert st.get("restores", 0) == 0
            _same(out, cold_ar_s2)

            # negative control: the conversation's anchor file with its recurrent states
            # changed and every CRC valid is restored, and the greedy gate catches it
            _corrupt_states(anchors_m[n2])
            _clear_ram(m2)
            bad = _complete(m2, c3)
            assert bad["cached"] == n2
            _wait(m2, lambda s: _stats(s, "disk", "anchor").get("restores") == 2)
            with pytest.raises(AssertionError):
                greedy_gate(bad, cold_c3)

            # an AR file at the very name M2 looks up: refused the same way
            for end in SYS_CUTS:
                tree_m[end].write_bytes(ar_bytes[end])
            _clear_ram(m2)
            s3 = SYS + T3
            out = _complete(m2, s3)
            _wait(m2, lambda s: _stats(s, "disk", "tree")["misses"].get("foreign") == 2)
            st = _stats(m2, "disk", "tree")
            assert out["cached"] == 0 and st["misses"].get("foreign") == 2, st
            assert st["restores"] == 1  # the sub-agent's call above only
            _same(out, _cold(m2, s3))
    finally:
        mp.undo()
