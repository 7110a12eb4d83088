"""The hit choice (issue 33, item 1): among every tier's verified hit the facade serves the one
with the least expected seconds to first token, a cold-exact hit preferred within a margin, and
counts why. Rates are pinned here (CostModel(pinned=True)), so no choice depends on timing."""

from __future__ import annotations

import pytest

from vllm_hybridcache.core import (
    COLD_EXACT_MARGIN,
    ChoiceReason,
    CostModel,
    EndAnchors,
    IdSource,
    LinkKind,
    LookupResult,
    RestorePlan,
    SnapshotCache,
    SnapshotTree,
    TreeConfig,
    make_domain,
)
from vllm_hybridcache.core.choice import Candidate, choose
from vllm_hybridcache.core.tiers.base import LinkRef

D = make_domain(model="m")
PROMPT = list(range(500, 900))  # 400 tokens
SECTIONS = 38  # SMALL_LAYOUT: section bytes; 12 bytes per view row


def make_cache(layout, clock, host, cost: CostModel | None, margin: float = COLD_EXACT_MARGIN):
    ids = IdSource()
    tree = SnapshotTree(layout, TreeConfig(budget_bytes=1 << 20, memory_floor_bytes=0),
                        available_memory=host, clock=clock, next_id=ids)
    anchors = EndAnchors(layout, max_count=4, budget_bytes=1 << 20, next_id=ids)
    if cost is None:
        return SnapshotCache([tree, anchors])
    return SnapshotCache([tree, anchors], cost=cost, margin=margin)


def publish(cache: SnapshotCache, kind: LinkKind, p: int) -> None:
    r = cache.reserve(kind, PROMPT, p, D)
    assert r.addr is not None, r
    assert cache.commit(r.addr)


def in_place(res: LookupResult) -> int:
    """What the adapter reports for a tree link whose attention rows vLLM's blocks serve in
    place: the recurrent sections only (the anchor copies every row)."""
    assert res.plan is not None
    return SECTIONS if res.kind == LinkKind.TREE else res.plan.total_bytes


def pinned(ram: float, prefill: float, disk: float = 1e9) -> CostModel:
    return CostModel({"ram": ram, "disk": disk}, prefill_tokens_per_s=prefill, pinned=True)


@pytest.fixture
def fork(layout, clock, host):
    """The fork probe in small: a tree link at the head's last cut (256) and the head's end
    anchor one token deeper (257)."""

    def make(cost, margin=COLD_EXACT_MARGIN):
        cache = make_cache(layout, clock, host, cost, margin)
        publish(cache, LinkKind.TREE, 256)
        publish(cache, LinkKind.ANCHOR, 257)
        return cache

    return make


def test_fork_anchor_one_token_deeper_than_an_in_place_tree_link_serves_the_tree(fork):
    # a slow copy: the anchor's 257 rows cost more than the one token it saves
    cache = fork(pinned(ram=1e6, prefill=1000.0))
    res = cache.lookup(PROMPT, D, 399, moved=in_place)
    assert (res.tokens, res.kind, res.choice) == (256, "tree", ChoiceReason.CHEAPER.value)
    assert cache.begin_restore(res)
    cache.end_restore(res, True)
    st = cache.stats()
    assert st[("ram", "tree")].choices == {"cheaper": 1}
    assert st[("ram", "anchor")].choices == {}


def test_fork_within_the_margin_serves_the_cold_exact_link(fork):
    # a fast copy: the anchor is cheaper by about one token of prefill out of 143, well inside
    # the margin, so the cold-exact link is served
    cache = fork(pinned(ram=1e9, prefill=1000.0))
    res = cache.lookup(PROMPT, D, 399, moved=in_place)
    assert (res.tokens, res.kind, res.choice) == (256, "tree", "cold_exact")
    assert cache.begin_restore(res)
    cache.end_restore(res, True)
    assert cache.stats()[("ram", "tree")].choices == {"cold_exact": 1}


def test_negative_control_no_margin_serves_the_cheaper_anchor(fork):
    cache = fork(pinned(ram=1e9, prefill=1000.0), margin=0.0)
    res = cache.lookup(PROMPT, D, 399, moved=in_place)
    assert (res.tokens, res.kind, res.choice) == (257, "anchor", "deepest")


def test_negative_control_without_a_cost_model_depth_alone_decides(fork):
    cache = fork(None)
    res = cache.lookup(PROMPT, D, 399, moved=in_place)
    assert (res.tokens, res.kind, res.choice) == (257, "anchor", None)
    assert cache.begin_restore(res)
    cache.end_restore(res, True)
    assert all(not st.choices for st in cache.stats().values())


def test_an_anchor_much_deeper_is_served(layout, clock, host):
    cache = make_cache(layout, clock, host, pinned(ram=1e6, prefill=1000.0))
    publish(cache, LinkKind.TREE, 256)
    publish(cache, LinkKind.ANCHOR, 390)
    res = cache.lookup(PROMPT, D, 399, moved=in_place)
    # anchor: 4718 bytes at 1 MB/s (4.7 ms) + 10 tokens; tree: 144 tokens (144 ms)
    assert (res.tokens, res.kind, res.choice) == (390, "anchor", "deepest")
    assert cache.begin_restore(res)
    cache.end_restore(res, True)
    assert cache.stats()[("ram", "anchor")].choices == {"deepest": 1}


def test_one_hit_is_counted_as_the_only_one(layout, clock, host):
    cache = make_cache(layout, clock, host, pinned(ram=1e6, prefill=1000.0))
    publish(cache, LinkKind.TREE, 128)
    res = cache.lookup(PROMPT, D, 399)
    assert (res.tokens, res.choice) == (128, "only")
    cache.record_lookup(res)
    assert cache.stats()[("ram", "tree")].choices == {"only": 1}
    miss = cache.lookup([1, 2, 3, 4], D, 3)
    assert (miss.hit, miss.choice) == (False, None)
    cache.record_lookup(miss)
    assert cache.stats()[("ram", "tree")].choices == {"only": 1}


def _hit(tier: str, kind: str, tokens: int, row_bytes: int = 12) -> LookupResult:
    total = SECTIONS + tokens * row_bytes
    plan = RestorePlan((LinkRef(1, 0, tokens),), tokens, {"all": total}, total)
    return LookupResult(True, tokens, plan, None, 400, 399, tier=tier, kind=kind)


def _price(cost: CostModel):
    return lambda r: cost.seconds(r.tier, r.plan.total_bytes, r.prompt_tokens - r.tokens)


def test_a_slightly_deeper_but_slower_disk_hit_loses_to_ram():
    ram, disk = _hit("ram", "tree", 256), _hit("disk", "tree", 320)
    cands = [Candidate(ram, True, False), Candidate(disk, True, True)]
    # disk at 1 kB/s: 3,878 bytes take 3.9 s; the 64 tokens it saves take 64 ms
    got = choose(cands, _price(pinned(ram=1e9, prefill=1000.0, disk=1e3)))
    assert (got.res.tier, got.reason) == ("ram", ChoiceReason.CHEAPER)
    # negative control: a fast disk serves the deeper hit, as depth alone would
    got = choose(cands, _price(pinned(ram=1e9, prefill=1000.0, disk=1e9)))
    assert (got.res.tier, got.reason) == ("disk", ChoiceReason.DEEPEST)


def test_ties_go_to_cold_exact_then_deeper_then_the_faster_tier():
    free = pinned(ram=1e30, prefill=1e30, disk=1e30)  # every cost ~0: only the tie rules
    tree, anchor = _hit("ram", "tree", 200), _hit("ram", "anchor", 200)
    got = choose([Candidate(tree, True, False), Candidate(anchor, False, False)], _price(free))
    assert got.res.kind == "tree"
    ram, disk = _hit("ram", "tree", 200), _hit("disk", "tree", 200)
    got = choose([Candidate(ram, True, False), Candidate(disk, True, True)], _price(free))
    assert got.res.tier == "ram"
    with pytest.raises(ValueError):
        choose([], _price(free))


def test_cost_model_measures_over_its_priors():
    cm = CostModel(alpha=0.5)
    prior = cm.rates["ram"]
    cm.observe_restore("ram", 1000, 1.0)         # the first sample replaces the prior
    assert cm.rates["ram"] == 1000.0 != prior
    cm.observe_restore("ram", 3000, 1.0)
    assert cm.rates["ram"] == 2000.0
    cm.observe_restore("ram", 0, 1.0)            # empty: ignored
    cm.observe_prefill(500, 0.25)
    assert cm.prefill_tokens_per_s == 2000.0
    assert cm.seconds("ram", 2000, 100) == pytest.approx(1.0 + 0.05)
    frozen = pinned(ram=5.0, prefill=7.0)
    frozen.observe_restore("ram", 1000, 1.0)
    frozen.observe_prefill(1000, 1.0)
    assert (frozen.rates["ram"], frozen.prefill_tokens_per_s) == (5.0, 7.0)
    with pytest.raises(ValueError):
        CostModel({"ram": 0.0})
