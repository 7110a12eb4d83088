"""InPlaceCounts (adapter/in_place_counts.py): where restored hits' rows came from, by route."""

from __future__ import annotations

from vllm_hybridcache.adapter.in_place_counts import InPlaceCounts


def test_counts_add_up_by_route_and_filter_by_tier_and_kind():
    c = InPlaceCounts()
    assert c.totals() == {"tokens_in_place": 0, "tokens_copied": 0, "bytes_saved": 0}
    c.count("ram", "tree", tokens=256, in_place=128, block_tokens=64, block_bytes=10)
    c.count("disk", "tree", tokens=300, in_place=100, block_tokens=64, block_bytes=10)
    c.count("ram", "anchor", tokens=50, in_place=0, block_tokens=64, block_bytes=10)
    assert c.totals("ram", "tree") == {"tokens_in_place": 128, "tokens_copied": 128,
                                       "bytes_saved": 20}
    # a partial block served in place is not a block the copy skipped
    assert c.totals("disk")["bytes_saved"] == 10
    assert c.totals(kind="tree")["tokens_copied"] == 128 + 200
    assert c.totals() == {"tokens_in_place": 228, "tokens_copied": 378, "bytes_saved": 30}
    assert c.payload() == {
        "ram": {"tree": {"tokens_in_place": 128, "tokens_copied": 128, "bytes_saved": 20},
                "anchor": {"tokens_in_place": 0, "tokens_copied": 50, "bytes_saved": 0}},
        "disk": {"tree": {"tokens_in_place": 100, "tokens_copied": 200, "bytes_saved": 10}}}
    c.payload()["ram"]["tree"]["tokens_copied"] = -1  # a copy: the counts stay
    assert c.totals("ram", "tree")["tokens_copied"] == 128
