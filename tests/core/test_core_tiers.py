"""The tier interface and the SnapshotCache facade (issue 12): routing by (tier, kind), the
MTP `fits` predicate inside the tree's walk, and the end anchors' pin rules."""

from __future__ import annotations

import pytest

from vllm_hybridcache.core import (
    CacheTier,
    EndAnchors,
    IdSource,
    LinkAddr,
    LinkKind,
    SnapshotCache,
    SnapshotTree,
    Tier,
    TreeConfig,
    make_domain,
)

D = make_domain(model="m")
PROMPT = list(range(500, 900))


@pytest.fixture
def cache(layout, clock, host) -> SnapshotCache:
    ids = IdSource()
    tree = SnapshotTree(layout, TreeConfig(budget_bytes=1 << 20, memory_floor_bytes=0),
                        available_memory=host, clock=clock, next_id=ids)
    anchors = EndAnchors(layout, max_count=4, budget_bytes=1 << 20, next_id=ids)
    return SnapshotCache([tree, anchors])


def tree_of(cache: SnapshotCache) -> SnapshotTree:
    t = cache.tier(Tier.RAM, LinkKind.TREE)
    assert isinstance(t, SnapshotTree)
    return t


def anchors_of(cache: SnapshotCache) -> EndAnchors:
    t = cache.tier(Tier.RAM, LinkKind.ANCHOR)
    assert isinstance(t, EndAnchors)
    return t


def publish(cache: SnapshotCache, kind: LinkKind, tokens, p: int, tag=None) -> LinkAddr:
    r = cache.reserve(kind, tokens, p, D, tag)
    assert r.addr is not None, r
    assert cache.commit(r.addr)
    return r.addr


def test_both_tiers_implement_the_interface(cache):
    for route in cache.routes():
        assert isinstance(cache.tier(*route), CacheTier)
    assert cache.routes() == [("ram", "tree"), ("ram", "anchor")]
    assert cache.tier_names() == ["ram"]


def test_lookup_takes_the_deepest_hit_and_names_its_tier_and_kind(cache):
    publish(cache, LinkKind.TREE, PROMPT, 128)
    res = cache.lookup(PROMPT, D, len(PROMPT) - 1)
    assert (res.hit, res.tokens, res.tier, res.kind) == (True, 128, "ram", "tree")
    publish(cache, LinkKind.ANCHOR, PROMPT, 300)
    res = cache.lookup(PROMPT, D, len(PROMPT) - 1)
    assert (res.tokens, res.kind) == (300, "anchor")
    assert res.plan.chain[0].start == 0 and res.plan.chain[-1].end == 300
    assert res.plan.total_bytes == cache.tier("ram", "anchor").nbytes(300)
    assert cache.cold_exact(res) is False
    # a miss is the primary tier's (the tree names the reason)
    miss = cache.lookup([1, 2, 3, 4], D, 3)
    assert (miss.hit, miss.kind, miss.miss_reason) == (False, "tree", "no_prefix")


def test_an_anchor_as_deep_as_a_tree_link_wins_the_tie(cache):
    publish(cache, LinkKind.TREE, PROMPT, 200)
    publish(cache, LinkKind.ANCHOR, PROMPT, 200)
    assert cache.lookup(PROMPT, D, 399).kind == "anchor"


def test_pending_anchor_asks_again_only_when_deepest(cache):
    r = cache.reserve(LinkKind.ANCHOR, PROMPT, 300, D)
    res = cache.lookup(PROMPT, D, 399)
    assert res.pending and res.tokens == 300
    publish(cache, LinkKind.TREE, PROMPT, 384)
    res = cache.lookup(PROMPT, D, 399)
    assert not res.pending and (res.tokens, res.kind) == (384, "tree")
    assert cache.commit(r.addr)


def test_commit_abort_and_drops_route_by_address_not_by_id_value(cache):
    t = cache.reserve(LinkKind.TREE, PROMPT, 64, D)
    a = cache.reserve(LinkKind.ANCHOR, PROMPT, 100, D)
    assert t.addr == LinkAddr("ram", "tree", t.link_id)
    assert a.addr == LinkAddr("ram", "anchor", a.link_id)
    assert a.link_id == t.link_id + 1  # one id source: unique across tiers, no ranges
    # an address with the right id but the wrong kind commits nothing
    assert not cache.commit(LinkAddr("ram", "anchor", t.link_id))
    assert tree_of(cache).is_committed(t.link_id) is False
    assert cache.commit(t.addr) and cache.abort(a.addr) == 1
    assert cache.drain_dropped() == [a.addr]
    with pytest.raises(KeyError):
        cache.commit(LinkAddr("disk", "tree", t.link_id))
    cache.sanity_check()


def test_clear_by_tier_and_kind(cache):
    publish(cache, LinkKind.TREE, PROMPT, 64)
    a = publish(cache, LinkKind.ANCHOR, PROMPT, 100)
    assert cache.clear(kind="anchor") == 1
    assert cache.drain_dropped() == [a]
    assert len(tree_of(cache)) == 1
    with pytest.raises(ValueError, match="unknown tier 'disk'"):
        cache.clear(tier="disk")
    with pytest.raises(ValueError, match="unknown kind"):
        cache.clear(kind="session")
    assert len(tree_of(cache)) == 1  # a refused clear drops nothing
    assert cache.clear(tier="ram") == 1 and len(cache) == 0


def test_stats_are_per_tier_and_kind(cache):
    publish(cache, LinkKind.TREE, PROMPT, 64)
    publish(cache, LinkKind.ANCHOR, PROMPT, 100)
    stats = cache.stats()
    assert set(stats) == {("ram", "tree"), ("ram", "anchor")}
    assert stats[("ram", "tree")].captures == 1 and stats[("ram", "anchor")].captures == 1


def test_sanity_check_catches_two_tiers_handing_out_one_id(layout, host, clock):
    tree = SnapshotTree(layout, TreeConfig(budget_bytes=1 << 20, memory_floor_bytes=0),
                        available_memory=host, clock=clock)
    anchors = EndAnchors(layout, 4, 1 << 20)  # its own id source: ids collide with the tree's
    cache = SnapshotCache([tree, anchors])
    cache.reserve(LinkKind.TREE, PROMPT, 64, D)
    cache.reserve(LinkKind.ANCHOR, PROMPT, 100, D)
    with pytest.raises(AssertionError, match="held twice"):
        cache.sanity_check()


def test_an_anchor_counts_every_shard_against_its_budget(layout):
    """As in the tree (TreeConfig.shards): at TP = N each rank holds its own shard of an
    anchor, so the anchor budget bounds N times the layout's bytes."""
    one = layout.link_bytes(layout.view_rows(0, 100))
    sharded = EndAnchors(layout, 4, 2 * one, shards=2)
    r = sharded.reserve(PROMPT, 100, D)
    assert r.nbytes == 2 * one and sharded.bytes_held == 2 * one
    assert sharded.reserve([9] * 120, 100, D).link_id is not None   # the first one goes
    assert sharded.bytes_held == 2 * one
    flat = EndAnchors(layout, 4, 2 * one)          # negative control: both fit unsharded
    flat.reserve(PROMPT, 100, D)
    flat.reserve([9] * 120, 100, D)
    assert flat.bytes_held == 2 * one and len(flat) == 2
    with pytest.raises(ValueError, match="shards"):
        EndAnchors(layout, 4, one, shards=0)


def test_one_tier_per_route(layout):
    with pytest.raises(ValueError):
        SnapshotCache([EndAnchors(layout, 1, 1 << 20), EndAnchors(layout, 1, 1 << 20)])


# ------------------------------------------------------------------ fits (MTP draft tokens)
def draft_tag(tokens, end):
    return (tokens[end] if end < len(tokens) else -1, tokens[-1])


def draft_fits(tokens):
    return lambda p, tag: tag == draft_tag(tokens, p)


def test_fits_ends_the_chain_at_the_first_link_that_does_not_fit(cache):
    a = PROMPT
    for p in (64, 128, 192):
        publish(cache, LinkKind.TREE, a, p, tag=draft_tag(a, p))
    tree = tree_of(cache)
    res = cache.lookup(a, D, len(a) - 1, draft_fits(a))
    assert res.tokens == 192 and not res.shortened
    # b parts from a right after the cut at 128: a's link there read a[128], b gives b[128]
    b = [*a[:128], 7, *a[129:]]
    res = cache.lookup(b, D, len(b) - 1, draft_fits(b))
    assert (res.hit, res.tokens, res.shortened) == (True, 64, True)
    assert len(res.plan.chain) == 1
    # without the predicate the tree serves 128 (the tokens before the cut match)
    assert cache.lookup(b, D, len(b) - 1).tokens == 128
    # another last token: no link fits at all
    c = [*a[:-1], 3]
    res = cache.lookup(c, D, len(c) - 1, draft_fits(c))
    assert (res.hit, res.miss_reason, res.shortened) == (False, "no_prefix", True)
    before = tree.stats().shortened
    cache.record_lookup(res)
    assert tree.stats().shortened == before + 1
    # a pure lookup counts nothing
    cache.lookup(c, D, len(c) - 1, draft_fits(c))
    assert tree.stats().shortened == before + 1


def test_begin_restore_counts_a_shortened_hit(cache):
    a = PROMPT
    for p in (64, 128):
        publish(cache, LinkKind.TREE, a, p, tag=draft_tag(a, p))
    b = [*a[:128], 7, *a[129:]]
    res = cache.lookup(b, D, len(b) - 1, draft_fits(b))
    assert cache.begin_restore(res)
    assert tree_of(cache).stats().shortened == 1
    cache.end_restore(res, ok=True)
    cache.sanity_check()


def test_a_dedup_keeps_the_first_tag(cache):
    a = PROMPT
    publish(cache, LinkKind.TREE, a, 64, tag=draft_tag(a, 64))
    r = cache.reserve(LinkKind.TREE, a, 64, D, tag="other")
    assert r.link_id is None and r.existing_id is not None
    assert cache.lookup(a, D, 399, draft_fits(a)).tokens == 64


# ------------------------------------------------------------------ end anchors' pins (7b)
def test_anchor_double_release_raises_like_the_tree(cache):
    publish(cache, LinkKind.ANCHOR, PROMPT, 100)
    res = cache.lookup(PROMPT, D, 399)
    assert cache.begin_restore(res)
    cache.end_restore(res, ok=True)
    with pytest.raises(KeyError):
        cache.end_restore(res, ok=True)
    with pytest.raises(KeyError):
        cache.end_restore(res, ok=False)
    anchors_of(cache).sanity_check()


def test_failed_anchor_restore_defers_the_drop_while_another_request_holds_it(cache):
    addr = publish(cache, LinkKind.ANCHOR, PROMPT, 100)
    first = cache.lookup(PROMPT, D, 399)
    second = cache.lookup([*PROMPT, 1], D, 400)
    assert cache.begin_restore(first) and cache.begin_restore(second)
    cache.end_restore(first, ok=False)
    # suspect payload: no new lookup finds it, but the second restore still reads it
    assert not cache.lookup(PROMPT, D, 399).hit
    assert cache.drain_dropped() == []
    cache.sanity_check()
    cache.end_restore(second, ok=True)
    assert cache.drain_dropped() == [addr]
    assert anchors_of(cache).stats().restores == 1
    assert anchors_of(cache).stats().restores_failed == 1
    cache.sanity_check()


def test_clear_and_invalidate_defer_pinned_anchors(cache):
    addr = publish(cache, LinkKind.ANCHOR, PROMPT, 100)
    res = cache.lookup(PROMPT, D, 399)
    assert cache.begin_restore(res)
    assert cache.clear() == 1
    assert not cache.lookup(PROMPT, D, 399).hit and cache.drain_dropped() == []
    assert cache.invalidate([addr]) == 0  # already gone from lookups
    cache.end_restore(res, ok=True)
    assert cache.drain_dropped() == [addr]
    cache.sanity_check()


def test_anchor_begin_restore_after_drop_is_an_evicted_miss(cache):
    addr = publish(cache, LinkKind.ANCHOR, PROMPT, 100)
    res = cache.lookup(PROMPT, D, 399)
    assert cache.invalidate([addr]) == 1
    assert not cache.begin_restore(res)
    st = anchors_of(cache).stats()
    assert st.misses == {"evicted": 1} and st.hits == 0
