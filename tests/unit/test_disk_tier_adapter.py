"""The disk tier in the adapter: start-up checks, writes planned at commit and done by the
worker's writer thread, a disk hit's load carrying its files, a scoped clear.

Real scheduler and worker sides with vLLM's `Request` objects, no model (see
tests/unit/test_tiered_cache_adapter.py for the harness).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.adapter.test_unkeyed_inputs import TOKENS, _kv_cache_config, _request, _vllm_config
from tests.unit.test_tiered_cache_adapter import BLOCKS, _no_steps, _report
from vllm_hybridcache.config import CacheSettings
from vllm_hybridcache.core import LinkKind


def _side(disk_dir, vllm_config=None):
    from vllm_hybridcache.adapter.scheduler_side import SchedulerSide

    settings = CacheSettings(grid=64, message_end_ids=(-1,), memory_floor_bytes=0,
                             disk_dir=str(disk_dir), disk_min_free_bytes=0)
    return SchedulerSide(vllm_config or _vllm_config(), _kv_cache_config(), settings)


def _worker():
    from vllm_hybridcache.adapter.worker_side import WorkerSide

    return WorkerSide(SimpleNamespace(), _kv_cache_config())


def _commit_link(side, worker, cut: int, build: bool = True):
    """Reserve and commit the tree link of TOKENS at `cut` as a step would, with its payload
    in the worker's store; returns the plan that follows the commit (None: not built)."""
    from vllm_hybridcache.adapter.domain import request_domain

    entry = side._track(_request("w", TOKENS))
    r = side.cache.reserve(LinkKind.TREE, entry.keys, cut,
                           request_domain(side.base_domain, _request("w", TOKENS)))
    layout = side.parts.layout
    bufs = worker.store.allocate(r.link_id, layout.view_rows(r.start, r.end))
    for t in (*bufs.sections.values(), *bufs.views.values()):
        t.fill_(1)
    worker.store.seal(r.link_id)
    side.apply_report(_report(saved={r.addr: 0.0}, saved_count={r.addr: 1}))
    return r, side.build_plan(_no_steps()) if build else None


def test_tp_or_pp_above_one_refuses_the_disk_tier(tmp_path):
    cfg = _vllm_config()
    cfg.parallel_config.tensor_parallel_size = 2
    with pytest.raises(RuntimeError, match="one worker only"):
        _side(tmp_path, cfg)


def test_an_unusable_disk_dir_is_a_clear_start_up_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(RuntimeError, match="is not usable") as err:
        _side(blocker / "disk")
    assert str(blocker) in str(err.value)


def test_commits_are_written_and_a_restart_serves_them_from_disk(tmp_path):
    side, worker = _side(tmp_path), _worker()
    assert side.cache.routes() == [("ram", "tree"), ("disk", "tree"), ("ram", "anchor")]
    r, plan = _commit_link(side, worker, 128)
    (job,) = plan.disk_writes
    assert (job.link_id, job.start, job.end) == (r.link_id, 0, 128)
    assert plan.disk_target is not None and plan.disk_target.root == str(tmp_path)
    worker.save(plan)
    assert worker._writer.close(30)
    assert len(list(tmp_path.rglob("*-128.link"))) == 1
    report = worker.take_report()
    assert report.disk["writes"] == 1 and report.disk["files"] == 1
    side.apply_report(report)
    st = side.cache.stats()[("disk", "tree")]
    assert (st.captures, st.links) == (1, 1) and st.capture_bytes > 0

    # a restart on the same folder: the next request's load carries the file
    side2 = _side(tmp_path)
    req = _request("b", [*TOKENS, 1, 2])
    assert side2.get_num_new_matched_tokens(req, 0) == (128, True)
    side2.update_state_after_alloc(req, BLOCKS, 128)
    (load,) = side2.build_plan(_no_steps()).loads
    assert (load.tier, load.kind) == ("disk", "tree") and len(load.sources) == 1
    assert load.fingerprint == side2._disk_target.fingerprint
    side2.apply_report(_report(loaded={"b": 0.01}))
    st = side2.cache.stats()[("disk", "tree")]
    assert (st.hits, st.restores, st.tokens_served) == (1, 1, 128)
    # promoted: the RAM tree took the staged link (the worker keeps it), the next request on
    # the prefix is a RAM hit
    assert side2.build_plan(_no_steps()).drops == []
    assert side2.tree.is_committed(load.chain[0].link_id)
    assert side2.cache.lookup(side2.cache.keys([*TOKENS, 5]), side2._live["b"].domain).tier \
        == "ram"
    side2.cache.sanity_check()


def test_a_failed_disk_read_deletes_the_file_and_counts_the_problem(tmp_path):
    side, worker = _side(tmp_path), _worker()
    _, plan = _commit_link(side, worker, 128)
    worker.save(plan)
    assert worker._writer.close(30)
    (path,) = tmp_path.rglob("*-128.link")
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 1
    path.write_bytes(bytes(raw))

    side2, worker2 = _side(tmp_path), _worker()
    req = _request("b", [*TOKENS, 1])
    side2.get_num_new_matched_tokens(req, 0)
    side2.update_state_after_alloc(req, BLOCKS, 128)
    plan = side2.build_plan(_no_steps())
    worker2.start_load(plan)  # the writer starts with this plan; the read fails its CRC
    report = worker2.take_report()
    assert report.failed_loads == {"b"} and len(report.lost_links) == 1
    assert len(worker2.store) == 0
    side2.apply_report(report)
    assert not path.exists()
    assert worker2._writer.close(30)
    side2.apply_report(_report(disk=worker2._writer.snapshot()))
    st = side2.cache.stats()[("disk", "tree")]
    assert st.misses.get("checksum") == 1 and st.restores_failed == 1
    assert side2.get_num_new_matched_tokens(req, 0) == (0, False)  # recomputed cold


def test_drops_wait_for_the_writer(tmp_path):
    side, worker = _side(tmp_path), _worker()
    r, plan = _commit_link(side, worker, 64)
    import threading

    from vllm_hybridcache.core.disk.writer import LinkWriter

    gate = threading.Event()
    real = LinkWriter.__init__

    def slow(self, target, *a, **kw):
        from vllm_hybridcache.core.disk.writer import _open_directory

        def opener(t):
            gate.wait(10)
            return _open_directory(t)

        real(self, target, directory=opener)

    LinkWriter.__init__ = slow
    try:
        worker.save(plan)
    finally:
        LinkWriter.__init__ = real
    side.clear(tier="ram")  # the RAM link is dropped while its write is queued
    plan = side.build_plan(_no_steps())
    assert [a.link_id for a in plan.drops] == [r.link_id]
    worker.save(plan)
    assert worker.store.has(r.link_id)  # deferred: the writer still reads it
    gate.set()
    assert worker._writer.close(30)
    worker.save(side.build_plan(_no_steps()))
    assert not worker.store.has(r.link_id) and not worker._deferred_drops
    assert len(list(tmp_path.rglob("*-64.link"))) == 1


def test_clear_of_the_disk_tier_reaches_the_writer_and_drops_queued_writes(tmp_path):
    side, worker = _side(tmp_path), _worker()
    _, plan = _commit_link(side, worker, 64)
    worker.save(plan)
    assert worker._writer.close(30)
    side2, worker2 = _side(tmp_path), _worker()
    _commit_link(side2, worker2, 128, build=False)  # its write is queued, not yet planned
    assert len(side2._disk_writes) == 1
    assert side2.clear(tier="disk") == 1
    plan = side2.build_plan(_no_steps())
    assert plan.disk_clear and plan.disk_writes == [] and not list(tmp_path.rglob("*.link"))
    assert len(side2.tree) == 1  # the RAM tier is not touched
