"""Attention K/V in place on vLLM's real scheduler, without a model (tests/harness/engine.py).

With `attention_in_place` a hit's attention blocks come from vLLM's block pool, shared and
ref-counted, below the tree link whose recurrent state the connector restores; the connector
copies the sections and the rows of the hit's last block. The fake model reads K rows of
earlier blocks at every position, so a shared block holding the wrong rows shows in the state
digests and the sampled tokens, exactly as a wrong copy does. The tests marked with
`async_scheduling` also run in vLLM's async order (tests/harness/test_async_scheduling.py):
blocks registered on output there must carry their provenance marks too.
"""

from __future__ import annotations

import pytest

from tests.harness.engine import (
    BLOCK,
    HarnessEngine,
    cache_stats,
    in_place_stats,
    load_jobs,
)

GRID = 64
ON = {"attention_in_place": True}
ANCHORS_ON = {**ON, "anchor_in_place": True}  # off by default (config.anchor_in_place)
A = [100 + (i * 7) % 3000 for i in range(3 * GRID + 20)]          # cuts at 64, 128, 192
B = A[: 2 * GRID] + [50 + (i * 13) % 3000 for i in range(70)]     # shares A's first 2 cuts
ATTN = 1  # the harness's attention group


def cold(prompt):
    return HarnessEngine().run(prompt)


def same(warm, ref) -> None:
    assert warm.finished and ref.finished
    assert warm.tokens == ref.tokens
    assert warm.state is not None and warm.state == ref.state


ASYNC = pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])


def _attn_blocks(e: HarnessEngine, req_id: str) -> list[int]:
    return list(e.scheduler.kv_cache_manager.get_block_ids(req_id)[ATTN])


@ASYNC
def test_a_hit_shares_the_blocks_below_the_link_and_equals_cold(async_scheduling):
    a_cold, b_cold = cold(A), cold(B)
    e = HarnessEngine(ON, async_scheduling=async_scheduling)
    assert e.scheduler.block_size == BLOCK     # hits align to the attention block
    a = e.run(A)
    same(a, a_cold)
    b1, b2 = e.add(B), e.add(B, req_id="b2")
    e.step()                                    # both admitted: loads planned, blocks held
    # vLLM's local hit stops strictly below the link at 128 (112), so that the connector
    # loads the state; the block [112, 128) it then allocates is replaced by A's cached one
    shared = 2 * GRID
    for r in (b1, b2):
        (job,) = load_jobs(e, r)
        assert job.in_place == shared
    blocks1, blocks2 = _attn_blocks(e, b1), _attn_blocks(e, b2)
    n = shared // BLOCK
    assert blocks1[:n] == blocks2[:n]           # one set of blocks for both requests
    assert set(blocks1[n:]).isdisjoint(blocks2[n:])
    pool = e.scheduler.kv_cache_manager.block_pool.blocks
    assert all(pool[i].ref_cnt == 2 for i in blocks1[:n])
    e.drain()
    for r in (b1, b2):
        assert e.runs[r].cached == 2 * GRID
        same(e.runs[r], b_cold)
    st = in_place_stats(e)
    assert st["tokens_in_place"] == 2 * shared and st["tokens_copied"] == 0
    assert st["bytes_saved"] > 0
    assert cache_stats(e)["tokens_served"] == 2 * 2 * GRID


def test_the_link_block_taken_from_the_cache_is_read():
    """Negative control for the block taken after allocation: vLLM's lookup made to return
    the wrong block for the link's last position (the one before it) puts other rows under
    the restored state, and the run is no longer a cold one's."""
    ref = cold(B)
    e = HarnessEngine(ON)
    e.run(A)
    coordinator = e.scheduler.kv_cache_manager.coordinator
    lookup = coordinator.find_longest_cache_hit

    def shifted(block_hashes, max_cache_hit_length):
        found = lookup(block_hashes, max_cache_hit_length)
        if coordinator.hc_limit is None:        # the lookup after allocation, not vLLM's own
            for blocks in found[0]:
                if len(blocks) > 1:
                    blocks[-1] = blocks[-2]
        return found

    coordinator.find_longest_cache_hit = shifted
    warm = e.run(B)
    (job,) = load_jobs(e, warm.req_id)
    assert job.in_place == 2 * GRID and warm.cached == 2 * GRID
    assert warm.state != ref.state


def test_without_the_blocks_the_link_serves_every_row_by_copy():
    """vLLM dropped its cached blocks (eviction; here a reset of its prefix cache): the local
    hit is 0 and the link's host rows serve the whole hit, as without the setting."""
    ref = cold(A)
    e = HarnessEngine(ON)
    e.run(A)
    assert e.scheduler.reset_prefix_cache()
    warm = e.run(A)
    (job,) = load_jobs(e, warm.req_id)
    assert job.in_place == 0 and warm.cached == 3 * GRID
    same(warm, ref)
    st = in_place_stats(e)
    assert st["tokens_in_place"] == 0 and st["tokens_copied"] == 3 * GRID


def test_a_corrupted_restore_beside_shared_blocks_is_caught():
    """Negative control: the in-place path still depends on the copied part (the state)."""
    ref = cold(A)
    e = HarnessEngine(ON)
    e.run(A)
    e.corrupt_restores()
    warm = e.run(A)
    (job,) = load_jobs(e, warm.req_id)
    assert job.in_place > 0
    assert warm.state != ref.state


def test_no_link_no_local_hit():
    """vLLM's pool holds A's blocks but the cache holds no link (cleared): the cap is 0, the
    request runs cold, and nothing is counted in place."""
    ref = cold(A)
    e = HarnessEngine(ON)
    e.run(A)
    e.clear()
    warm = e.run(A)
    assert warm.cached == 0 and not load_jobs(e, warm.req_id)
    same(warm, ref)


@ASYNC
@pytest.mark.parametrize("marks", [True, False])
def test_blocks_written_off_the_segmentation_are_never_taken_with_a_link(marks,
                                                                         async_scheduling):
    """Request `off` is cut short by the token budget (it shares a step with another
    request): from its first step on it is off the segmentation and its blocks are hashed
    apart. A cold run of the same prompt then captures links; a third run takes its in-place
    blocks from the cold run, never from `off`, though `off` registered its blocks first. The
    negative control (`marks=False`: the scheduler never marks) takes `off`'s blocks."""
    e = HarnessEngine(ON, max_num_batched_tokens=100, async_scheduling=async_scheduling)
    # the step cut short is taken, as where decodes leave too little room for the segment
    # (a request that could wait for a step with room waits: tests/harness/test_step_sharing)
    e.scheduler._waits = lambda request, segment: False
    if not marks:
        e.scheduler._side.take_off_segmentation = list
    other = [9 + (i * 11) % 3000 for i in range(150)]
    e.add(other, req_id="other")
    off = e.add(A, req_id="off")
    off_blocks: set[int] = set()
    while e.scheduler.has_requests() or e.in_flight():  # step 1: other 64 to its cut, off 36
        e.step()
        if off in e.scheduler.requests:
            off_blocks |= set(_attn_blocks(e, off))
        if marks:  # marked as schedule() returns: before a step's output can register blocks
            assert all(r.off_taken == r.off_from for r in e.scheduler._side._live.values())
    e.drain()
    assert e.runs[off].finished and cache_stats(e)["links"] == 2   # other's cuts only
    # off's blocks are registered under provenance hashes only (or, unmarked, under A's)
    assert len(_registered(e, A)) == (0 if marks else len(A) // BLOCK)
    first = e.run(A)                            # cold: no link for A yet; captures 3
    assert first.cached == 0
    cold_blocks = set(_registered(e, A))
    third = e.add(A, req_id="third")
    e.step()
    shared = set(_attn_blocks(e, third)[: (3 * GRID - BLOCK) // BLOCK])
    e.drain()
    assert e.runs[third].cached == 3 * GRID
    if marks:
        assert shared <= cold_blocks and not shared & off_blocks
    else:
        assert shared & off_blocks


def _registered(e: HarnessEngine, prompt: list[int]) -> list[int]:
    """Attention block ids vLLM's pool holds under `prompt`'s cold block hashes, in order."""
    from vllm import SamplingParams
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id
    from vllm.v1.request import Request

    from vllm_hybridcache.compat import rehash_request

    probe = Request("probe", list(prompt), SamplingParams(max_tokens=1), None)
    rehash_request(probe, e.scheduler._hasher)
    pool = e.scheduler.kv_cache_manager.block_pool
    out = []
    for h in probe.block_hashes:
        blk = pool.cached_block_hash_to_block.get_one_block(
            make_block_hash_with_group_id(h, ATTN))
        if blk is None:
            break
        out.append(blk.block_id)
    return out


@ASYNC
def test_an_end_anchor_hit_shares_the_blocks_below_its_cold_rows_and_equals_cold(
        async_scheduling):
    """An end anchor is session-exact, but the rows its first turn prefilled on the
    segmentation are a cold prefill's (issue 33, item 2): the next turn takes the whole blocks
    below them from vLLM's pool, copies the anchor's rows above (the decoded ones), and equals
    a cold run of its prompt. The turn after that resumes from the second turn's anchor, whose
    cold rows are only what the second turn shared (its own rows descend from the session):
    again in place below them, never above."""
    e = HarnessEngine(ANCHORS_ON, async_scheduling=async_scheduling)
    first = e.run(A[:100], max_tokens=4)
    turn = A[:100] + first.tokens + [7, 8, 9, 10, 11]
    ref = cold(turn)
    warm = e.run(turn)
    (job,) = load_jobs(e, warm.req_id)
    assert warm.cached == 100 + len(first.tokens) - 1
    shared = min((warm.cached - 1) // BLOCK, 100 // BLOCK) * BLOCK
    assert job.kind == "anchor" and job.in_place == shared > 0
    same(warm, ref)
    assert cache_stats(e, "anchor")["hits"] == 1
    third = turn + warm.tokens + [12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24]
    ref3 = cold(third)
    again = e.run(third)
    (job3,) = load_jobs(e, again.req_id)
    assert again.cached == len(turn) + len(warm.tokens) - 1
    assert job3.kind == "anchor" and job3.in_place == shared   # not the second prompt's
    same(again, ref3)


def _forks(head: list[int], first: int, n: int) -> list[list[int]]:
    """`n` extensions of a finished head, each its first token and a suffix of its own."""
    return [head + [first] + [50 + (i * 13 + 101 * k) % 3000 for i in range(40)]
            for k in range(n)]


@pytest.mark.parametrize("margin,settings", [(None, ANCHORS_ON), (0.0, ANCHORS_ON), (None, ON)])
def test_forks_of_a_head_share_its_blocks(margin, settings):
    """Issue 33: a head that ends at a cut (a tree link there) and its end anchor one token
    deeper, then 4 concurrent forks. By expected time to first token the anchor is ahead by
    one token of prefill and behind by a copy of every row, within the cold-exact margin:
    each fork resumes from the tree link, shares the head's blocks below it, equals a cold
    run, and the choice is counted. Rates are pinned (the priors), so timing cannot move the
    choice. Every block of the head's prompt is shared, the link's last one included: vLLM's
    local hit stops a block below the link (the connector loads at least one token), and the
    block it allocates there is replaced by the head's cached one, so N forks hold one set of
    the head's blocks, as with vLLM's own prefix caching. With `margin=0` the anchor, cheaper
    by the estimate, serves every fork, and shares the head's blocks too (its cold rows are
    the head's prompt); still exact. With the defaults (`anchor_in_place` off: the anchor
    would copy every row) the tree link serves the forks the same way."""
    from vllm_hybridcache.core import CostModel

    e = HarnessEngine(settings)
    cache = e.connector._sched.cache
    cache.cost = CostModel(pinned=True)
    if margin is not None:
        cache.margin = margin
    head = A[: 3 * GRID]                         # ends at the cut 192: a link there
    first = e.run(head, max_tokens=2)
    forks = _forks(head, first.tokens[0], 4)
    refs = [cold(f) for f in forks]
    ids = [e.add(f, req_id=f"fork{k}") for k, f in enumerate(forks)]
    e.step()                                      # all four admitted: loads planned
    n = 3 * GRID // BLOCK                         # every block of the head's prompt
    jobs = [load_jobs(e, r) for r in ids]
    blocks = [_attn_blocks(e, r) for r in ids]
    e.drain()
    for r, ref in zip(ids, refs, strict=True):
        same(e.runs[r], ref)
    pool = e.scheduler.kv_cache_manager.block_pool.blocks
    if margin is None:
        assert all([(j.kind, j.in_place) for j in js] == [("tree", n * BLOCK)] for js in jobs)
        assert all(b[:n] == blocks[0][:n] for b in blocks)   # one set of head blocks
        tails = [set(b[n:]) for b in blocks]                   # the rest their own
        assert sum(map(len, tails)) == len(set().union(*tails))
        assert in_place_stats(e)["tokens_copied"] == 0
        assert all(pool[i].ref_cnt == 0 for i in blocks[0][:n])  # all forks finished
        assert all(e.runs[r].cached == 3 * GRID for r in ids)
        assert cache_stats(e)["choices"] == {"cold_exact": 4}
        assert cache_stats(e, "anchor")["hits"] == 0
    else:
        assert all([(j.kind, j.in_place) for j in js] == [("anchor", n * BLOCK)] for js in jobs)
        assert all(b[:n] == blocks[0][:n] for b in blocks)   # one set of head blocks
        assert all(e.runs[r].cached == 3 * GRID + 1 for r in ids)
        assert cache_stats(e, "anchor")["choices"] == {"deepest": 4}


def test_share_cached_blocks_changes_nothing_it_cannot_share():
    """All or nothing (compat.share_cached_blocks): a range off the attention block, or one
    vLLM's cache does not hold (B parts from A at 128), changes no block of the request, and
    the request still equals a cold run."""
    from vllm_hybridcache.compat import share_cached_blocks

    ref = cold(B)
    e = HarnessEngine(ON)
    e.run(A)
    r = e.add(B)
    e.step()                                    # admitted: [0, 128) shared, the load planned
    request = e.scheduler.requests[r]
    manager = e.scheduler.kv_cache_manager
    before = _attn_blocks(e, r)
    assert share_cached_blocks(manager, request, 1, 2 * GRID) == 1
    assert share_cached_blocks(manager, request, 2 * GRID, 3 * GRID) == 2 * GRID
    assert _attn_blocks(e, r) == before
    e.drain()
    same(e.runs[r], ref)
