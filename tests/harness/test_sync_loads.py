"""Synchronous RAM loads (`sync_loads`) on vLLM's real scheduler, without a model.

A RAM hit loads in the step that runs its request instead of a step ahead. What must hold:
the request is scheduled in the step of its lookup; the output is cold-exact; and a load that
fails is withdrawn with its step, together with every request that read the blocks it should
have written (vLLM caches a synchronous load's blocks when it allocates them, so a request
scheduled after it in the same step may take them as a local hit). The negative control shows
that withdrawing the failed request alone would hand that reader a wrong state.
"""

from __future__ import annotations

import pytest

from tests.harness.engine import HarnessEngine, cache_stats
from tests.harness.test_protocol import GRID, A, cold, same
from vllm_hybridcache.adapter import scheduler as segmented


def first_step(settings=None, **kw) -> tuple[HarnessEngine, str, object]:
    """An engine that ran A once (its links cached), a second A added: the first step
    scheduled after it."""
    e = HarnessEngine(settings, **kw)
    e.run(A)
    rid = e.add(A)
    return e, rid, e.schedule()


def test_a_ram_hit_runs_in_the_step_of_its_lookup():
    ref = cold(A)
    e, rid, so = first_step()
    assert so.has_sync_kv_loads and so.num_scheduled_tokens.get(rid) == len(A) - 3 * GRID
    e.update(so, e.execute(so))
    e.drain()
    assert e.runs[rid].cached == 3 * GRID
    same(e.runs[rid], ref)
    assert cache_stats(e)["restores"] == 1


@pytest.mark.parametrize("how", ["setting off", "async scheduling"])
def test_a_hit_loads_a_step_ahead_where_sync_loads_do_not_apply(how):
    """Negative control of the test above: with `sync_loads` off, or under async scheduling
    (where the next step is planned before a failed load's report could withdraw it), the
    hit waits in vLLM's queue for the step that loads it."""
    kw = ({"settings": {"sync_loads": False}} if how == "setting off"
          else {"async_scheduling": True})
    e, rid, so = first_step(**kw)
    assert not so.has_sync_kv_loads and rid not in so.num_scheduled_tokens
    e.update(so, e.execute(so))
    e.drain()
    same(e.runs[rid], cold(A))


def test_a_sync_loads_blocks_are_registered_only_after_its_step():
    """Why no request can read a failed synchronous load's blocks in our configurations:
    attention K/V in place registers a request's blocks only up to the tokens of its finished
    steps (compat/kv_cache_manager.py), and without it vLLM's prefix cache is off. So a second
    request with the same prompt in the same step takes none of the first one's blocks."""
    for settings in ({}, {"attention_in_place": False}):
        e = HarnessEngine(settings)
        e.run(A)
        assert e.scheduler.reset_prefix_cache()
        first, second = e.add(A), e.add(A)
        so = e.schedule()
        assert so.has_sync_kv_loads and {first, second} <= set(so.num_scheduled_tokens)
        ids = [set(e.scheduler.kv_cache_manager.get_block_ids(r)[1]) for r in (first, second)]
        assert not ids[0] & ids[1], settings


def _register_at_allocation(monkeypatch, e: HarnessEngine) -> None:
    """Make the engine's block registry behave as vLLM's own coordinator does: a step's
    blocks are registered when it is scheduled (so a synchronous load's, before it ran)."""
    coordinator = type(e.scheduler.kv_cache_manager.coordinator)
    monkeypatch.setattr(coordinator, "cache_blocks", coordinator.__mro__[1].cache_blocks)


def _two_readers(e: HarnessEngine, monkeypatch):
    """A's links cached, vLLM's own blocks of A gone, blocks registered at allocation; then A
    twice in one step, the first one's load failing after it filled its blocks with garbage:
    the second takes those blocks as its local hit. Returns both runs and the two requests'
    attention blocks."""
    e.run(A)
    assert e.scheduler.reset_prefix_cache()      # vLLM's blocks only: the links stay
    _register_at_allocation(monkeypatch, e)
    first, second = e.add(A), e.add(A)

    def garbage_then_fail(kind, job):
        if kind == "load" and job.req_id == first:
            e.workers[0].kv[:, job.block_ids[1]] = 9.0
            raise RuntimeError("injected copy error after a partial write")

    e.set_fault(garbage_then_fail)
    so = e.schedule()
    blocks = [set(e.scheduler.kv_cache_manager.get_block_ids(r)[1]) for r in (first, second)]
    assert so.has_sync_kv_loads and {first, second} <= set(so.num_scheduled_tokens)
    e.update(so, e.execute(so))
    e.set_fault(None)
    e.drain()
    return e.runs[first], e.runs[second], blocks


def test_a_failed_sync_load_is_withdrawn_with_every_request_that_read_its_blocks(monkeypatch):
    """Defence in depth, should a request read them (a registry like vLLM's own): that reader
    is withdrawn with the failed request, and both compute what a cold run computes."""
    ref = cold(A)
    e = HarnessEngine()
    first, second, blocks = _two_readers(e, monkeypatch)
    assert blocks[0] & blocks[1]                  # the second read the first's blocks
    same(first, ref)
    same(second, ref)
    s = cache_stats(e)
    assert s["restores_failed"] == 1 and s["invalidated"] == 0
    assert first.cached == 0                      # recomputed from token 0
    assert e.peek(A) == 3 * GRID                  # the chain is whole (recaptured or kept)


def test_withdrawing_only_the_failed_request_would_serve_garbage(monkeypatch):
    """Negative control: the reader of the failed load's blocks, left running, computes from
    the garbage those blocks hold."""
    real = segmented.withdraw_failed_sync_load

    def failed_only(scheduler, req_id, in_place):
        others = [r for r in scheduler.running if r.request_id != req_id]
        for r in others:
            scheduler.running.remove(r)
        try:
            return real(scheduler, req_id, in_place)
        finally:
            scheduler.running.extend(others)

    monkeypatch.setattr(segmented, "withdraw_failed_sync_load", failed_only)
    ref = cold(A)
    first, second, blocks = _two_readers(HarnessEngine(), monkeypatch)
    assert blocks[0] & blocks[1]
    same(first, ref)
    assert second.state != ref.state or second.tokens != ref.tokens


def test_withdraw_failed_sync_load_undoes_the_step_on_the_installed_vllm():
    """The compat bend itself on the installed vLLM: the request leaves `running` for the
    front of the waiting queue at token 0, the step's output is dropped (no token reaches
    the client from it), and the request then runs to the cold result."""
    from vllm.v1.request import RequestStatus

    from vllm_hybridcache.compat import withdraw_failed_sync_load

    ref = cold(A)
    e, rid, so = first_step()
    outputs = e.execute(so)              # the step ran; its output not applied yet
    assert withdraw_failed_sync_load(e.scheduler, "no-such-request", 0) == []
    assert withdraw_failed_sync_load(e.scheduler, rid, 0) == [rid]
    req = e.scheduler.requests[rid]
    assert req.status == RequestStatus.PREEMPTED and req not in e.scheduler.running
    assert req.num_computed_tokens == 0 and e.scheduler.waiting.peek_request() is req
    e.update(so, outputs)
    assert e.runs[rid].tokens == [] and not e.runs[rid].finished
    e.drain()
    assert e.runs[rid].tokens == ref.tokens
