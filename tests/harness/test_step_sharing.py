"""A prefill step that other requests leave too small for the next segment waits for one with
room, so concurrent prompts are cached as if each ran alone; decodes never make it wait.

A link is captured only where one prefill step covers a whole segment from the cut before it:
a step the token budget cuts short takes the rest of the prompt off the segmentation. Two
prompts prefilling together used to share each step's budget, so the second one's first step
fell short of its first cut and it got no link at all. The scheduler hook now gives such a
request 0 tokens (`SegmentedScheduler._waits`) when a step with only the running decodes beside
it would hold the segment; otherwise it takes the tokens left, as before, so a request never
waits on decodes. On vLLM's real scheduler without a model (tests/harness/engine.py).
"""

from __future__ import annotations

import pytest

from tests.harness.engine import HarnessEngine, cache_stats
from vllm_hybridcache.adapter.scheduler import SegmentedScheduler

GRID = 64
STEP = 100      # max_num_batched_tokens: one 64-token segment, and 36 tokens left beside it
P = [100 + (i * 7) % 3000 for i in range(212)]      # cuts at 64, 128, 192
Q = [50 + (i * 13) % 3000 for i in range(212)]


def _engine(**kw) -> HarnessEngine:
    return HarnessEngine({"grid": GRID}, max_num_batched_tokens=STEP, **kw)


def _together(e: HarnessEngine, *prompts: list[int], max_tokens: int = 3) -> list:
    ids = [e.add(p, max_tokens=max_tokens) for p in prompts]
    e.drain()
    return [e.runs[i] for i in ids]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_two_prompts_prefilling_together_both_get_their_links_and_equal_cold(
        async_scheduling):
    cold = [_engine(async_scheduling=async_scheduling).run(p) for p in (P, Q)]
    e = _engine(async_scheduling=async_scheduling)
    first = _together(e, P, Q)
    assert cache_stats(e)["links"] == 6          # three per prompt
    for run, c in zip(first, cold, strict=True):
        assert run.tokens == c.tokens and run.state == c.state
    for prompt, c in zip((P, Q), cold, strict=True):
        warm = e.run(prompt)
        assert warm.cached == 192
        assert warm.tokens == c.tokens and warm.state is not None and warm.state == c.state


def test_negative_control_taking_the_tokens_left_caches_only_the_first(monkeypatch):
    monkeypatch.setattr(SegmentedScheduler, "_waits", lambda self, request, segment: False)
    e = _engine()
    _together(e, P, Q)
    assert cache_stats(e)["links"] == 3          # the second prompt's first step fell short
    assert e.run(Q).cached == 0


def test_step_wait_off_takes_the_tokens_left_as_before():
    """The setting (`step_wait = false`): the second prompt's short step is taken, so it is
    cached up to nowhere, as before the hook waited; what it computes still equals cold."""
    cold = _engine().run(Q)
    e = HarnessEngine({"grid": GRID, "step_wait": False}, max_num_batched_tokens=STEP)
    _, q = _together(e, P, Q)
    assert cache_stats(e)["links"] == 3
    assert q.tokens == cold.tokens and q.state == cold.state


def _first_step_while_decoding(e: HarnessEngine, long_decode: int = 40) -> tuple[int, int]:
    """A prompt arriving while another request decodes: (the step its prefill starts, the step
    the decoding request finishes)."""
    busy = e.add(P[:70], max_tokens=long_decode)
    e.step_until(lambda: e.runs[busy].tokens)               # decoding now
    late = e.add(Q)
    started = finished = None
    for _ in range(200):
        e.step()
        if started is None and e.runs[late].cached is not None:
            started = e.steps
        if finished is None and e.runs[busy].finished:
            finished = e.steps
        if started is not None and finished is not None:
            break
    e.drain()
    return started, finished


def test_a_segment_that_decodes_leave_no_room_for_does_not_wait():
    """Grid equal to the step: one decode leaves 63 tokens, a 64-token segment never fits
    beside it, so the prompt takes what is left (off the segmentation, as before) instead of
    waiting for every decode to end."""
    e = HarnessEngine({"grid": GRID}, max_num_batched_tokens=GRID)
    started, finished = _first_step_while_decoding(e)
    assert started < finished


def test_negative_control_waiting_on_decodes_starves_the_prompt(monkeypatch):
    monkeypatch.setattr(SegmentedScheduler, "_waits", lambda self, request, segment: True)
    e = HarnessEngine({"grid": GRID}, max_num_batched_tokens=GRID)
    started, finished = _first_step_while_decoding(e)
    assert started > finished


def test_two_hits_resuming_together_wait_the_same_way_and_count_once():
    """Both resume from a link and their next segments do not fit one step: the second waits
    (its lookup is asked again next step, vLLM's way for a request it could not schedule),
    both get their next links, and each request is counted as one lookup and one hit."""
    longer = [p + [7 + (i * 11) % 3000 for i in range(100)] for p in (P, Q)]
    cold = [_engine().run(p) for p in longer]
    e = _engine()
    _together(e, P, Q)
    before = cache_stats(e)
    runs = _together(e, *longer)
    after = cache_stats(e)
    assert [r.cached for r in runs] == [192, 192]
    assert after["lookups"] - before["lookups"] == 2 and after["hits"] - before["hits"] == 2
    assert after["links"] == 6 + 2              # 256 on each (the prompts end at 312)
    for run, c in zip(runs, cold, strict=True):
        assert run.tokens == c.tokens and run.state == c.state


def test_the_room_a_step_leaves_is_read_from_vllms_scheduler():
    """`prefill_step_limit` and `decode_rows` on the real scheduler: the step's budget (within
    a long-prefill threshold when set) and one row per running request past its prompt."""
    from vllm_hybridcache.compat import decode_rows, prefill_step_limit

    e = _engine()
    assert prefill_step_limit(e.scheduler) == STEP
    e.scheduler.scheduler_config.long_prefill_token_threshold = 48
    assert prefill_step_limit(e.scheduler) == 48
    e.scheduler.scheduler_config.long_prefill_token_threshold = 0
    busy = e.add(P[:70], max_tokens=20)
    e.step_until(lambda: e.runs[busy].tokens)
    late = e.add(Q)
    e.step()                                        # `late` prefilling, `busy` decoding
    b, q = e.scheduler.requests[busy], e.scheduler.requests[late]
    assert decode_rows(e.scheduler, q) == 1 and decode_rows(e.scheduler, b) == 0
    b.spec_token_ids = [1, 2]
    assert decode_rows(e.scheduler, q) == 3
    b.spec_token_ids = []
