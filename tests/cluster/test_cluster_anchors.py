"""End anchors moving between replicas (ClusterAnchors), without Ray or vLLM: replicas share the
in-process fake directory (tests/cluster/fakes.py). An anchor committed and published on A is
found by B for a prompt extending its tokens, verified and restored byte for byte, and never
promoted into B's shared tree; anything in doubt is a counted miss that serves nothing."""

from __future__ import annotations

import numpy as np
import pytest

from tests.cluster.fakes import DOM, FP, PROMPT, FakeCluster, Replica
from tests.keys import CLUSTER_KEY
from vllm_hybridcache.cluster.directory import ClusterDirectory
from vllm_hybridcache.core.keys import PromptKeys, make_domain
from vllm_hybridcache.core.tiers.cluster import (
    ClusterMiss,
    anchor_block,
    block_locator,
    locator,
)

ANCHOR = PROMPT[:300]          # turn k's prompt + its answer (all but the last token)
NEXT = PROMPT                  # turn k + 1: extends the anchor's tokens


@pytest.fixture
def pair(tmp_path, layout):
    c = FakeCluster()
    a = Replica(c, "a", layout, tmp_path, anchors=True)
    b = Replica(c, "b", layout, tmp_path, anchors=True)
    a.capture_anchor(ANCHOR)
    return c, a, b


def test_a_remote_anchor_restores_byte_for_byte_and_is_not_shared(pair):
    _c, a, b = pair
    local = a.cache.lookup(a.cache.keys(NEXT), DOM, len(NEXT) - 1)
    assert local.hit and (local.tier, local.kind) == ("ram", "anchor") and local.tokens == 300
    expected = a.restore_bytes(local.plan.chain)
    keys = b.cache.keys(NEXT)
    first = b.cache.lookup(keys, DOM, len(NEXT) - 1)
    assert first.pending  # never blocks: the directory is asked, the scheduler asks again
    _, res = b.lookup(NEXT)
    assert res.hit and (res.tier, res.kind) == ("cluster", "anchor") and res.tokens == 300
    assert not b.cache.cold_exact(res)  # session-exact: the resumed request shares nothing
    assert [(r.start, r.end) for r in res.plan.chain] == [(0, 300)]
    assert b.serve(res) == expected
    b.cache.sanity_check()
    st = b.remote_anchors.stats()
    assert st.restores == 1 and st.tokens_served == 300 and st.fetches == 1
    assert b.remote_anchors.bytes_held == 0 and not list((b.tmp / "stage").iterdir())
    # not promoted: the staged id goes to the worker's drops, the tree holds nothing new
    assert [x.link_id for x in b.cache.drain_dropped()] == [res.plan.deepest]
    assert not b.tree.lookup(keys, DOM, len(NEXT) - 1).hit


def test_a_prompt_that_does_not_extend_the_anchor_or_another_domain_misses(pair):
    c, _a, b = pair
    other = NEXT.copy()
    other[299] += 1  # parts from the anchor at its last token
    _, res = b.lookup(other)
    assert not (res.hit and res.kind == "anchor")
    _, res = b.lookup(ANCHOR[:250])  # shorter than the anchor: nothing to extend
    assert not (res.hit and res.kind == "anchor")
    salted = make_domain(model="m", cache_salt="tenant-2")
    keys = b.cache.keys(NEXT)
    for _ in range(5):
        res = b.cache.lookup(keys, salted, len(NEXT) - 1)
    assert not res.hit and not res.pending
    assert b.remote_anchors.stats().fetches == 0 and c.anchors  # located nothing, fetched none


def test_a_payload_with_other_tokens_or_of_another_kind_is_refused(pair, tmp_path, layout):
    """A directory entry whose digest names this prompt but whose payload holds other tokens,
    or a tree link's payload listed as an anchor, is a verify_failed miss and is forgotten."""
    c, a, b = pair
    (_loc, (_block, e)), = c.anchors.items()
    c.anchors.clear()
    wrong = NEXT.copy()
    wrong[5] += 1
    kw = PromptKeys(wrong)
    loc = locator(CLUSTER_KEY, FP, DOM, kw.digest(300))
    c.anchors[loc] = (block_locator(CLUSTER_KEY, FP, DOM, kw.digest(anchor_block(300))),
                      e._replace(locator=loc))
    _, res = b.lookup(wrong)
    assert not (res.hit and res.kind == "anchor")
    assert b.remote_anchors.stats().misses[ClusterMiss.VERIFY_FAILED] == 1 and not c.anchors
    a.capture(PROMPT)  # tree links [0, 64), ...: list the one at 256 as an anchor of 256
    tree_entry = next(x for x in c.entries.values() if x.end == 256)
    k = PromptKeys(PROMPT)
    assert tree_entry.locator == locator(CLUSTER_KEY, FP, DOM, k.digest(256))
    c.anchors[tree_entry.locator] = (block_locator(CLUSTER_KEY, FP, DOM, k.digest(256)),
                                     tree_entry._replace(start=0, parent_locator=b""))
    b.clock.t += 100
    res = b.remote_anchors.lookup(k, DOM, 299)
    for _ in range(5):
        res = b.remote_anchors.lookup(k, DOM, 299)
    assert not res.hit
    assert b.remote_anchors.stats().misses[ClusterMiss.VERIFY_FAILED] == 2


def test_own_anchors_and_prompts_with_a_local_anchor_never_ask_or_fetch(pair):
    _c, a, _b = pair
    calls = []
    real = a.transport.locate_anchors
    a.transport.locate_anchors = lambda *args: calls.append(args) or real(*args)
    for _ in range(3):  # A holds the anchor in RAM: served at once, the directory not asked
        res = a.cache.lookup(a.cache.keys(NEXT), DOM, len(NEXT) - 1)
        assert res.hit and res.tier == "ram" and not res.pending
    assert calls == []
    a.cache.clear("ram", "anchor")  # its own published entry is still listed (not withdrawn)
    for _ in range(5):
        res = a.remote_anchors.lookup(a.cache.keys(NEXT), DOM, len(NEXT) - 1)
    assert calls and not res.hit and a.remote_anchors.stats().fetches == 0


def test_a_clear_withdraws_only_this_replicas_anchors_before_it_returns(pair, tmp_path, layout):
    c, a, b = pair
    b.capture_anchor(PROMPT[:320], seed=3)
    assert len(c.anchors) == 2
    assert a.remote_anchors.withdraw_all() == 1
    assert [e.owner for _, e in c.anchors.values()] == ["b"]
    _, res = Replica(c, "z", layout, tmp_path, anchors=True).lookup(NEXT)
    assert res.hit and res.kind == "anchor" and res.tokens == 320  # B's, never A's cleared one
    # a dropped anchor is published again when captured again
    a.remote_anchors.unpublished([1, 2, 3])
    assert a.remote_anchors.withdraw_all() == 0


def test_anchors_and_tree_links_share_one_staging_budget(tmp_path, layout):
    c = FakeCluster()
    a = Replica(c, "a", layout, tmp_path, anchors=True)
    a.capture(PROMPT)
    a.capture_anchor(ANCHOR)
    (_, (_, anchor)), = c.anchors.items()
    tree_bytes = sum(e.nbytes for e in c.entries.values())
    b = Replica(c, "b", layout, tmp_path, anchors=True, budget=tree_bytes + anchor.nbytes - 1)
    keys = b.cache.keys(PROMPT[:280])  # the tree chain (256) is staged and held
    for _ in range(5):
        b.tier.lookup(keys, DOM, 279)
    assert b.tier.bytes_held == tree_bytes
    _, res = b.lookup(NEXT)  # the anchor no longer fits beside it
    assert not (res.hit and res.kind == "anchor")
    assert b.remote_anchors.stats().misses[ClusterMiss.BUDGET] == 1


def test_no_anchor_moves_on_a_speculative_route_or_below_one_key_block(pair):
    _c, a, b = pair
    assert b.remote_anchors.lookup(NEXT, DOM, None, fits=lambda p, t: True).hit is False
    keys = a.cache.keys(NEXT)
    assert a.remote_anchors.anchor_job(99, keys, DOM, 350, tag=("next", 1)) is None
    assert a.remote_anchors.anchor_job(98, keys, DOM, 63) is None
    job = a.remote_anchors.anchor_job(97, keys, DOM, 350)
    assert job is not None and (job.start, job.end, job.kind) == (0, 350, "anchor")
    assert a.remote_anchors.anchor_job(97, keys, DOM, 350) is None  # once


def test_the_directory_keeps_anchors_apart_and_locates_them_by_block_and_limit():
    d = ClusterDirectory()
    k = PromptKeys(np.arange(1000, 1400, dtype=np.int64))

    def loc(digest: bytes, fp: bytes = FP, dom: bytes = DOM) -> bytes:
        return locator(CLUSTER_KEY, fp, dom, digest)

    def blocks_of(fp: bytes = FP, dom: bytes = DOM) -> list[bytes]:
        return [block_locator(CLUSTER_KEY, fp, dom, k.digest(p)) for p in range(64, 400, 64)]

    blocks = blocks_of()
    d.publish_anchor(loc(k.digest(300)), blocks[3], 300, 10, "a", ["ref"])  # block at 256
    d.publish_anchor(loc(k.digest(390)), blocks[5], 390, 10, "b", ["ref2"])  # block at 384
    assert d.locate([loc(k.digest(300))]) == []  # never answers a tree lookup
    found = d.locate_anchors(blocks, 399)
    assert sorted(x[3] for x in found) == [300, 390]
    assert [x[3] for x in d.locate_anchors(blocks, 350)] == [300]
    assert d.locate_anchors(blocks_of(dom=make_domain(model="x")), 399) == []
    assert d.locate_anchors(blocks_of(fp=b"G" * 32), 399) == []
    assert d.forget_anchors([loc(k.digest(390))], owner="a") == 0  # not a's
    assert d.stats() == {"a": {"links": 0, "anchors": 1, "bytes": 10},
                         "b": {"links": 0, "anchors": 1, "bytes": 10}}
    assert d.forget_owner("b") == 1 and d.anchors_of("b") == []
    assert d.forget_anchors([loc(k.digest(300))]) == 1
    assert d.locate_anchors(blocks, 399) == [] and not d._blocks
