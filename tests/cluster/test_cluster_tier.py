"""The cluster tier's logic without Ray or vLLM: two replicas (tree + store + cluster tier each)
share an in-process fake transport. A link committed on A is found by B, staged, verified and
restored byte for byte; every failure is a counted miss that serves nothing."""

from __future__ import annotations

import pytest

from tests.cluster.fakes import DOM, FP, PROMPT, FakeCluster, Replica, cuts_of, relisted
from tests.cluster.forgery import forge, forge_keeping_header
from tests.keys import other_key
from vllm_hybridcache.core.keys import PromptKeys
from vllm_hybridcache.core.linkformat.reader import DiskReadError, stage_chain
from vllm_hybridcache.core.tiers.cluster import ClusterMiss, ClusterTier


@pytest.fixture
def pair(tmp_path, layout):
    c = FakeCluster()
    a = Replica(c, "a", layout, tmp_path)
    b = Replica(c, "b", layout, tmp_path)
    a.capture(PROMPT)
    return c, a, b


def test_remote_chain_restores_byte_for_byte_and_is_promoted(pair):
    _c, a, b = pair
    expected = a.restore_bytes(a.tree.lookup(a.tree.keys(PROMPT), DOM).plan.chain)
    keys = b.cache.keys(PROMPT)
    first = b.cache.lookup(keys, DOM, len(PROMPT) - 1)
    assert first.pending and first.tier == "cluster"  # never blocks: asked again next step
    _, res = b.lookup(PROMPT)
    assert res.hit and res.tier == "cluster" and res.tokens == 256
    assert [(r.start, r.end) for r in res.plan.chain] == [(0, 64), (64, 128), (128, 256)]
    assert b.serve(res) == expected
    b.cache.sanity_check()
    st = b.tier.stats()
    assert st.restores == 1 and st.tokens_served == 256 and b.tier.remote_bytes > 0
    assert b.tier.bytes_held == 0 and not list((b.tmp / "stage").iterdir())  # files gone
    # promoted: the next lookup is a RAM hit with the same bytes
    ram = b.cache.lookup(keys, DOM, len(PROMPT) - 1)
    assert ram.hit and ram.tier == "ram" and ram.tokens == 256
    assert b.restore_bytes(ram.plan.chain) == expected
    assert b.cache.drain_dropped() == []  # every staged id adopted


def test_a_flipped_payload_byte_never_reaches_the_store(pair):
    """Negative control: a damaged part is refused by the worker's CRC check."""
    c, _a, b = pair
    h = max(c.objects)  # the deepest link's payload
    data = bytearray(c.objects[h])
    data[-1] ^= 0xFF
    c.objects[h] = bytes(data)
    _, res = b.lookup(PROMPT)
    assert res.hit
    assert b.cache.begin_restore(res)
    with pytest.raises(DiskReadError) as ei:
        stage_chain(b.store, res.plan.chain, b.cache.sources(res), b.fp, key=b.key,
                    root=b.tier.stage_dir)
    assert ei.value.problem == "checksum"
    assert not any(b.store.has(r.link_id) for r in res.plan.chain)
    b.cache.end_restore(res, False)
    assert b.tier.stats().restores_failed == 1


def test_header_damage_and_foreign_fingerprint_are_counted_misses(pair, tmp_path, layout):
    c, _a, b = pair
    key = next(k for k in c.entries if c.entries[k].end == 64)
    h = c.entries[key].handle
    data = bytearray(c.objects[h])
    data[60] ^= 0xFF  # inside the header (past the 48-byte prelude: magic, sizes, CRC, MAC)
    c.objects[h] = bytes(data)
    _, res = b.lookup(PROMPT)
    assert not res.hit and b.tier.stats().misses[ClusterMiss.CORRUPT] == 1
    assert c.entries == {} or all(k != key for k in c.entries)  # forgotten
    # another engine's fingerprint: its entries are never located (0 tokens)...
    other = Replica(c, "o", layout, tmp_path, fp=b"G" * 32)
    other.capture(PROMPT)
    _, res = b.lookup(PROMPT[:200])
    assert not res.hit and res.tokens == 0
    # ...and a payload of another fingerprint listed under ours is refused as foreign
    keys = PromptKeys(PROMPT)
    for e in list(c.entries.values()):
        loc, mine = relisted(e, keys)
        c.entries[loc] = mine
    b.clock.t += 100
    _, res = b.lookup(PROMPT[:200])
    assert not res.hit and b.tier.stats().misses[ClusterMiss.FOREIGN] == 1


def test_tokens_that_differ_from_the_prompt_are_refused(pair):
    """A directory entry whose locator says 'this prompt' but whose payload holds other tokens
    (a digest collision, a confused directory) is a verify_failed miss."""
    c, _a, b = pair
    prompt2 = PROMPT.copy()
    prompt2[10] += 1
    keys2 = b.cache.keys(prompt2)
    for e in list(c.entries.values()):
        loc, listed = relisted(e, keys2)
        c.entries[loc] = listed
    _, res = b.lookup(prompt2)
    assert not res.hit and b.tier.stats().misses[ClusterMiss.VERIFY_FAILED] == 1


def test_a_payload_forged_without_the_secret_is_refused_before_it_is_staged(pair, tmp_path):
    """Issue 29: valid CRCs no longer make a payload acceptable. The deepest link re-written
    with every CRC valid but MACs under another secret is refused by the scheduler's header
    check: an `unauthenticated` miss, nothing staged or served, the chain forgotten. Before
    the MACs (1f3f6d5) the same forgery passed every check and was served."""
    c, _a, b = pair
    deepest = max(c.entries, key=lambda k: c.entries[k].end)
    h = c.entries[deepest].handle
    c.objects[h] = forge(c.objects[h], tmp_path, b.key, write_key=other_key("cluster"))
    _, res = b.lookup(PROMPT)
    assert not res.hit and res.tokens == 0
    st = b.tier.stats()
    assert st.misses[ClusterMiss.UNAUTHENTICATED] == 1 and st.restores == 0
    assert not list(b.tier.stage_dir.iterdir()) and b.tier.bytes_held == 0
    assert deepest in c.forgotten and deepest not in c.entries
    # the same forgery made with the secret (what a bug in a copy makes) passes every check:
    # only a comparison of the outputs catches that one (the serving tests' controls)
    c2 = FakeCluster()
    a2 = Replica(c2, "a2", b.layout, tmp_path)
    a2.capture(PROMPT)
    expected = a2.restore_bytes(a2.tree.lookup(a2.tree.keys(PROMPT), DOM).plan.chain)
    d2 = max(c2.entries, key=lambda k: c2.entries[k].end)
    h2 = c2.entries[d2].handle
    c2.objects[h2] = forge(c2.objects[h2], tmp_path, a2.key)
    b2 = Replica(c2, "b2", b.layout, tmp_path)
    _, res = b2.lookup(PROMPT)
    assert res.hit and res.tokens == 256
    assert b2.serve(res) != expected  # restored, and the state is not the owner's
    assert b2.tier.stats().restores == 1


def test_a_part_altered_with_its_crc_kept_is_refused_by_the_worker(pair, tmp_path):
    """The true header bytes (MAC valid) with parts altered so that every CRC-32 still
    matches: the scheduler's header check passes, the worker's read refuses the part by its
    MAC (`unauthenticated`) before any byte reaches the store, the refusal is counted where
    the adapter reports it (`note_refused`) and the chain leaves the directory once the
    adapter invalidates the refused link, after it ended the failed restore (before the fix,
    `invalidate` looked among the active restores only, found none, and the payload stayed
    listed). With CRCs only (1f3f6d5), this restored."""
    c, _a, b = pair
    h = max(c.objects)  # the deepest link's payload
    c.objects[h] = forge_keeping_header(c.objects[h], tmp_path, b.key)
    _, res = b.lookup(PROMPT)
    assert res.hit and res.tier == "cluster"
    assert b.cache.begin_restore(res)
    with pytest.raises(DiskReadError) as ei:
        stage_chain(b.store, res.plan.chain, b.cache.sources(res), b.fp, key=b.key,
                    root=b.tier.stage_dir)
    assert ei.value.problem == "unauthenticated"
    assert not any(b.store.has(r.link_id) for r in res.plan.chain)
    # what the adapter does with the worker's report: the failed restore ends, the refusal
    # is counted, the refused link is invalidated (in that order)
    b.cache.end_restore(res, False)
    b.tier.note_refused(ei.value.problem)
    chain = [c.entries[k].locator for k in sorted(c.entries, key=lambda k: c.entries[k].end)]
    assert b.tier.invalidate([res.plan.chain[-1].link_id]) == 3
    st = b.tier.stats()
    assert st.misses[ClusterMiss.UNAUTHENTICATED] == 1
    assert st.restores == 0 and st.restores_failed == 1 and st.invalidated == 3
    # the chain left the directory: no replica fetches the refused payload again
    assert c.forgotten == chain and c.entries == {}
    b.clock.t += 100
    _, res = b.lookup(PROMPT)
    assert not res.hit and b.tier.stats().fetches == 1


@pytest.mark.parametrize("fault,reason", [("owner", ClusterMiss.OWNER_LOST),
                                          ("object", ClusterMiss.OBJECT_LOST),
                                          ("silent", ClusterMiss.TIMEOUT)])
def test_lost_owner_object_or_timeout_is_a_counted_miss(pair, fault, reason):
    c, _a, b = pair
    if fault == "owner":
        c.dead.add("a")
    elif fault == "object":
        c.objects.clear()
    else:
        c.silent = True
    keys = b.cache.keys(PROMPT)
    res = b.cache.lookup(keys, DOM, len(PROMPT) - 1)
    assert res.pending
    if fault == "silent":
        b.clock.t += 11
    _, res = b.lookup(PROMPT)
    assert not res.hit and res.tokens == 0
    assert b.tier.stats().misses[reason] == 1
    assert b.tier.lookup(keys, DOM, len(PROMPT) - 1).miss_reason == reason
    if fault != "silent":
        assert c.entries == {}  # the failed entries left the directory
    b.cache.sanity_check()


def test_fetch_time_and_bytes_are_counted_from_the_fetch_issued_to_payloads_staged(pair):
    """The stats weigh a transfer against the prefill it saved: seconds from the fetch issued
    to the chain staged and verified, its bytes, and the directory's answer time apart."""
    c, _a, b = pair
    keys = b.cache.keys(PROMPT)
    assert b.cache.lookup(keys, DOM, len(PROMPT) - 1).pending  # locate issued at t = 0
    b.clock.t = 0.5
    assert b.cache.lookup(keys, DOM, len(PROMPT) - 1).pending  # located; fetch issued
    b.clock.t = 2.0
    res = b.cache.lookup(keys, DOM, len(PROMPT) - 1)           # payloads here and staged
    assert res.hit and res.tier == "cluster"
    st = b.tier.stats()
    payload = sum(e.nbytes for e in c.entries.values())
    assert st.fetches == 1 and st.fetch_bytes == payload == b.tier.remote_bytes
    assert st.fetch_seconds.count == 1 and st.fetch_seconds.sum == pytest.approx(1.5)
    assert st.locate_seconds.count == 1 and st.locate_seconds.sum == pytest.approx(0.5)
    c.dead.add("a")  # a failed fetch adds neither seconds nor bytes
    other = PROMPT[:200]
    assert not b.lookup(other)[1].hit
    st = b.tier.stats()
    assert st.misses[ClusterMiss.OWNER_LOST] == 1
    assert st.fetches == 1 and st.fetch_seconds.count == 1 and st.fetch_bytes == payload


def test_staged_bytes_count_against_the_budget(tmp_path, layout):
    c = FakeCluster()
    a = Replica(c, "a", layout, tmp_path)
    a.capture(PROMPT)
    small = Replica(c, "b", layout, tmp_path, budget=1000)
    _, res = small.lookup(PROMPT)
    assert not res.hit and small.tier.stats().misses[ClusterMiss.BUDGET] == 1
    big = Replica(c, "c", layout, tmp_path)
    _, res = big.lookup(PROMPT)
    assert res.hit and big.tier.bytes_held == sum(e.nbytes for e in c.entries.values())
    assert big.tier.stats().bytes_held == big.tier.bytes_held


def test_a_ram_hit_as_deep_is_served_without_waiting(pair):
    """The cluster tier is slow: when RAM holds the same depth, RAM answers at once."""
    _c, a, _b = pair
    res = a.cache.lookup(a.cache.keys(PROMPT), DOM, len(PROMPT) - 1)
    assert res.hit and res.tier == "ram" and not res.pending


def test_mtp_route_and_published_links_once(pair, layout):
    _c, a, b = pair
    res = b.cache.tier("cluster", "tree").lookup(PROMPT, DOM, None, fits=lambda p, t: True)
    assert not res.hit
    rec = a.tree.link_record(a.tree.lookup(a.tree.keys(PROMPT), DOM).plan.deepest)
    assert a.tier.publish_job(rec) is None  # published already
    a.tier.unpublished([rec.link_id])  # dropped here: published again if captured again
    assert a.tier.publish_job(rec) is not None


def test_a_link_published_at_its_capture_is_the_committed_links_publication(tmp_path, layout):
    """The job made when the link is reserved (the worker publishes it right after the
    capture, in the same step) names exactly what the committed link's record names, and the
    commit does not publish it twice; tagged links (MTP route) are not published."""
    c = FakeCluster()
    a = Replica(c, "a", layout, tmp_path)
    keys = a.tree.keys(PROMPT)
    early, ids = [], []
    for cut in cuts_of(keys.tokens):
        r = a.cache.reserve("tree", keys, cut, DOM)
        assert (r.parent_id is not None) == (r.start > 0)
        early.append(a.tier.capture_job(r.link_id, keys, DOM, r.start, r.end))
        assert a.tier.capture_job(r.link_id, keys, DOM, r.start, r.end) is None  # once
        ids.append(r.link_id)
        bufs = a.store.allocate(r.link_id, layout.view_rows(r.start, r.end))
        a.store.seal(r.link_id)
        assert bufs is not None and a.cache.commit(r.addr)
    for job, lid in zip(early, ids, strict=True):
        rec = a.tree.link_record(lid)
        assert a.tier.publish_job(rec) is None  # the commit: published at the capture
        a.tier.unpublished([lid])
        assert a.tier.publish_job(rec) == job
    assert early[0].parent_digest == b"" and early[1].parent_digest == early[0].digest
    r = a.cache.reserve("tree", a.tree.keys(PROMPT[:300]), 300, DOM)
    assert a.tier.capture_job(r.link_id, keys, DOM, r.start, r.end, tag=("draft", 1)) is None


def test_own_entries_and_chains_no_deeper_than_ram_are_never_fetched(pair):
    """Routing sends a turn to the replica that holds its links: the lookup must not move its
    own published bytes back to itself, nor another replica's copy of what RAM serves here
    already (the slow tier would not be served, its bytes would move for nothing)."""
    c, a, b = pair
    keys = a.cache.keys(PROMPT)
    a.tier.lookup(keys, DOM, len(PROMPT) - 1)  # A's own links: located, not fetched
    res = a.tier.lookup(keys, DOM, len(PROMPT) - 1)
    assert not res.hit and not res.pending and a.tier.stats().fetches == 0
    _, res = b.lookup(PROMPT)  # B fetches A's chain once and keeps it (promotion)
    assert res.hit and res.tier == "cluster" and b.tier.stats().fetches == 1
    b.serve(res)
    c.entries = {k: e._replace(owner="other") for k, e in c.entries.items()}  # not B's own
    b.clock.t += 2  # past the "nothing found" belief
    _, again = b.lookup(PROMPT)
    assert again.hit and again.tier == "ram" and b.tier.stats().fetches == 1
    unaware = ClusterTier(b.layout, FP, b.transport, cuts_of, b.tmp / "stage2", 1 << 30,
                          timeout_s=10.0, clock=b.clock,
                          key=b.key)  # negative control: no baseline
    unaware.lookup(keys, DOM, len(PROMPT) - 1)
    for _ in range(5):
        unaware.lookup(keys, DOM, len(PROMPT) - 1)
    assert unaware.stats().fetches == 1
    unaware.close()
