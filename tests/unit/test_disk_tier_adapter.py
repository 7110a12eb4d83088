"""The disk tier in the adapter: start-up checks, writes planned at commit and done by the
worker's writer thread, a disk hit's load carrying its files, a scoped clear.

Real scheduler and worker sides with vLLM's `Request` objects, no model (see
tests/unit/test_tiered_cache_adapter.py for the harness).
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from tests.adapter.test_unkeyed_inputs import TOKENS, _kv_cache_config, _request, _vllm_config
from tests.unit.test_tiered_cache_adapter import BLOCKS, _no_steps, _report
from vllm_hybridcache.config import CacheSettings
from vllm_hybridcache.core import LinkKind
from vllm_hybridcache.core.tiers.disk_behind import DiskOps


def _side(disk_dir, vllm_config=None, **kw):
    from vllm_hybridcache.adapter.scheduler_side import SchedulerSide

    kw.setdefault("disk_write_first_tokens", 0)  # every committed link written (no counts)
    settings = CacheSettings(grid=64, message_end_ids=(-1,), memory_floor_bytes=0,
                             disk_dir=str(disk_dir), disk_min_free_bytes=0, **kw)
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


def test_pp_above_one_refuses_the_disk_tier(tmp_path):
    cfg = _vllm_config()
    cfg.parallel_config.pipeline_parallel_size = 2
    with pytest.raises(RuntimeError, match="one pipeline stage only"):
        _side(tmp_path, cfg)


def test_tp_above_one_opens_one_folder_per_rank(tmp_path):
    """TP = 2: one link is one file per rank (core/disk/sharded.py); the workers are told
    how many ranks write, each its share of the budget (tests/harness/test_disk_shards.py
    runs it)."""
    from vllm_hybridcache.core.disk.sharded import ShardedDirectory

    cfg = _vllm_config()
    cfg.parallel_config.tensor_parallel_size = 2
    side = _side(tmp_path, cfg)
    disk = side.cache.tier("disk", "tree")
    assert isinstance(disk.dir, ShardedDirectory)
    assert [s.dir.name for s in disk.dir.shards] == ["shard-0-of-2", "shard-1-of-2"]
    assert [s.shard.tag for s in disk.dir.shards] == ["0/2", "1/2"]
    assert disk.dir.budget_bytes <= side.settings.disk_budget_bytes


def test_an_unusable_disk_dir_is_a_clear_start_up_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(RuntimeError, match="is not usable") as err:
        _side(blocker / "disk")
    assert str(blocker) in str(err.value)


def test_a_disk_dir_others_can_write_or_holding_the_key_stops_the_start_up(tmp_path):
    """The folder is the engine's own (issue 29): a 0777 folder, or the disk key inside it,
    stops the start-up with an error that names the fix; nothing is written there."""
    import os

    root = tmp_path / "shared"
    root.mkdir()
    os.chmod(root, 0o777)
    with pytest.raises(RuntimeError, match=f"chmod 700 {root}"):
        _side(root)
    assert list(root.iterdir()) == []
    os.chmod(root, 0o700)
    with pytest.raises(RuntimeError, match="inside disk_dir"):
        _side(root, disk_key_file=str(root / "disk.key"))
    assert list(root.iterdir()) == []
    _side(root, disk_key_file=str(tmp_path / "disk.key"))  # the key beside it: fine
    assert (tmp_path / "disk.key").stat().st_mode & 0o777 == 0o600  # created on first start


def test_files_written_under_another_disk_key_are_a_counted_miss(tmp_path):
    """A restart with another disk key (another installation's, a lost key file): the files
    the first life wrote are never served; each is refused as `unauthenticated`, counted in the
    disk tier's misses and deleted, and the prompt is a plain miss (prefilled cold)."""
    side, worker = _side(tmp_path / "disk", disk_key_file=str(tmp_path / "a.key")), _worker()
    _, plan = _commit_link(side, worker, 128)
    worker.save(plan)
    assert worker.handlers["disk"].writer.close(30)
    assert len(list((tmp_path / "disk").rglob("*-128.link"))) == 1
    side.cache.lower("disk").disk.dir.close()  # the first life ends (its lock on its folder goes)
    side2 = _side(tmp_path / "disk", disk_key_file=str(tmp_path / "b.key"))
    # keyed names: the new key looks elsewhere, and the old key's folder is swept as foreign
    req = _request("b", [*TOKENS, 1, 2])
    assert side2.get_num_new_matched_tokens(req, 0) == (0, False)
    assert not list((tmp_path / "disk").rglob("*-128.link"))
    # the first life's file planted where the new key looks: refused and counted
    side3 = _side(tmp_path / "disk", disk_key_file=str(tmp_path / "a.key"))
    _, plan = _commit_link(side3, worker := _worker(), 128)
    worker.save(plan)
    assert worker.handlers["disk"].writer.close(30)
    (src,) = (tmp_path / "disk").rglob("*-128.link")
    side4 = _side(tmp_path / "disk", disk_key_file=str(tmp_path / "b.key"))
    dst = side4.cache.lower("disk").disk.dir.path_for(
        side3._track(_request("w", TOKENS)).domain, 128, side4.cache.keys(TOKENS).digest(128))
    dst.parent.mkdir(mode=0o700, exist_ok=True)
    dst.write_bytes(src.read_bytes())
    assert side4.get_num_new_matched_tokens(_request("c", [*TOKENS, 1, 2]), 0) == (0, False)
    assert side4.cache.stats()[("disk", "tree")].misses.get("unauthenticated") == 1
    assert not dst.exists()


def test_commits_are_written_and_a_restart_serves_them_from_disk(tmp_path):
    side, worker = _side(tmp_path), _worker()
    assert side.cache.routes() == [("ram", "tree"), ("disk", "tree"), ("ram", "anchor"),
                                   ("disk", "anchor")]
    r, plan = _commit_link(side, worker, 128)
    (job,) = plan.tier_ops["disk"].writes
    assert (job.link_id, job.start, job.end) == (r.link_id, 0, 128)
    assert plan.tier_ops["disk"].target.root == str(tmp_path)
    worker.save(plan)
    assert worker.handlers["disk"].writer.close(30)
    assert len(list(tmp_path.rglob("*-128.link"))) == 1
    report = worker.take_report()
    assert report.tier_reports["disk"]["writes"] == 1 and report.tier_reports["disk"]["files"] == 1
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
    assert load.origin.fingerprint == side2.cache.lower("disk").target.fingerprint
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
    assert worker.handlers["disk"].writer.close(30)
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
    assert worker2.handlers["disk"].writer.close(30)
    side2.apply_report(_report(tier_reports={"disk": worker2.handlers["disk"].writer.snapshot()}))
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
    assert worker.handlers["disk"].writer.close(30)
    worker.save(side.build_plan(_no_steps()))
    assert not worker.store.has(r.link_id) and not worker.handlers["disk"].deferred_drops
    assert len(list(tmp_path.rglob("*-64.link"))) == 1


def test_clear_of_the_disk_tier_reaches_the_writer_and_drops_queued_writes(tmp_path):
    side, worker = _side(tmp_path), _worker()
    _, plan = _commit_link(side, worker, 64)
    worker.save(plan)
    assert worker.handlers["disk"].writer.close(30)
    side2, worker2 = _side(tmp_path), _worker()
    _commit_link(side2, worker2, 128, build=False)  # its write is queued, not yet planned
    assert len(side2.cache.lower("disk").writes) == 1
    assert side2.clear(tier="disk") == 1
    plan = side2.build_plan(_no_steps())
    ops = plan.tier_ops["disk"]
    assert ops.clear and ops.writes == [] and not list(tmp_path.rglob("*.link"))
    assert len(side2.tree) == 1  # the RAM tier is not touched


def _tenant_link(side, worker, salt: str, cut: int):
    """_commit_link for a request of tenant `salt` (no plan built)."""
    from vllm_hybridcache.adapter.domain import request_domain

    req = _request(f"w-{salt}-{cut}", TOKENS)
    req.cache_salt = salt
    entry = side._track(req)
    r = side.cache.reserve(LinkKind.TREE, entry.keys, cut,
                           request_domain(side.base_domain, req))
    bufs = worker.store.allocate(r.link_id, side.parts.layout.view_rows(r.start, r.end))
    for t in (*bufs.sections.values(), *bufs.views.values()):
        t.fill_(1)
    worker.store.seal(r.link_id)
    side.apply_report(_report(saved={r.addr: 0.0}, saved_count={r.addr: 1}))
    return r


def _tenants_on_disk(side, root) -> dict[str, int]:
    """Link files by tenant (read from their headers)."""
    from vllm_hybridcache.core import tenant_of, tenant_tag
    from vllm_hybridcache.core.linkformat.linkfile import read_header

    names = {tenant_tag(s): s for s in ("tenant-a", "tenant-b")}
    out: dict[str, int] = {}
    for p in root.rglob("*.link"):
        disk = side.cache.lower("disk")
        header, _ = read_header(p, disk.target.fingerprint, disk.disk.dir.key)
        name = names[tenant_of(header.domain)]
        out[name] = out.get(name, 0) + 1
    return out


def test_a_tenants_clear_reaches_the_writer_and_keeps_the_others_files(tmp_path):
    """Tenants A and B each have a link on disk and one more whose write is on its way when A
    is cleared: the plan carries A's clear to the writer after those writes, so no file of A
    is left (the one that landed late included) and both of B's are."""
    from vllm_hybridcache.core import tenant_tag

    side, worker = _side(tmp_path), _worker()
    for salt in ("tenant-a", "tenant-b"):
        _tenant_link(side, worker, salt, 64)
    worker.save(side.build_plan(_no_steps()))
    deadline = time.monotonic() + 30
    while not worker.handlers["disk"].writer.idle():  # both files written
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert _tenants_on_disk(side, tmp_path) == {"tenant-a": 1, "tenant-b": 1}
    for salt in ("tenant-a", "tenant-b"):
        _tenant_link(side, worker, salt, 128)
    plan = side.build_plan(_no_steps())
    assert len(plan.tier_ops["disk"].writes) == 2
    worker.save(plan)  # queued in the writer: they may land after the clear below
    n = side.clear(cache_salt="tenant-a")
    assert n >= 3  # A's two RAM links and its file(s) on disk by now
    plan = side.build_plan(_no_steps())
    assert plan.tier_ops["disk"].clear_tenants == [(tenant_tag("tenant-a"), "tree"),
                                       (tenant_tag("tenant-a"), "anchor")]
    assert not plan.tier_ops["disk"].clear and len(plan.drops) == 2
    worker.save(plan)
    assert worker.handlers["disk"].writer.close(30)
    assert _tenants_on_disk(side, tmp_path) == {"tenant-b": 2}
    assert len(side.tree) == 2  # B's RAM links


def test_a_tenants_clear_drops_its_queued_writes_only(tmp_path):
    side, worker = _side(tmp_path), _worker()
    for salt in ("tenant-a", "tenant-b"):
        _tenant_link(side, worker, salt, 64)
    assert len(side.cache.lower("disk").writes) == 2  # not yet planned
    side.clear(tier="disk", cache_salt="tenant-a")
    (job,) = side.build_plan(_no_steps()).tier_ops["disk"].writes
    from vllm_hybridcache.core import tenant_of, tenant_tag

    assert tenant_of(job.domain) == tenant_tag("tenant-b")
    assert len(side.tree) == 2  # tier disk only: RAM untouched


def _finish_anchor(side, worker, req_id: str, tokens: list[int]):
    """A request that forwarded `tokens` finishes: its end anchor is reserved, captured into
    the worker's store (payload filled by hand: no model here) and committed; returns the
    plan that carried the capture and the anchor's address."""
    from vllm.v1.request import RequestStatus

    req = _request(req_id, tokens)
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    req.num_computed_tokens = len(tokens)
    assert side.request_finished(req, ([0], [1, 2])) is True
    plan = side.build_plan(_no_steps())
    (cap,) = plan.captures
    bufs = worker.store.allocate(cap.link_id, side.parts.layout.view_rows(0, len(tokens)))
    for t in (*bufs.sections.values(), *bufs.views.values()):
        t.fill_(3)
    worker.store.seal(cap.link_id)
    plan.captures = []
    worker.save(plan)  # learns the anchor (the spill job rides with its capture)
    side.apply_report(_report(saved={cap.addr: 0.0}, saved_count={cap.addr: 1}))
    return plan, cap.addr


def test_session_spill_writes_live_anchors_at_shutdown_and_the_next_life_resumes(tmp_path,
                                                                                 caplog):
    side, worker = _side(tmp_path), _worker()
    assert side.cache.lower("disk").spill is not None and side.cache.lower("disk").target.spill
    plan, addr = _finish_anchor(side, worker, "a", TOKENS)
    (job,) = plan.tier_ops["disk"].writes
    assert (job.kind, job.when, job.link_id, job.end) == ("anchor", "spill", addr.link_id,
                                                          len(TOKENS))
    assert not list(tmp_path.rglob("*.link"))  # nothing written before the shutdown
    with caplog.at_level("INFO", logger="vllm_hybridcache"):
        worker.shutdown()  # the connector's shutdown hook
    assert "session spill wrote 1 of 1 end anchors" in caplog.text
    (f,) = tmp_path.rglob("*.link")
    assert f.parent.name.startswith("a-")

    side2 = _side(tmp_path)
    req = _request("b", [*TOKENS, 7, 8])
    assert side2.get_num_new_matched_tokens(req, 0) == (len(TOKENS), True)
    side2.update_state_after_alloc(req, BLOCKS, len(TOKENS))
    assert side2._live["b"].canonical is False  # session-exact: publishes nothing shared
    (load,) = side2.build_plan(_no_steps()).loads
    assert (load.tier, load.kind, load.sources) == ("disk", "anchor", (str(f),))


def test_without_session_spill_nothing_is_written_or_read(tmp_path):
    side, worker = _side(tmp_path, session_spill=False), _worker()
    assert side.cache.lower("disk").spill is None and side.cache.lower("disk").anchors is None
    plan, _ = _finish_anchor(side, worker, "a", TOKENS)
    assert plan.tier_ops["disk"].writes == []
    worker.shutdown()
    assert not list(tmp_path.rglob("*.link"))
    side2 = _side(tmp_path, session_spill=False)
    assert side2.get_num_new_matched_tokens(_request("b", [*TOKENS, 7]), 0) == (0, False)


def test_an_anchor_evicted_from_ram_is_written_not_lost(tmp_path):
    side, worker = _side(tmp_path, session_anchors=1), _worker()
    _, first = _finish_anchor(side, worker, "a", TOKENS)
    other = [t + 1 for t in TOKENS[:100]]
    plan, _ = _finish_anchor(side, worker, "b", other)  # evicts the first anchor (count 1)
    assert [a.link_id for a in plan.drops] == [first.link_id]
    evicted = [j for j in plan.tier_ops["disk"].writes if j.when == "now"]
    assert [(j.link_id, j.kind) for j in evicted] == [(first.link_id, "anchor")]
    assert first.link_id not in worker.handlers["disk"].spillable
    assert worker.store.has(first.link_id)  # its drop waits for the write
    assert worker.handlers["disk"].writer.close(30)
    (f,) = tmp_path.rglob("*.link")
    req = _request("c", [*TOKENS, 9])
    assert side.get_num_new_matched_tokens(req, 0) == (len(TOKENS), True)
    assert side._live["c"].lookup.tier == "disk" and f.exists()


def test_session_spill_settings():
    from vllm_hybridcache.config import SettingsError, load_settings

    s = load_settings(environ={})
    assert (s.session_spill, s.spill_timeout_s) == (True, 4)  # on whenever disk_dir is set
    s = load_settings(environ={"VLLM_HYBRIDCACHE_SESSION_SPILL": "off",
                               "VLLM_HYBRIDCACHE_SPILL_TIMEOUT_S": "5"})
    assert (s.session_spill, s.spill_timeout_s) == (False, 5)
    with pytest.raises(SettingsError, match="SESSION_SPILL must be a boolean"):
        load_settings(environ={"VLLM_HYBRIDCACHE_SESSION_SPILL": "maybe"})
    with pytest.raises(SettingsError, match="spill_timeout_s must be > 0"):
        load_settings({"spill_timeout_s": 0}, environ={})


def test_admission_writes_a_prefix_at_its_second_sighting_from_ram(tmp_path):
    """With counts (a short first prompt is not written), the link a first request committed
    is written when a second prompt with the same prefix finds it in RAM: decided at the
    lookup, before that prompt's prefill."""
    side, worker = _side(tmp_path, disk_write_first_tokens=10_000), _worker()
    first = _request("w", TOKENS)
    assert side.get_num_new_matched_tokens(first, 0) == (0, False)  # counted, not admitted
    r, plan = _commit_link(side, worker, 128)
    assert plan.tier_ops["disk"].writes == []
    assert side.cache.stats()[("disk", "tree")].skips.get("not_admitted") == 1
    second = _request("x", [*TOKENS[:128], 5, 6, 7])
    assert side.get_num_new_matched_tokens(second, 0) == (128, True)  # a RAM hit
    plan = side.build_plan(_no_steps())
    assert [(j.link_id, j.end) for j in plan.tier_ops["disk"].writes] == [(r.link_id, 128)]


def test_prefill_steps_feed_the_cost_check(tmp_path):
    """The time from a request's prefill step to its next planned step is measured as that
    step's prefill rate; a step that does not follow the previous one is not."""
    side = _side(tmp_path)
    cost = side.cache.lower("disk").disk.cost
    assert cost is not None and side.cache.lower("disk").disk._baseline is not None
    entry = side._track(_request("p", TOKENS))
    side._time_prefill(entry, 0, 64, len(TOKENS))
    assert cost.prefills_seen == 0
    side._time_prefill(entry, 64, 64, len(TOKENS))
    assert cost.prefills_seen == 1 and cost.prefill_tokens_per_s > 0
    side._time_prefill(entry, 300, 1, len(TOKENS))  # not where the last step ended
    assert cost.prefills_seen == 1
    assert side.cache.lower("disk").disk._baseline(entry.keys, entry.domain, len(TOKENS)) == 0


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "direct"])
def test_the_worker_reads_disk_hits_as_the_setting_says(tmp_path, monkeypatch, direct):
    """`disk_direct_reads` travels with the disk target to the worker, whose staging of a disk
    hit reads with direct I/O exactly when it is set (the default: on)."""
    import vllm_hybridcache.adapter.worker_side as worker_side

    side, worker = _side(tmp_path, disk_direct_reads=direct), _worker()
    _, plan = _commit_link(side, worker, 128)
    assert plan.tier_ops["disk"].target.direct_reads is direct
    worker.save(plan)
    assert worker.handlers["disk"].writer.close(30)
    side2 = _side(tmp_path, disk_direct_reads=direct)
    req = _request("b", [*TOKENS, 1, 2])
    assert side2.get_num_new_matched_tokens(req, 0) == (128, True)
    side2.update_state_after_alloc(req, BLOCKS, 128)
    (load,) = side2.build_plan(_no_steps()).loads
    seen: list[bool] = []
    monkeypatch.setattr(worker_side, "stage_chain",
                        lambda store, chain, sources, fp, d, *defer, **kw: seen.append(d) or 0)
    fresh = _worker()
    fresh._start_handlers(SimpleNamespace(
        tier_ops={"disk": DiskOps(side2.cache.lower("disk").target)}))
    fresh._stage(load)
    assert fresh.handlers["disk"].writer.close(30)
    assert seen == [direct]


def test_a_restarted_worker_warms_read_buffers_for_the_files_it_finds(tmp_path):
    """The files found at start-up travel with the disk target as token spans; the worker
    warms a pool buffer for each on a thread of its own, and the disk hit that follows reads
    into it (reused, not fresh: no page faults during the read)."""
    from vllm_hybridcache.core.slabs import size_class

    side, worker = _side(tmp_path), _worker()
    _, plan = _commit_link(side, worker, 128)
    assert plan.tier_ops["disk"].warm == []  # an empty folder at start: nothing to warm
    worker.save(plan)
    assert worker.handlers["disk"].writer.close(30)

    side2 = _side(tmp_path)
    first = side2.build_plan(_no_steps())
    assert first.tier_ops["disk"].warm == [(0, 128)]
    assert side2.build_plan(_no_steps()).tier_ops["disk"].warm == []  # sent once
    fresh = _worker()
    fresh.begin_step()  # while a step runs (forward, disk reads) the warm-up waits
    fresh._start_handlers(first)
    assert fresh.handlers["disk"].warm is not None
    fresh.handlers["disk"].warm.join(0.3)
    pool = fresh.store.pool
    assert fresh.handlers["disk"].warm.is_alive() and pool.warmed == 0
    fresh.save(first)  # the step ends
    fresh.handlers["disk"].warm.join(30)
    want = fresh.store.staged_bytes(fresh.store.layout.view_rows(0, 128))
    assert pool.warmed == pool.idle_bytes == size_class(want)
    req = _request("b", [*TOKENS, 1, 2])
    assert side2.get_num_new_matched_tokens(req, 0) == (128, True)
    side2.update_state_after_alloc(req, BLOCKS, 128)
    (load,) = side2.build_plan(_no_steps()).loads
    fresh._stage(load)
    assert (pool.taken, pool.reused, pool.idle_bytes) == (1, 1, 0)
    assert fresh.handlers["disk"].writer.close(30)


def test_a_disk_hit_leaves_the_state_of_links_above_the_deepest_to_be_read_later(tmp_path):
    """The worker stages a disk hit's chain with the deepest link whole and the others' views
    only: their sections (states the restore does not use) are read when first needed."""
    side, worker = _side(tmp_path), _worker()
    for cut in (64, 128):
        _, plan = _commit_link(side, worker, cut)
        worker.save(plan)
    assert worker.handlers["disk"].writer.close(30)
    side2 = _side(tmp_path)
    req = _request("b", [*TOKENS, 1, 2])
    assert side2.get_num_new_matched_tokens(req, 0) == (128, True)
    side2.update_state_after_alloc(req, BLOCKS, 128)
    (load,) = side2.build_plan(_no_steps()).loads
    assert len(load.chain) == 2 and load.draft is None
    fresh = _worker()
    fresh._start_handlers(SimpleNamespace(
        tier_ops={"disk": DiskOps(side2.cache.lower("disk").target)}))
    fresh._stage(load)
    first, deepest = (ref.link_id for ref in load.chain)
    assert fresh.store.sections_pending(first) and not fresh.store.sections_pending(deepest)
    secs = fresh.store.buffers(first).sections  # read now, from the file
    assert not fresh.store.sections_pending(first)
    assert all(bool((t == 1).all()) for t in secs.values())  # what the commit held
    assert fresh.handlers["disk"].writer.close(30)
