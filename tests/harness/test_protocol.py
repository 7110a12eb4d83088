"""The connector's protocol on vLLM's real scheduler, without a model (tests/harness/engine.py).

Each test drives `SegmentedScheduler` and our connector's two halves through the paths that
decide correctness: a restored request must compute exactly what a cold one computes, a link
must not be visible before every worker confirmed its copy, and every failure (a failed save, a
failed load, a preemption, a worker that did not save its shard, a clear during a restore) must
leave the cache consistent and the output cold-exact. The fake model's state at each position
depends on every token before it and is read back from the fake KV tensors, so a wrong restore
shows in the state digests (the negative control proves it). Runs in seconds.
"""

from __future__ import annotations

import pytest

from tests.harness.engine import HarnessEngine, cache_stats, dropped_ids, load_chain
from vllm_hybridcache.core import MissingLinkError

GRID = 64
A = [100 + (i * 7) % 3000 for i in range(3 * GRID + 20)]          # cuts at 64, 128, 192
B = A[: 2 * GRID] + [50 + (i * 13) % 3000 for i in range(70)]     # shares A's first 2 cuts


def cold(prompt: list[int], **kw):
    """The reference: the same request in a fresh engine (nothing cached)."""
    return HarnessEngine(**kw).run(prompt)


def same(warm, ref) -> None:
    assert warm.finished and ref.finished
    assert warm.tokens == ref.tokens
    assert warm.state is not None and warm.state == ref.state


SCHEDULING = pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])


@SCHEDULING
def test_hit_from_the_tree_equals_cold(async_scheduling):
    """Sync and async scheduling (vLLM's `AsyncScheduler`, one step in flight) alike."""
    a_cold, b_cold = cold(A), cold(B)
    e = HarnessEngine(async_scheduling=async_scheduling)
    first = e.run(A)
    assert first.cached == 0
    same(first, a_cold)
    assert cache_stats(e)["links"] == 3                 # 64, 128, 192
    b = e.run(B)                                         # resumes at A's link at 128
    a = e.run(A)                                         # resumes at 192: a 3-link chain
    assert (b.cached, a.cached) == (2 * GRID, 3 * GRID)
    same(b, b_cold)
    same(a, a_cold)
    s = cache_stats(e)
    assert s["hits"] == 2 and s["restores"] == 2 and s["tokens_served"] == 5 * GRID


@SCHEDULING
def test_a_corrupted_restore_is_caught(async_scheduling):
    """Negative control: one value of the restored state off by one changes the digests (and
    here the sampled tokens too), so the comparisons above can fail (in either order)."""
    ref = cold(A)
    e = HarnessEngine(async_scheduling=async_scheduling)
    e.run(A)
    e.corrupt_restores()
    warm = e.run(A)
    assert warm.cached == 3 * GRID
    assert warm.state != ref.state
    with pytest.raises(AssertionError):
        same(warm, ref)


def test_hit_from_an_end_anchor_equals_cold():
    """The next turn (previous prompt + answer + new message) resumes at the state the
    finished request left: its prompt and all but the last sampled token."""
    e = HarnessEngine()
    first = e.run(A[:100], max_tokens=4)
    turn = A[:100] + first.tokens + [7, 8, 9, 10, 11]
    ref = cold(turn)
    assert cache_stats(e, "anchor")["links"] == 1
    warm = e.run(turn)
    assert warm.cached == 100 + len(first.tokens) - 1
    same(warm, ref)
    anchor = cache_stats(e, "anchor")
    assert anchor["hits"] == 1 and anchor["tokens_served"] == warm.cached
    assert cache_stats(e)["hits"] == 0                  # served by the anchor, not the tree


def test_nothing_is_visible_before_the_workers_report():
    """Two-phase commit: a link whose copy ran but whose report has not reached the scheduler
    is pending and invisible; the report commits it."""
    e = HarnessEngine()
    e.add(A)
    so = e.schedule()                                    # prefill [0, 64): capture at 64
    assert [c.row_end for c in so.kv_connector_metadata.captures] == [GRID]
    outputs = e.execute(so)                              # the worker copied it...
    s = cache_stats(e)
    assert (s["links"], s["links_pending"]) == (0, 1)    # ...but it is only reserved
    assert e.peek(A[: GRID + 5]) == 0                    # and nobody can see it
    e.update(so, outputs)                                # the report arrives
    s = cache_stats(e)
    assert (s["links"], s["links_pending"], s["captures"]) == (1, 0, 1)
    assert e.peek(A[: GRID + 5]) == GRID


def test_a_failed_save_aborts_its_link_and_what_hangs_below():
    ref = cold(A)
    e = HarnessEngine()
    saves = []

    def fail_second_save(kind, job):
        if kind == "capture":
            saves.append(job.link_id)
            if len(saves) == 2:
                raise RuntimeError("injected capture failure")

    e.set_fault(fail_second_save)
    out = e.run(A)
    same(out, ref)                                       # a failed save never hurts output
    s = cache_stats(e)
    assert s["aborts"] == 1 and s["captures"] == 1 and s["links"] == 1
    assert s["links_pending"] == 0
    assert s["skips"].get("parent_refused") == 1         # the cut below it is not captured
    e.set_fault(None)
    again = e.run(A)                                     # resumes at the surviving link
    assert again.cached == GRID
    same(again, ref)
    assert cache_stats(e)["links"] == 3                  # and the retry fills the gap


def test_preemption_captures_nothing_after_it():
    ref = cold(A)
    e = HarnessEngine()
    req = e.add(A)
    e.step_until(lambda: cache_stats(e)["links"] == 1)   # first segment committed
    e.preempt_running()                                  # vLLM's own preemption path
    e.drain()
    assert e.runs[req].finished
    assert e.runs[req].tokens == ref.tokens
    s = cache_stats(e)
    assert (s["links"], s["links_pending"], s["captures"]) == (1, 0, 1)
    again = e.run(A)                                     # a fresh request resumes there
    assert again.cached == GRID
    same(again, ref)


def test_a_failed_load_is_recomputed_and_its_link_invalidated():
    """A worker that lost a link's payload reports it: vLLM recomputes the request from
    scratch (kv_load_failure_policy=recompute), the link and its descendants go."""
    ref = cold(A)
    e = HarnessEngine()
    e.run(A)

    def lost_deepest(kind, job):
        if kind == "load":
            raise MissingLinkError(load_chain(job)[-1])

    e.set_fault(lost_deepest)
    out = e.run(A)
    e.set_fault(None)
    assert out.cached == 0                               # its first forward started at 0
    same(out, ref)
    s = cache_stats(e)
    assert s["restores_failed"] == 1 and s["restores"] == 0 and s["invalidated"] == 1
    assert e.peek(A) == 3 * GRID                         # recaptured by the recomputed run


def test_a_failed_load_without_a_lost_link_keeps_the_chain():
    ref = cold(A)
    e = HarnessEngine()
    e.run(A)

    def copy_error(kind, job):
        if kind == "load":
            raise RuntimeError("injected copy error")

    e.set_fault(copy_error)
    out = e.run(A)
    e.set_fault(None)
    assert out.cached == 0
    same(out, ref)
    s = cache_stats(e)
    assert s["restores_failed"] == 1 and s["invalidated"] == 0 and s["links"] == 3


def test_tensor_parallel_reports_are_merged():
    """Two workers, each with its own shard: a link commits only when both saved it, a
    restore loads both shards exactly."""
    refs = HarnessEngine(workers=2)
    ref = refs.run(A)
    ref_rank1 = refs.instrumentation[1].digests
    e = HarnessEngine(workers=2)
    e.run(A)
    assert cache_stats(e)["links"] == 3
    e.instrumentation[1].digests.clear()
    warm = e.run(A)
    assert warm.cached == 3 * GRID
    same(warm, ref)
    assert list(e.instrumentation[1].digests.values()) == list(ref_rank1.values())
    assert e.instrumentation[0].totals["loads"] == e.instrumentation[1].totals["loads"] == 1


def test_a_link_saved_by_one_worker_only_is_aborted():
    ref = cold(A, workers=2)
    e = HarnessEngine(workers=2)
    saves = []

    def rank1_fails_second(kind, job):
        if kind == "capture":
            saves.append(job.link_id)
            if len(saves) == 2:
                raise RuntimeError("injected shard copy failure")

    e.set_fault(rank1_fails_second, rank=1)
    out = e.run(A)
    same(out, ref)
    s = cache_stats(e)
    # rank 0 saved the links at 64 and 128 and the end anchor, rank 1 all but the one at 128
    assert [i.totals["captures"] for i in e.instrumentation] == [3, 2]
    assert s["aborts"] == 1 and s["links"] == 1          # so the link at 128 was aborted
    e.set_fault(None, rank=1)
    assert e.run(A).cached == GRID


def test_clear_during_a_restore_keeps_the_chain_until_it_ends():
    """`reset_cache` while a restore is in flight (plan built, worker not done): the chain
    leaves the tree at once, but its payload is dropped only after the restore ended. Here
    the next plan is built before the restore's report arrives (as with a batch queue)."""
    ref = cold(A)
    e = HarnessEngine()
    e.run(A)
    req = e.add(A)
    so1 = e.schedule()
    (load,) = so1.kv_connector_metadata.loads
    chain = set(load_chain(load))
    assert len(chain) == 3
    e.clear()
    assert e.peek(A) == 0                                # gone from the tree at once
    so2 = e.schedule()                                   # built while the restore runs
    assert chain.isdisjoint(dropped_ids(so2.kv_connector_metadata))
    e.update(so1, e.execute(so1))                        # the load lands; the restore ends
    e.update(so2, e.execute(so2))
    e.drain()
    out = e.runs[req]
    assert out.cached == 3 * GRID
    same(out, ref)
    dropped = set().union(*(dropped_ids(plan) for plan in e.plans))
    assert chain <= dropped                              # released after the restore ended
    s = cache_stats(e)
    assert s["restores"] == 1 and s["restores_failed"] == 0


@pytest.mark.parametrize("kind", ["unhashed_image", "embeds"])
def test_unkeyed_inputs_neither_hit_nor_capture(kind):
    """Prompt embeddings and multimodal items without a content hash are not named by the token
    ids: such a request must not restore a text request's state, and must leave no link or
    anchor behind."""
    e = HarnessEngine()
    e.run(A)
    before, anchors_before = cache_stats(e), cache_stats(e, "anchor")
    extra = {"image": ""} if kind == "unhashed_image" else {"embeds": True}
    out = e.run([*A, 5, 6, 7], **extra)
    assert out.finished and out.cached == 0
    after, anchors_after = cache_stats(e), cache_stats(e, "anchor")
    assert after["misses"].get("unkeyed_input") == 1
    assert after["hits"] == before["hits"]
    assert after["reservations"] == before["reservations"] and after["links"] == 3
    assert anchors_after["links"] == anchors_before["links"]
    assert e.run([*A, 5, 6, 7]).cached == 3 * GRID      # control: the same text hits


def test_images_are_keyed_by_their_content_hash():
    """An image's content is part of the key: the same image hits past its placeholders;
    another image, or text with the same token ids, never restores past the placeholders'
    start."""
    e = HarnessEngine()
    p = [*A, 5, 6, 7]
    assert e.run(p, image="img-1").cached == 0          # nothing holds this image yet
    assert e.run(p, image="img-1").cached == 3 * GRID   # the same image: past it
    assert e.run(p, image="img-2").cached == 0          # another image: placeholders at 8
    assert e.run(p).cached == 0                         # the text alone: not the image's state


def test_a_reused_uuid_plants_no_state_through_vllms_scheduler():
    """vLLM's real scheduler and encoder cache: client 1 sends image A under uuid U; client 2
    sends image B under U, and vLLM's encoder cache serves it A's embeddings (it trusts the
    uuid). Client 2 restores nothing and captures nothing, so a later request with B under its
    own uuid gets no state computed from A; A under another uuid hits past the image."""
    e = HarnessEngine()
    assert _reused_uuid_runs(e) == [0, 0, 0, 3 * GRID]
    assert cache_stats(e)["misses"].get("unkeyed_input") == 1  # client 2


def test_negative_control_without_encoder_bindings_the_reused_uuid_plants_state(monkeypatch):
    """Content keys without the encoder bindings: client 2's prefill (A's embeddings under B's
    key) is captured, and B under another uuid restores it."""
    from vllm_hybridcache.adapter import mm_keys

    monkeypatch.setattr(mm_keys.EncoderBindings, "conflicts", lambda self, item: False)
    monkeypatch.setattr(mm_keys.EncoderBindings, "bound", lambda self, item: True)
    assert _reused_uuid_runs(HarnessEngine()) == [0, 0, 3 * GRID, 3 * GRID]


def _reused_uuid_runs(e: HarnessEngine) -> list[int]:
    p = [*A, 5, 6, 7]
    return [e.run(p, image=image, uuid=uuid).cached
            for image, uuid in (("pixels-A", "U"), ("pixels-B", "U"), ("pixels-B", "V"),
                                ("pixels-A", "W"))]
