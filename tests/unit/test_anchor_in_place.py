"""End-anchor hits share attention K/V in place (issue 33, item 2), on the real scheduler side.

An end anchor records its cold rows: how many of its first rows a cold prefill writes bit for
bit (the capturing request's rows before it left the segmentation, never its decoded rows).
A hit on it lets vLLM's prefix cache serve the whole attention blocks below both the anchor's
end and its cold rows, and the load copies the rest; the resumed request then writes off the
segmentation from that point on (not from 0, which would re-key the blocks it shares).
No model: vLLM's `Request` objects, a KV-cache config with a 16-token attention block.
"""

from __future__ import annotations

from tests.adapter.test_unkeyed_inputs import TOKENS, _commit_cuts, _request
from tests.unit.test_tiered_cache_adapter import BLOCKS, _finish, _no_steps, _side

B = 16  # the attention block in place (what the segmentation scheduler installs)


def _anchored(in_place: bool = True, off_from: int | None = None, anchor_in_place: bool = True):
    """A side holding only the end anchor of a 200-token prompt prefilled on its cut (the tree
    link it left is cleared), optionally with the request's rows off the segmentation from
    `off_from`; `anchor_in_place` is the setting (off by default, on for these tests)."""
    side = _side(anchor_in_place=anchor_in_place)
    side.in_place_block = B if in_place else 0
    assert _commit_cuts(side, _request("a", TOKENS), TOKENS) == 1
    if off_from is not None:
        side._off_segmentation("a", side._live["a"], off_from)
    addr = _finish(side, "a", TOKENS)
    side.cache.clear("ram", "tree")
    return side, addr


def test_an_anchor_hit_is_served_in_place_below_its_cold_rows():
    side, addr = _anchored()
    prompt = [*TOKENS, 1, 2, 3]
    req = _request("b", prompt)
    assert side.in_place_cap(req) == (len(TOKENS) - 1) // B * B == 192
    res = side._live["b"].answer
    assert res == (len(TOKENS), True)
    assert side._live["b"].lookup.kind == "anchor"
    assert side._live["b"].lookup.cold_rows == len(TOKENS)
    # vLLM took the capped local hit: the connector answers the rest
    assert side.get_num_new_matched_tokens(req, 192) == (len(TOKENS) - 192, True)
    side.update_state_after_alloc(req, BLOCKS, len(TOKENS) - 192)
    (load,) = side.build_plan(_no_steps()).loads
    assert (load.kind, load.in_place) == ("anchor", 192)
    assert load.chain[0].link_id == addr.link_id
    entry = side._live["b"]
    assert entry.canonical is False and entry.off_from == 192  # not 0: its shared blocks stay
    counts = side.in_place_stats("ram", "anchor")
    assert (counts["tokens_in_place"], counts["tokens_copied"]) == (192, len(TOKENS) - 192)
    assert counts["bytes_saved"] > 0
    # its own end anchor: cold below what it shared, never its session's rows
    side.apply_report(_finish_report())
    b_anchor = _finish(side, "b", prompt)
    hit = side.cache.lookup(side.cache.keys([*prompt, 7]), entry.domain, len(prompt))
    assert hit.plan.deepest == b_anchor.link_id and hit.cold_rows == 192
    side.cache.sanity_check()


def test_rows_off_the_segmentation_bound_the_rows_in_place():
    """A capturing request whose steps left the cuts at 70: its anchor's cold rows stop there,
    so vLLM serves only the blocks below 64 and the anchor's own rows above."""
    side, _ = _anchored(off_from=70)
    req = _request("b", [*TOKENS, 1, 2, 3])
    assert side.in_place_cap(req) == 64
    assert side._live["b"].lookup.cold_rows == 70


def test_without_in_place_an_anchor_hit_copies_every_row():
    """Negative control: the same session with in place off records no cold rows and lets
    vLLM's prefix cache serve nothing beside the anchor."""
    side, _ = _anchored(in_place=False)
    req = _request("b", [*TOKENS, 1, 2, 3])
    assert side.get_num_new_matched_tokens(req, 0) == (len(TOKENS), True)
    assert side._live["b"].lookup.cold_rows == 0
    side.in_place_block = B  # even if in place came on later: no provenance, no sharing
    assert side.in_place_cap(_request("c", [*TOKENS, 1, 2, 4])) == 0


def test_by_default_an_anchor_hit_copies_every_row():
    """`anchor_in_place` is off by default (docs/reliability.md, the soak finding): with
    attention in place on, an anchor records no cold rows and vLLM's prefix cache serves
    nothing beside it; the same session with the setting on shares 192 rows (the control)."""
    from vllm_hybridcache.config import CacheSettings

    assert CacheSettings().anchor_in_place is False
    side, _ = _anchored(anchor_in_place=False)
    req = _request("b", [*TOKENS, 1, 2, 3])
    assert side.in_place_cap(req) == 0
    assert side._live["b"].lookup.kind == "anchor" and side._live["b"].lookup.cold_rows == 0
    assert side.get_num_new_matched_tokens(req, 0) == (len(TOKENS), True)
    on, _ = _anchored()
    assert on.in_place_cap(_request("b", [*TOKENS, 1, 2, 3])) == 192


def test_an_anchor_of_a_request_never_tracked_has_no_cold_rows():
    side = _side(anchor_in_place=True)
    side.in_place_block = B
    _finish(side, "a", TOKENS)  # finished without a lookup or a planned step
    req = _request("b", [*TOKENS, 1, 2, 3])
    assert side.in_place_cap(req) == 0
    assert side._live["b"].lookup.kind == "anchor" and side._live["b"].lookup.cold_rows == 0


def _finish_report():
    from vllm_hybridcache.adapter.plans import StepReport

    return StepReport(loaded={"b": 0.01})
