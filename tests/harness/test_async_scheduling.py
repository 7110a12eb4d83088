"""The cache under vLLM's async scheduler, on vLLM's real scheduler without a model
(tests/harness/engine.py, `async_scheduling=True`).

vLLM turns async scheduling on by default on GPUs: `EngineCore.step_with_batch_queue` schedules
step N + 1 before step N's output is applied (one step in flight), and `AsyncScheduler` keeps
placeholders for the tokens still to come. `--scheduler-cls` names `SegmentedScheduler`, which
becomes `SegmentedAsyncScheduler` (over `AsyncScheduler`) when the engine schedules
asynchronously, so the async overlap is kept. These tests run that class in that order: every
restore (tree links, end anchors) must equal a cold run in state digests and output tokens,
captures must land on the cuts, and a lookup must wait for a link whose report is one step (or,
with a draft model's deferred saves, two steps) behind. vLLM's CPU platform never schedules
asynchronously, so no engine test covers this: the harness is where it is tested.
"""

from __future__ import annotations

import pytest

from tests.harness.engine import HarnessEngine, cache_stats
from tests.harness.test_protocol import GRID, A, B, cold, same
from vllm_hybridcache.adapter import scheduler_side
from vllm_hybridcache.adapter.anchor_end import anchor_end
from vllm_hybridcache.adapter.inflight import MAX_WAITS

PROMPT = A[:100]
STOP_AT = 3  # the stop-token run ends on its 4th sampled token


def async_engine(**kw) -> HarnessEngine:
    return HarnessEngine(async_scheduling=True, **kw)


# --------------------------------------------------------------------- the class vLLM builds
def test_the_scheduler_class_follows_the_engines_async_setting():
    """`SegmentedScheduler(...)`, as EngineCore calls the class `--scheduler-cls` names: an
    `AsyncScheduler` with our cut hook under async scheduling, the synchronous class
    otherwise; both cut A's prefill at its cuts."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    from vllm_hybridcache.adapter.scheduler import SegmentedAsyncScheduler, SegmentedScheduler

    for on in (True, False):
        e = HarnessEngine(async_scheduling=on)
        s = e.scheduler
        assert e.vllm_config.scheduler_config.get_scheduler_cls() is SegmentedScheduler
        assert isinstance(s, SegmentedScheduler)
        assert isinstance(s, AsyncScheduler) is on
        assert type(s) is (SegmentedAsyncScheduler if on else SegmentedScheduler)
        # the config passed positionally (Scheduler.__init__'s first parameter) decides too
        bare = SegmentedScheduler.__new__(SegmentedScheduler, e.vllm_config)
        assert isinstance(bare, AsyncScheduler) is on
        # our hook, not vLLM's own mamba-block clipping
        assert s.need_mamba_block_aligned_split
        assert s._mamba_block_aligned_split.__qualname__.startswith("install_prefill_split")
        e.run(A)
        ends = [c.row_end for p in e.plans for c in p.captures if not c.finishing]
        assert ends == [GRID, 2 * GRID, 3 * GRID]


def test_a_step_is_in_flight_while_the_next_one_is_scheduled():
    """The harness really runs the async order: after A's first step nothing is applied and
    its link is pending; the second step is scheduled (A's next chunk, from 64) before the
    first step's report commits the link at 64."""
    e = async_engine()
    e.add(A)
    e.step()
    assert (e.in_flight(), e.steps) == (1, 0)
    assert e.scheduler.requests["r1"].num_computed_tokens == GRID   # advanced at schedule
    s = cache_stats(e)
    assert (s["links"], s["links_pending"]) == (0, 1)
    e.step()
    assert (e.in_flight(), e.steps) == (1, 1)                        # step 1 applied
    assert [c.row_end for c in e.plans[1].captures] == [2 * GRID]    # planned before that
    s = cache_stats(e)
    assert (s["links"], s["links_pending"]) == (1, 1)


# --------------------------------------------------------------------- tree links
# (a tree hit equal to cold, and its negative control, under async scheduling: the
# `async` cases of test_protocol.py)


@pytest.mark.parametrize("defer_save", [False, True])
def test_a_lookup_waits_for_a_link_in_flight(defer_save, monkeypatch):
    """B shares A's cuts at 64 and 128 and arrives while A's first step is in flight: its
    link at 64 is reported only after the next `schedule()` (two later with a draft model's
    deferred saves, the MTP order), so B's first lookup sees it pending and waits rather than
    start cold. Async alone: one wait, and by then A's 128 landed too. Deferred: B waits
    MAX_WAITS steps and starts from 64, committed by then. Both equal B's cold run. The
    control: without the wait B starts cold (what every such request would lose)."""
    b_ref = cold(B)

    def b_after_a_first_step() -> tuple[HarnessEngine, str]:
        e = async_engine(defer_save=defer_save)
        e.add(A)
        e.step()
        b = e.add(B)
        e.drain()
        return e, b

    e, b = b_after_a_first_step()
    assert MAX_WAITS == 2
    assert e.runs[b].cached == (GRID if defer_save else 2 * GRID)
    same(e.runs[b], b_ref)
    s = cache_stats(e)
    assert s["hits"] == 1 and s["links_pending"] == 0 and s["links"] == 4   # + B's 192
    monkeypatch.setattr(scheduler_side, "MAX_WAITS", 0)
    e, b = b_after_a_first_step()
    assert e.runs[b].cached == 0
    same(e.runs[b], b_ref)


# --------------------------------------------------------------------- end anchors
def _spy(monkeypatch, shift: int = 0) -> list[tuple]:
    """Record every anchor_end call (arguments, answer); `shift` moves the anchor's end by
    that many tokens (the negative controls: an anchor that does not match its state)."""
    calls: list[tuple] = []

    def spy(*args):
        end = anchor_end(*args)
        if end is not None and shift:
            end = (end[0] + shift, end[1])
        calls.append((args, end))
        return end

    monkeypatch.setattr(scheduler_side, "anchor_end", spy)
    return calls


def _stop_token() -> int:
    """The token PROMPT's run samples at STOP_AT, not sampled before it."""
    tokens = HarnessEngine().run(PROMPT, max_tokens=8).tokens
    assert tokens[STOP_AT] not in tokens[:STOP_AT]
    return tokens[STOP_AT]


def _next_turn(e: HarnessEngine, first) -> tuple:
    turn = PROMPT + first.tokens + [7, 8, 9, 10, 11]
    return e.run(turn), HarnessEngine().run(turn)


def test_an_anchor_after_max_tokens_covers_all_but_the_last_token(monkeypatch):
    """At max_tokens vLLM's async scheduler schedules no step past the last one: nothing is in
    flight when the request finishes, its state holds every token but the last sampled one,
    and the anchor ends there (as under synchronous scheduling)."""
    calls = _spy(monkeypatch)
    e = async_engine()
    first = e.run(PROMPT, max_tokens=4)
    (args, end), = calls
    num_computed, num_tokens, in_flight = args[0], args[1], args[6]
    assert (in_flight, num_computed, num_tokens) == (0, 103, 104)
    assert end == (103, 0)
    warm, ref = _next_turn(e, first)
    assert warm.cached == len(PROMPT) + len(first.tokens) - 1
    same(warm, ref)
    assert cache_stats(e, "anchor")["hits"] == 1


def test_an_anchor_after_a_stop_token_covers_the_step_in_flight(monkeypatch):
    """A request that stops on a token had been scheduled once more before its stop was
    known: that step forwarded the stop token, so its state holds every token, and the anchor
    covers all of them (one more than under synchronous scheduling); the next turn resumes
    after the stop token and equals its cold run."""
    stop = _stop_token()
    calls = _spy(monkeypatch)
    e = async_engine()
    first = e.run(PROMPT, max_tokens=8, stop_token_ids=[stop])
    assert len(first.tokens) == STOP_AT + 1 and first.tokens[-1] == stop
    (args, end), = calls
    num_computed, num_tokens, in_flight = args[0], args[1], args[6]
    assert (in_flight, num_computed, num_tokens) == (1, 104, 104)
    assert end == (104, 0)
    warm, ref = _next_turn(e, first)
    assert warm.cached == len(PROMPT) + len(first.tokens)
    same(warm, ref)
    assert cache_stats(e, "anchor")["hits"] == 1
    # the same request under synchronous scheduling: all but the stop token
    s = HarnessEngine()
    s.run(PROMPT, max_tokens=8, stop_token_ids=[stop])
    warm_sync, _ = _next_turn(s, first)
    assert warm_sync.cached == len(PROMPT) + len(first.tokens) - 1
    same(warm_sync, ref)


@pytest.mark.parametrize("stopped, shift", [(True, -1), (False, 1)])
def test_an_anchor_off_by_one_token_is_caught(monkeypatch, stopped, shift):
    """Negative controls: an anchor one token shorter than its state (the synchronous rule
    applied after a stop token, ignoring the step in flight) or one token longer (after
    max_tokens) is served, and the next turn's state digests differ from its cold run."""
    kw = {"max_tokens": 8, "stop_token_ids": [_stop_token()]} if stopped else {"max_tokens": 4}
    _spy(monkeypatch, shift)
    e = async_engine()
    first = e.run(PROMPT, **kw)
    monkeypatch.undo()
    warm, ref = _next_turn(e, first)
    exact = len(PROMPT) + len(first.tokens) - (0 if stopped else 1)
    assert warm.cached == exact + shift
    assert warm.state != ref.state
    with pytest.raises(AssertionError):
        same(warm, ref)


def test_anchor_end_under_async_scheduling_misses_on_any_doubt():
    """The counts the anchor accepts (see anchor_end): settled tokens are all but the last
    sampled, at most one step in flight, no drafts."""
    assert anchor_end(103, 104, 100, 103, 1, False, 0) == (103, 0)     # nothing in flight
    assert anchor_end(104, 104, 100, 103, 1, False, 1) == (104, 0)     # the stop token's step
    assert anchor_end(105, 104, 100, 104, 1, False, 2) is None         # two steps in flight
    assert anchor_end(104, 104, 100, 103, 1, False, 0) is None         # counts disagree
    assert anchor_end(102, 104, 100, 101, 1, False, 0) is None
    assert anchor_end(104, 104, 100, 103, 1, True, 1) is None          # drafts: off
    # synchronous scheduling (in_flight None): unchanged
    assert anchor_end(103, 104, 100, 103, 1, False) == (103, 0)


def test_a_preempted_request_leaves_no_anchor_under_async_scheduling(monkeypatch):
    """A preemption resets vLLM's counts while a step may be in flight (its output dropped or
    delivered stale): on that doubt the request leaves no anchor (anchor_end is not even
    asked), and its output is still the cold one's. The preemption is vLLM's own path
    (`reset_prefix_cache(reset_running_requests=True)` preempts every running request, then
    refuses to reset its prefix cache while the step in flight holds blocks)."""
    ref = HarnessEngine().run(PROMPT, max_tokens=6)
    calls = _spy(monkeypatch)
    e = async_engine()
    r = e.add(PROMPT, max_tokens=6)
    e.step_until(lambda: len(e.runs[r].tokens) >= 2)
    assert e.in_flight() == 1
    with pytest.raises(RuntimeError, match="Failed to reset KV cache"):
        e.scheduler.reset_prefix_cache(reset_running_requests=True)
    assert e.scheduler.requests[r].num_preemptions == 1
    e.drain()
    assert e.runs[r].finished and e.runs[r].tokens == ref.tokens
    assert calls == [] and cache_stats(e, "anchor")["reservations"] == 0
