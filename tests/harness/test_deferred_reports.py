"""Links whose report lands a step late (vLLM's runner with a draft model), on vLLM's real
scheduler without a model (tests/harness/engine.py, `defer_save`).

With speculative decoding vLLM's model runner builds a step's connector output before the
draft runs and calls `wait_for_save` after it, so the workers report a step's copies with the
next step: for one more step the link is pending. A request sharing the prefix that arrives
then waits for it (vllm_hybridcache/adapter/inflight.py) instead of prefilling from the root
what the link serves a step later; the wait is bounded, and the result is cold-exact.
"""

from __future__ import annotations

from tests.harness.engine import HarnessEngine, cache_stats
from tests.harness.test_protocol import GRID, A, B, cold, same
from vllm_hybridcache.adapter.inflight import MAX_WAITS


def test_a_request_waits_for_a_link_whose_report_is_deferred():
    """B shares A's cuts at 64 and 128 and arrives after A's first step: on the deferred
    path it starts where it would on the AR path once A's links are reported, not cold."""
    b_ref = cold(B)
    e = HarnessEngine(defer_save=True)
    e.add(A)
    e.step()                                             # A [0, 64): copied, not reported
    s = cache_stats(e)
    assert (s["links"], s["links_pending"]) == (0, 1)
    b = e.add(B)                                         # B waits; 64 is reported, then
    e.drain()                                            # 128 (A's later steps)
    assert e.runs[b].cached == 2 * GRID                  # A's 128 landed meanwhile
    same(e.runs[b], b_ref)
    s = cache_stats(e)
    assert s["hits"] == 1 and s["links_pending"] == 0 and s["links"] == 4  # + B's 192


def test_without_deferred_reports_nothing_waits():
    """The control: the same arrival on the AR order (reports with their own step) is served
    A's link at 64 at once, as before; on the deferred order a prompt that no link in
    flight serves starts cold at once."""
    b_ref = cold(B)
    e = HarnessEngine()
    e.add(A)
    e.step()                                             # A [0, 64): reported, committed
    b = e.add(B)
    e.drain()
    assert e.runs[b].cached == GRID
    same(e.runs[b], b_ref)
    d = HarnessEngine(defer_save=True)
    d.add(A)
    d.step()
    other = d.add([9, *B[1:]])                           # shares nothing with A
    d.step()
    assert d.runs[other].cached == 0                     # scheduled in that very step


def test_the_wait_is_bounded():
    """C shares all three of A's cuts, each still in flight when C asks: C waits MAX_WAITS
    steps, then starts from what is committed by then (64 and 128; 192 is in flight), and
    equals its cold run."""
    c_prompt = A[: 3 * GRID] + [77] * 10
    c_ref = cold(c_prompt)
    e = HarnessEngine(defer_save=True)
    e.add(A)
    e.step()
    c = e.add(c_prompt)
    e.drain()
    assert MAX_WAITS == 2
    assert e.runs[c].cached == 2 * GRID
    same(e.runs[c], c_ref)
