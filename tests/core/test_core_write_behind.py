"""The facade's write-behind (core/cache.py + core/tiers/lower.py): what a lower tier hears.

A recording LowerTier stands in for disk and cluster: every RAM event the facade forwards is
checked (a committed tree link comes with its record, an anchor with none; a failed capture,
a failed restore and a lost link are `failed`; drops reach it before the workers free them;
clears fan out with their scope), `observe` may ask for a link again, and operations and
reports are routed by the tier's name only.
"""

from __future__ import annotations

import pytest

from vllm_hybridcache.core import (
    EndAnchors,
    IdSource,
    LinkKind,
    SnapshotCache,
    SnapshotTree,
    TreeConfig,
    make_domain,
)
from vllm_hybridcache.core.keys import tenant_tag
from vllm_hybridcache.core.tiers.lower import LowerTier

D = make_domain(model="m")
PROMPT = list(range(500, 900))


class Recorder(LowerTier):
    def __init__(self, name: str, ops=None, again=()) -> None:
        self.name = name
        self.events: list[tuple] = []
        self.ops = ops
        self.again = list(again)

    def observe(self, keys, domain, res):
        self.events.append(("observe", res.tokens))
        return self.again

    def committed(self, addr, record):
        self.events.append(("committed", addr, record))

    def failed(self, addrs):
        self.events.append(("failed", list(addrs)))

    def dropped(self, addrs):
        self.events.append(("dropped", list(addrs)))

    def cleared(self, tier, kind):
        self.events.append(("cleared", tier, kind))

    def cleared_tenant(self, tag, tier, kind):
        self.events.append(("cleared_tenant", tag, tier, kind))

    def observe_prefill(self, tokens, seconds):
        self.events.append(("prefill", tokens, seconds))

    def take_ops(self):
        return self.ops

    def absorb(self, report):
        self.events.append(("absorb", report))

    def of(self, event: str) -> list[tuple]:
        return [e for e in self.events if e[0] == event]


def _cache(layout, clock, host, *lower) -> SnapshotCache:
    ids = IdSource()
    tree = SnapshotTree(layout, TreeConfig(budget_bytes=1 << 20, memory_floor_bytes=0),
                        available_memory=host, clock=clock, next_id=ids)
    anchors = EndAnchors(layout, max_count=4, budget_bytes=1 << 20, next_id=ids)
    return SnapshotCache([tree, anchors], lower=lower)


@pytest.fixture
def rec() -> Recorder:
    return Recorder("disk", ops={"write": [1]})


@pytest.fixture
def cache(layout, clock, host, rec) -> SnapshotCache:
    return _cache(layout, clock, host, rec)


def _publish(cache, kind, p):
    r = cache.reserve(kind, PROMPT, p, D)
    assert cache.commit(r.addr)
    return r.addr


def test_a_committed_tree_link_is_offered_with_its_record_an_anchor_without(cache, rec):
    tree_addr = _publish(cache, LinkKind.TREE, 128)
    anchor_addr = _publish(cache, LinkKind.ANCHOR, 300)
    (c1, c2) = rec.of("committed")
    assert c1[1] == tree_addr and c1[2] is not None
    assert c1[2] == cache.tier("ram", "tree").link_record(tree_addr.link_id)
    assert c2[1:] == (anchor_addr, None)
    # a reservation never committed is never offered
    cache.reserve(LinkKind.TREE, PROMPT, 256, D)
    assert len(rec.of("committed")) == 2


def test_aborted_and_lost_links_and_a_failed_restore_are_failed(cache, rec):
    r = cache.reserve(LinkKind.TREE, PROMPT, 128, D)
    cache.abort(r.addr)
    assert rec.of("failed") == [("failed", [r.addr])]
    assert not rec.of("committed")
    a = _publish(cache, LinkKind.TREE, 128)
    cache.invalidate([a])
    assert rec.of("failed")[-1] == ("failed", [a])
    b = _publish(cache, LinkKind.TREE, 192)
    res = cache.lookup(PROMPT, D, 399)
    assert res.hit and res.tokens == 192
    cache.begin_restore(res)
    cache.end_restore(res, ok=False)
    failed = rec.of("failed")[-1][1]
    assert b in failed and all(f.tier == "ram" for f in failed)
    # a good restore is not a failure
    res = cache.lookup(PROMPT, D, 399)
    cache.begin_restore(res)
    n = len(rec.of("failed"))
    cache.end_restore(res, ok=True)
    assert len(rec.of("failed")) == n


def test_drops_reach_the_lower_tier_before_the_workers_free_them(layout, clock, host):
    rec = Recorder("disk")
    cache = _cache(layout, clock, host, rec)
    addrs = [_publish(cache, LinkKind.TREE, p) for p in (64, 128)]
    cache.clear("ram", "tree")
    out = cache.drain_dropped()
    assert {a.link_id for a in out} >= {a.link_id for a in addrs}
    assert rec.of("dropped")[-1] == ("dropped", out)
    assert rec.of("cleared") == [("cleared", "ram", "tree")]


def test_clears_fan_out_with_their_scope(cache, rec):
    _publish(cache, LinkKind.TREE, 128)
    cache.clear()
    tag = tenant_tag("alice")
    cache.clear_tenant(tag, kind="anchor")
    assert rec.of("cleared") == [("cleared", None, None)]
    assert rec.of("cleared_tenant") == [("cleared_tenant", tag, None, "anchor")]
    with pytest.raises(ValueError):  # an unknown scope clears nothing and tells no one
        cache.clear("nowhere")
    assert len(rec.of("cleared")) == 1


def test_observe_offers_again_the_links_a_tier_asks_for_still_in_ram(layout, clock, host):
    rec = Recorder("disk")
    cache = _cache(layout, clock, host, rec)
    a = _publish(cache, LinkKind.TREE, 128)
    rec.again = [a.link_id, 10_000]  # one RAM still holds, one it never had
    keys = cache.keys(PROMPT)
    res = cache.lookup(keys, D, 399)
    cache.observe(keys, D, res)
    assert rec.of("observe") == [("observe", 128)]
    offered = rec.of("committed")
    assert len(offered) == 2 and offered[1][1] == a and offered[1][2] is not None


def test_ops_and_reports_are_routed_by_name_only(layout, clock, host):
    disk, cluster, idle = Recorder("disk", ops=[1]), Recorder("cluster", ops={"p": 2}), \
        Recorder("other")
    cache = _cache(layout, clock, host, disk, cluster, idle)
    assert cache.take_ops() == {"disk": [1], "cluster": {"p": 2}}  # None: no entry
    cache.absorb({"cluster": "rep", "gone": "ignored"})
    assert cluster.of("absorb") == [("absorb", "rep")]
    assert not disk.of("absorb") and not idle.of("absorb")
    cache.observe_prefill(256, 0.5)
    assert all(t.of("prefill") == [("prefill", 256, 0.5)] for t in (disk, cluster, idle))
    assert cache.lower("cluster") is cluster and cache.lower("nowhere") is None
    assert cache.origin("disk") is None


def test_two_lower_tiers_of_one_name_are_refused(layout, clock, host):
    with pytest.raises(ValueError, match="two lower tiers named 'disk'"):
        _cache(layout, clock, host, Recorder("disk"), Recorder("disk"))


def test_without_lower_tiers_nothing_is_forwarded(layout, clock, host):
    """Negative control: the same events on a cache with no lower tier change no recorder."""
    rec = Recorder("disk")
    cache = _cache(layout, clock, host)
    _publish(cache, LinkKind.TREE, 128)
    cache.clear()
    assert cache.take_ops() == {} and rec.events == []
