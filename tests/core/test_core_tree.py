"""Snapshot tree: one test per rule of issue 3 (reqs. 2-7)."""

from __future__ import annotations

import pickle

import msgspec
import pytest

from vllm_hybridcache.core import (
    CacheStats,
    LookupResult,
    MissReason,
    Reservation,
    SkipReason,
    make_domain,
)

D = make_domain(model="m", tp_rank=0)
E = make_domain(model="m", tp_rank=1)
PROMPT = list(range(1000, 1400))


def chain(tree, tokens, cuts, domain=D, commit=True):
    """Reserve (and commit) links at `cuts`, in order; returns their reservations."""
    out = []
    for p in cuts:
        r = tree.reserve(tokens, p, domain)
        assert r.link_id is not None, r
        if commit:
            assert tree.commit(r.link_id)
        out.append(r)
    return out


# ---------------------------------------------------------------- req. 3: tree and lookup
def test_link_holds_rows_from_parent_and_lookup_returns_deepest_chain(make_tree, layout):
    tree = make_tree()
    r = chain(tree, PROMPT, [64, 128, 200])
    assert [(x.start, x.end) for x in r] == [(0, 64), (64, 128), (128, 200)]
    assert r[1].parent_id == r[0].link_id and r[2].parent_id == r[1].link_id
    res = tree.lookup(PROMPT, D, len(PROMPT) - 1)
    assert res.hit and res.tokens == 200
    assert [(c.link_id, c.start, c.end) for c in res.plan.chain] == [
        (r[0].link_id, 0, 64), (r[1].link_id, 64, 128), (r[2].link_id, 128, 200)
    ]
    assert res.plan.part_bytes == {"gdn": 32, "conv": 6, "kv": 8 * 200, "idx": 4 * 200}
    assert res.plan.total_bytes == layout.link_bytes(200)


def test_lookup_respects_limit_so_a_token_is_left_to_prefill(make_tree):
    tree = make_tree()
    chain(tree, PROMPT, [64, 128])
    assert tree.lookup(PROMPT[:128], D, 127).tokens == 64
    assert tree.lookup(PROMPT[:128], D, 128).tokens == 128
    assert tree.lookup(PROMPT, D, 63).miss_reason == MissReason.NO_PREFIX


def test_lookup_finds_shorter_link_inserted_after_a_deeper_one(make_tree):
    tree = make_tree()
    (deep,) = chain(tree, PROMPT, [256])
    (mid,) = chain(tree, PROMPT, [128])
    assert mid.parent_id is None and tree.parent_of(deep.link_id) is None
    other = PROMPT[:128] + [7] * 200
    res = tree.lookup(other, D)
    assert res.hit and res.tokens == 128 and res.plan.link_ids == (mid.link_id,)
    assert tree.lookup(PROMPT, D).tokens == 256


def test_branches_share_their_common_parent(make_tree):
    tree = make_tree()
    a = PROMPT
    b = PROMPT[:100] + [5] * 300
    (ra,) = chain(tree, a, [64])
    rb = chain(tree, b, [128])[0]
    assert rb.parent_id == ra.link_id and (rb.start, rb.end) == (64, 128)
    assert tree.lookup(b, D).plan.link_ids == (ra.link_id, rb.link_id)
    assert tree.lookup(a, D).plan.link_ids == (ra.link_id,)


def test_results_are_plain_picklable_data(make_tree):
    tree = make_tree()
    chain(tree, PROMPT, [64, 128])
    res = tree.lookup(PROMPT, D)
    assert pickle.loads(pickle.dumps(res)) == res
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(res), type=LookupResult) == res
    r = tree.reserve(PROMPT, 192, D)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(r), type=Reservation) == r


def test_lookup_is_pure(make_tree, clock):
    tree = make_tree(budget_bytes=10_000, policy="lru")
    a = chain(tree, PROMPT, [64])[0]
    b = chain(tree, [9] * 300, [64])[0]
    before = msgspec.json.encode(tree.stats())
    for _ in range(3):
        clock.tick()
        tree.lookup(PROMPT, D)
        tree.lookup([3] * 100, D)
    assert msgspec.json.encode(tree.stats()) == before
    # LRU untouched by lookups: the older link `a` is still the first victim
    tree.evict(1)
    assert not tree.has(a.link_id) and tree.has(b.link_id)


# ---------------------------------------------------------------- req. 2: verification
def test_colliding_digest_is_verify_failed_never_a_restore(make_tree):
    tree = make_tree(hasher=lambda data: b"\x00")  # every key collides
    chain(tree, PROMPT, [64, 128])
    other = [7] * 400
    res = tree.lookup(other, D)
    assert not res.hit and res.plan is None
    assert res.miss_reason == MissReason.VERIFY_FAILED and res.verify_collisions >= 1
    tree.record_lookup(res)
    assert tree.stats().misses == {"verify_failed": 1}
    # a prompt differing in the last token of the deepest link gets the shallower link
    near = [*PROMPT[:127], 0, *PROMPT[128:]]
    res = tree.lookup(near, D)
    assert res.hit and res.tokens == 64 and res.verify_collisions >= 1


def test_colliding_keys_are_stored_side_by_side(make_tree):
    tree = make_tree(hasher=lambda data: b"\x00")
    x, y = [1] * 200, [2] * 200
    (rx,) = chain(tree, x, [64])
    (ry,) = chain(tree, y, [64])
    assert ry.existing_id is None and rx.link_id != ry.link_id
    assert tree.lookup(x, D).plan.link_ids == (rx.link_id,)
    assert tree.lookup(y, D).plan.link_ids == (ry.link_id,)


# ---------------------------------------------------------------- miss reasons and domains
def test_domains_never_mix(make_tree):
    """Another domain of the same tenant (here another rank; a route, an adapter) holding the
    prefix is a `domain_mismatch`; another tenant's (another cache_salt) is a plain
    `no_prefix`: a miss never tells a tenant what another one holds (issue 29)."""
    tree = make_tree()
    chain(tree, PROMPT, [64, 128], domain=D)
    res = tree.lookup(PROMPT, E)
    assert not res.hit and res.miss_reason == MissReason.DOMAIN_MISMATCH
    salted = make_domain(model="m", tp_rank=0, cache_salt="tenant-2")
    res = tree.lookup(PROMPT, salted)
    assert not res.hit and res.miss_reason == MissReason.NO_PREFIX
    chain(tree, [9] * 200, [64], domain=salted)
    assert tree.lookup([9] * 200, D).miss_reason == MissReason.NO_PREFIX  # and the other way
    (re,) = chain(tree, PROMPT, [64], domain=E)
    assert re.parent_id is None and re.existing_id is None
    assert tree.lookup(PROMPT, E).plan.link_ids == (re.link_id,)


def test_miss_reasons(make_tree):
    tree = make_tree()
    assert tree.lookup(PROMPT, D).miss_reason == MissReason.NO_PREFIX
    (r,) = chain(tree, PROMPT, [64])
    tree.evict(1)
    assert not tree.has(r.link_id)
    assert tree.lookup(PROMPT, D).miss_reason == MissReason.EVICTED
    assert tree.lookup([1, 2, 3] * 50, D).miss_reason == MissReason.NO_PREFIX
    off = make_tree(budget_bytes=0)
    assert off.lookup(PROMPT, D).miss_reason == MissReason.DISABLED
    assert off.reserve(PROMPT, 64, D).skip_reason == SkipReason.DISABLED
    assert len(off) == 0


def test_ghost_set_is_bounded(make_tree):
    tree = make_tree(ghost_capacity=2)
    prompts = [[i] * 100 for i in range(3)]
    for pr in prompts:
        chain(tree, pr, [64])
    tree.evict(10**9)
    assert tree.lookup(prompts[0], D).miss_reason == MissReason.NO_PREFIX  # forgotten
    assert tree.lookup(prompts[2], D).miss_reason == MissReason.EVICTED


# ---------------------------------------------------------------- req. 4: two-phase publication
def test_pending_link_is_invisible_until_commit(make_tree):
    tree = make_tree()
    r = tree.reserve(PROMPT, 64, D)
    assert not tree.lookup(PROMPT, D).hit
    # a second reservation on the same prefix sees the pending parent
    r2 = tree.reserve(PROMPT, 128, D)
    assert r2.parent_id == r.link_id and r2.start == 64
    assert tree.commit(r2.link_id)  # child first: still invisible, parent pending
    assert not tree.lookup(PROMPT, D).hit
    assert tree.commit(r.link_id)
    assert tree.lookup(PROMPT, D).tokens == 128
    assert not tree.commit(r.link_id)  # double commit is a no-op


def test_abort_cascades_and_refuses_later_children(make_tree):
    tree = make_tree()
    r1 = tree.reserve(PROMPT, 64, D)
    r2 = tree.reserve(PROMPT, 128, D)
    assert tree.abort(r1.link_id) == 2
    assert not tree.has(r2.link_id) and len(tree) == 0
    assert sorted(tree.drain_dropped()) == sorted([r1.link_id, r2.link_id])
    assert not tree.commit(r2.link_id)
    r3 = tree.reserve(PROMPT, 192, D)
    assert r3.link_id is None and r3.skip_reason == SkipReason.PARENT_REFUSED
    assert tree.stats().skips == {"parent_refused": 1} and tree.stats().aborts == 2
    # a retry of the aborted cut itself is allowed and clears the refusal
    r4 = tree.reserve(PROMPT, 64, D)
    assert r4.link_id is not None
    assert tree.reserve(PROMPT, 128, D).link_id is not None


def test_child_of_refused_parent_is_refused(make_tree, layout):
    tree = make_tree(max_link_bytes=layout.link_bytes(64))
    assert tree.reserve(PROMPT, 100, D).skip_reason == SkipReason.TOO_LARGE
    r = tree.reserve(PROMPT, 150, D)
    assert r.skip_reason == SkipReason.PARENT_REFUSED
    # another prompt that does not share the refused cut is unaffected
    assert tree.reserve([4] * 200, 64, D).link_id is not None
    assert tree.stats().skips == {"too_large": 1, "parent_refused": 1}


def test_reserving_a_present_key_is_a_dedup(make_tree):
    tree = make_tree()
    (r,) = chain(tree, PROMPT, [64])
    d = tree.reserve([*PROMPT, 1, 2], 64, D)
    assert d.link_id is None and d.skip_reason is None and d.existing_id == r.link_id
    pend = tree.reserve(PROMPT, 128, D)
    assert tree.reserve(PROMPT, 128, D).existing_id == pend.link_id
    s = tree.stats()
    assert s.dedups == 2 and s.skips == {} and len(tree) == 2


# ---------------------------------------------------------------- req. 5: memory
def test_budget_evicts_lru_leaves_only(make_tree, layout, clock):
    size64 = layout.link_bytes(64)
    tree = make_tree(budget_bytes=3 * size64, policy="lru")
    a = chain(tree, PROMPT, [64, 128])  # a0 is an inner node, a1 a leaf
    clock.tick()
    (b,) = chain(tree, [5] * 100, [64])
    clock.tick()
    (c,) = chain(tree, [6] * 100, [64])  # needs room: a1 (oldest leaf) goes, not a0
    assert not tree.has(a[1].link_id) and tree.has(a[0].link_id)
    assert tree.has(b.link_id) and tree.has(c.link_id)
    assert tree.bytes_held <= 3 * size64
    assert tree.drain_dropped() == [a[1].link_id]
    s = tree.stats()
    assert s.evictions == 1 and s.evicted_bytes == size64


def test_restore_pins_its_chain(make_tree, layout, clock):
    size64 = layout.link_bytes(64)
    tree = make_tree(budget_bytes=2 * size64, policy="lru")
    (a,) = chain(tree, PROMPT, [64])
    clock.tick()
    (b,) = chain(tree, [5] * 100, [64])
    clock.tick()
    res = tree.lookup(PROMPT, D)
    assert tree.begin_restore(res)
    assert tree.stats().links_pinned == 1
    clock.tick()
    (c,) = chain(tree, [6] * 100, [64])  # b is the LRU leaf (a was just used)
    assert tree.has(a.link_id) and not tree.has(b.link_id)
    clock.tick()
    r = tree.reserve([7] * 100, 64, D)  # a would be the LRU leaf, but it is pinned
    assert r.link_id is not None and tree.has(a.link_id) and not tree.has(c.link_id)
    tree.end_restore(res.plan, ok=True, seconds=0.002)
    assert tree.stats().links_pinned == 0
    tree.commit(r.link_id)
    clock.tick()
    chain(tree, [8] * 100, [64])  # unpinned again: a (least recent) goes now
    assert not tree.has(a.link_id) and tree.has(r.link_id)
    with pytest.raises(KeyError):
        tree.end_restore(res.plan, ok=True)


def test_budget_skip_when_nothing_can_be_evicted(make_tree, layout):
    tree = make_tree(budget_bytes=layout.link_bytes(64) + 10)
    r1 = tree.reserve(PROMPT, 64, D)  # pending: not evictable
    r2 = tree.reserve([5] * 100, 64, D)
    assert r1.link_id is not None and r2.skip_reason == SkipReason.BUDGET
    assert tree.reserve(PROMPT, 10**3 - 600, D).skip_reason == SkipReason.BUDGET  # > budget
    assert tree.bytes_held <= layout.link_bytes(64) + 10


def test_memory_guard(make_tree, host, layout):
    tree = make_tree(memory_floor_bytes=1000)
    host.available = 1000 + layout.link_bytes(64) - 1
    r = tree.reserve(PROMPT, 64, D)
    assert r.skip_reason == SkipReason.MEMORY_GUARD and len(tree) == 0
    host.available = 1000 + layout.link_bytes(64)
    assert tree.reserve([3] * 64, 64, D).link_id is not None
    assert tree.stats().skips == {"memory_guard": 1}


def test_a_link_counts_every_shard_against_the_budget(make_tree, host, layout):
    """At tensor parallel size N every rank's worker holds its own shard of a link (the
    layout's bytes), so the budget, the cap, the memory guard and the stats count N times
    that: `budget_bytes` bounds the host memory for links whatever N is."""
    one = layout.link_bytes(64)
    tree = make_tree(budget_bytes=2 * one, shards=2)
    (r,) = chain(tree, PROMPT, [64])
    assert r.nbytes == 2 * one and tree.bytes_held == 2 * one
    assert tree.stats().capture_bytes == 2 * one
    res = tree.lookup(tree.keys([*PROMPT, 1]), D, 64)
    assert res.hit and tree.begin_restore(res)
    tree.end_restore(res.plan, ok=True)
    assert tree.stats().restore_bytes == 2 * res.plan.total_bytes   # both ranks' copies
    # a second link does not fit two shards' worth beside the first: the first goes
    chain(tree, [7] * 100, [64])
    assert not tree.has(r.link_id) and tree.bytes_held == 2 * one
    # negative control: one shard a link holds both
    flat = make_tree(budget_bytes=2 * one)
    (a,) = chain(flat, PROMPT, [64])
    (b,) = chain(flat, [7] * 100, [64])
    assert flat.has(a.link_id) and flat.has(b.link_id) and flat.bytes_held == 2 * one
    # the memory guard asks for every shard's bytes
    guarded = make_tree(memory_floor_bytes=1000, shards=2)
    host.available = 1000 + 2 * one - 1
    assert guarded.reserve(PROMPT, 64, D).skip_reason == SkipReason.MEMORY_GUARD
    with pytest.raises(ValueError, match="shards"):
        make_tree(shards=0)


def test_cost_policy_keeps_valuable_links(make_tree, layout, clock):
    # two leaves of equal age: one saves 256 rows, the other 16; the cheap one goes first
    tree = make_tree(policy="cost", budget_bytes=10**6)
    (small,) = chain(tree, [1] * 300, [16])
    (big,) = chain(tree, [2] * 300, [256])
    tree.evict(1)
    assert tree.has(big.link_id) and not tree.has(small.link_id)
    # with the same size, the recently used one stays
    (x,) = chain(tree, [3] * 300, [256])
    clock.tick(3600)
    (y,) = chain(tree, [4] * 300, [256])
    tree.evict(1)
    assert tree.has(y.link_id)
    assert tree.has(big.link_id) != tree.has(x.link_id)  # exactly one of the old ones went


def test_clear_defers_pinned_links(make_tree):
    tree = make_tree()
    rs = chain(tree, PROMPT, [64, 128])
    chain(tree, [5] * 100, [64])
    res = tree.lookup(PROMPT, D)
    assert tree.begin_restore(res)
    tree.drain_dropped()
    assert tree.clear() == 3 and len(tree) == 0 and tree.bytes_held == 0
    dropped = tree.drain_dropped()
    assert rs[0].link_id not in dropped and rs[1].link_id not in dropped and len(dropped) == 1
    assert not tree.lookup(PROMPT, D).hit
    assert not tree.begin_restore(res)  # the chain is gone: an `evicted` miss
    tree.end_restore(res.plan, ok=False)
    assert sorted(tree.drain_dropped()) == sorted(r.link_id for r in rs)
    assert tree.stats().links_pinned == 0


def test_invalidate_drops_subtree(make_tree):
    tree = make_tree()
    rs = chain(tree, PROMPT, [64, 128, 192])
    assert tree.invalidate([rs[1].link_id]) == 2
    assert tree.lookup(PROMPT, D).tokens == 64
    assert tree.stats().invalidated == 2


def test_set_budget_shrinks(make_tree, layout):
    tree = make_tree()
    for i in range(5):
        chain(tree, [i] * 100, [64])
    tree.set_budget(2 * layout.link_bytes(64))
    assert len(tree) == 2 and tree.bytes_held <= 2 * layout.link_bytes(64)


# ---------------------------------------------------------------- req. 6: stats
def test_stats_count_every_event(make_tree, layout):
    tree = make_tree()
    chain(tree, PROMPT, [64, 128])
    hit = tree.lookup(PROMPT, D, 399)
    assert tree.begin_restore(hit)
    tree.end_restore(hit.plan, ok=True, seconds=0.003)
    hit2 = tree.lookup(PROMPT, D, 399)
    assert tree.begin_restore(hit2)
    tree.end_restore(hit2.plan, ok=False, seconds=0.1)  # failed: not served
    tree.record_lookup(tree.lookup([9] * 10, D))
    s = tree.stats()
    assert isinstance(s, CacheStats)
    assert (s.lookups, s.hits, s.misses) == (3, 2, {"no_prefix": 1})
    assert s.hit_tokens == 256 and s.tokens_served == 128
    assert s.restores == 1 and s.restores_failed == 1
    assert s.restore_bytes == layout.link_bytes(128)
    assert s.prompt_tokens == 400 + 400 + 10
    assert s.hit_depth.count == 2 and s.hit_depth.counts[1] == 2  # 64 < 128 <= 128
    assert s.captures == 2 and s.capture_bytes == 2 * layout.link_bytes(64)
    assert s.links == 2 and s.bytes_held == 2 * layout.link_bytes(64) and s.domains == 1
    assert s.restore_seconds.count == 1 and s.restore_seconds.sum == pytest.approx(0.003)
    decoded = msgspec.json.decode(msgspec.json.encode(s), type=CacheStats)
    assert decoded == s
    # snapshots are independent of later events
    tree.record_lookup(tree.lookup([9] * 10, D))
    assert s.misses == {"no_prefix": 1}


def test_cost_policy_frecency_and_heap_order():
    import math

    from vllm_hybridcache.core import CostPolicy, LRUPolicy, make_policy

    class L:
        def __init__(self, i, start, p, nbytes, t):
            self.id, self.start, self.p, self.nbytes = i, start, p, nbytes
            self.hits, self.last_access, self.freq = 0, t, 0.0

    pol = make_policy("cost", half_life_s=10.0)
    assert isinstance(pol, CostPolicy) and isinstance(make_policy("lru"), LRUPolicy)
    a, b = L(1, 0, 100, 1000, 0.0), L(2, 0, 100, 1000, 0.0)
    pol.accessed(a, 0.0)
    pol.accessed(b, 0.0)
    pol.accessed(a, 10.0)  # one half-life later: freq = 1 * 1/2 + 1
    assert a.freq == pytest.approx(1.5) and a.last_access == 10.0
    assert pol.score(a, 10.0) == pytest.approx(0.1 * 1.5)
    assert pol.score(b, 10.0) == pytest.approx(0.1 * 0.5)
    pol.add(a)
    pol.add(b)
    assert pol.victim() is b and pol.victim(exclude=b) is a
    # the heap order equals the score order at any later time
    c = L(3, 0, 400, 1000, 0.0)
    pol.accessed(c, 5.0)
    pol.add(c)
    order = sorted((a, b, c), key=lambda x: pol.score(x, 1000.0))
    got = []
    while (v := pol.victim()) is not None:
        got.append(v)
        pol.discard(v)
    assert got == order
    assert math.isclose(pol.score(c, 15.0), 0.4 * 0.5)
    with pytest.raises(ValueError):
        make_policy("mru")


def test_reserve_rejects_bad_arguments(make_tree):
    tree = make_tree()
    with pytest.raises(ValueError):
        tree.reserve(PROMPT, 0, D)
    with pytest.raises(ValueError):
        tree.reserve(PROMPT, len(PROMPT) + 1, D)
    with pytest.raises(TypeError):
        tree.reserve(PROMPT, 64, "domain")


def test_prompt_keys_are_shared_between_calls(make_tree):
    tree = make_tree()
    keys = tree.keys(PROMPT)
    r = tree.reserve(keys, 64, D)
    tree.commit(r.link_id)
    assert tree.lookup(keys, D).plan.link_ids == (r.link_id,)
    # keys made with another hasher are rehashed, not trusted
    from vllm_hybridcache.core import PromptKeys

    foreign = PromptKeys(PROMPT, hasher=lambda b: b"\x01")
    assert tree.lookup(foreign, D).plan.link_ids == (r.link_id,)


def test_default_memory_guard_reads_the_host(layout):
    from vllm_hybridcache.core import SnapshotTree, TreeConfig

    roomy = SnapshotTree(layout, TreeConfig(budget_bytes=1 << 20, memory_floor_bytes=0))
    assert roomy.reserve(PROMPT, 64, D).link_id is not None
    # a floor above any real host's memory: every capture is skipped
    tight = SnapshotTree(layout, TreeConfig(budget_bytes=1 << 20, memory_floor_bytes=1 << 60))
    assert tight.reserve(PROMPT, 64, D).skip_reason == SkipReason.MEMORY_GUARD
