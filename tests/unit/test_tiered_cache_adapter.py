"""The adapter over the tiered cache (issue 12): one state object per request, loads and
captures addressed by (tier, kind), the worker naming lost links (7a), the scoped clear
through an engine utility (7c) and Prometheus counters across an engine restart (7d).

Driven on the real scheduler side and worker side with vLLM's own `Request` objects and a
KV-cache config of one GDN-like group and one attention group; no model, no engine.
"""

from __future__ import annotations

import asyncio
import json
import logging
from types import SimpleNamespace

import pytest

from tests.adapter.test_unkeyed_inputs import TOKENS, _kv_cache_config, _request, _vllm_config
from vllm_hybridcache.config import CacheSettings
from vllm_hybridcache.core import LinkAddr, LinkRef

BLOCKS = SimpleNamespace(get_block_ids=lambda: ([0], [1, 2]))


def _side(**settings):
    from vllm_hybridcache.adapter.scheduler_side import SchedulerSide

    settings.setdefault("grid", 64)
    side = SchedulerSide(_vllm_config(), _kv_cache_config(),
                         CacheSettings(message_end_ids=(-1,), memory_floor_bytes=0, **settings))
    assert side.active
    return side


def _report(**kw):
    from vllm_hybridcache.adapter.plans import StepReport

    return StepReport(**kw)


def _no_steps():
    return SimpleNamespace(scheduled_new_reqs=[], num_scheduled_tokens={},
                           scheduled_cached_reqs=SimpleNamespace(
                               req_ids=[], new_block_ids=[], resumed_req_ids=set(),
                               num_computed_tokens=[]))


def _finish(side, req_id: str, tokens: list[int]) -> LinkAddr:
    """Finish a request that forwarded `tokens`; commit the end anchor it leaves."""
    from vllm.v1.request import RequestStatus

    req = _request(req_id, tokens)
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    req.num_computed_tokens = len(tokens)
    assert side.request_finished(req, ([0], [1, 2])) is True
    plan = side.build_plan(_no_steps())
    (job,) = plan.captures
    assert job.finishing and job.addr.kind == "anchor" and job.addr.tier == "ram"
    side.apply_report(_report(saved={job.addr: 0.0}, saved_count={job.addr: 1}))
    return job.addr


def test_one_entry_per_request_and_an_anchor_load_names_its_tier_and_kind():
    side = _side()
    addr = _finish(side, "a", TOKENS)
    req = _request("b", [*TOKENS, 1, 2, 3])
    assert side.get_num_new_matched_tokens(req, 0) == (len(TOKENS), True)
    assert list(side._live) == ["b"]
    entry = side._live["b"]
    assert entry.lookup is not None and entry.lookup.kind == "anchor"
    side.update_state_after_alloc(req, BLOCKS, len(TOKENS))
    assert entry.lookup is None and entry.restoring is not None
    assert entry.canonical is False  # session-exact: publishes nothing into the tree
    (load,) = side.build_plan(_no_steps()).loads
    assert (load.tier, load.kind, load.fail) == ("ram", "anchor", None)
    assert load.chain == (LinkRef(addr.link_id, 0, len(TOKENS)),)
    side.apply_report(_report(loaded={"b": 0.01}))
    assert entry.restoring is None
    assert side.anchors.stats().tokens_served == len(TOKENS)
    side.cache.sanity_check()


def test_a_request_finished_during_its_restore_keeps_its_entry_until_the_report():
    """The pins of a restore in flight are released by the report, even when vLLM finished
    (aborted) the request in between; the entry goes then, not before."""
    side = _side()
    _finish(side, "a", TOKENS)
    req = _request("b", [*TOKENS, 1, 2, 3])
    side.get_num_new_matched_tokens(req, 0)
    side.update_state_after_alloc(req, BLOCKS, len(TOKENS))
    side.build_plan(_no_steps())
    side.request_finished(req)  # aborted while loading
    assert "b" in side._live and side._live["b"].finished
    assert side.anchors.stats().links_pinned == 1
    side.apply_report(_report(loaded={"b": 0.01}))
    assert "b" not in side._live
    assert side.anchors.stats().links_pinned == 0
    side.cache.sanity_check()


def test_failed_anchor_restore_goes_cold_and_drops_the_anchor():
    side = _side()
    addr = _finish(side, "a", TOKENS)
    req = _request("b", [*TOKENS, 1, 2, 3])
    side.get_num_new_matched_tokens(req, 0)
    side.update_state_after_alloc(req, BLOCKS, len(TOKENS))
    side.build_plan(_no_steps())
    side.apply_report(_report(failed_loads={"b"}))
    entry = side._live["b"]
    assert entry.cold_only and entry.resume_at == 0 and entry.restoring is None
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)  # never retried
    assert side.build_plan(_no_steps()).drops == [addr]
    assert side.anchors.stats().restores_failed == 1


def test_lost_links_are_invalidated_in_their_own_tier():
    side = _side()
    addr = _finish(side, "a", TOKENS)
    side.apply_report(_report(lost_links={addr}))
    assert len(side.anchors) == 0
    assert side.build_plan(_no_steps()).drops == [addr]


def test_chain_changed_before_allocation_plans_a_failing_load():
    side = _side()
    _finish(side, "a", TOKENS)
    req = _request("b", [*TOKENS, 1])
    side.get_num_new_matched_tokens(req, 0)
    side.clear()
    side.update_state_after_alloc(req, BLOCKS, len(TOKENS))
    (load,) = side.build_plan(_no_steps()).loads
    assert load.fail and load.chain == ()
    assert side._live["b"].cold_only
    assert side.anchors.stats().misses == {"evicted": 1}


# ------------------------------------------------------------------ 7a: the worker side
def _worker():
    from vllm_hybridcache.adapter.worker_side import WorkerSide

    return WorkerSide(SimpleNamespace(), _kv_cache_config())


def test_worker_reports_a_row_mismatch_as_a_lost_link(caplog):
    """Defect 7a: MissingLinkError carried a string on a row mismatch, and the worker only
    reported errors carrying an int: the bad link was offered again and again."""
    from vllm_hybridcache.adapter.plans import LoadJob, StepPlan

    worker = _worker()
    worker.store.allocate(7, 1)  # the plan below wants view_rows(0, 64) rows
    worker.store.seal(7)
    job = LoadJob(req_id="r", tier="ram", kind="tree", chain=(LinkRef(7, 0, 64),),
                  block_ids=[[0], [1, 2, 3, 4]])
    with caplog.at_level(logging.WARNING, logger="vllm_hybridcache"):
        worker.start_load(StepPlan(loads=[job]))
    report = worker.take_report()
    assert report.failed_loads == {"r"}
    assert report.lost_links == {LinkAddr("ram", "tree", 7)}


def test_worker_logs_copy_failures_with_a_traceback(caplog):
    """Defect 7e: copy failures were logged without the traceback that says where."""
    from vllm_hybridcache.adapter.plans import CaptureJob, StepPlan

    worker = _worker()  # no KV caches registered: the copy itself fails
    job = CaptureJob(addr=LinkAddr("ram", "tree", 3), req_id="r", row_start=0, row_end=64,
                     block_ids=[[0], [1, 2, 3, 4]])
    worker._sections["gdn.0"] = (0, None)  # a section whose source cannot be indexed
    with caplog.at_level(logging.WARNING, logger="vllm_hybridcache"):
        worker.save(StepPlan(captures=[job]))
    assert worker.take_report().failed_saves == {job.addr}
    rec = next(r for r in caplog.records if "capture of link 3 failed" in r.getMessage())
    assert rec.exc_info is not None


# ------------------------------------------------------------------ 7c: scoped clear
class _FakeCore:
    """The engine client's side of a utility call, running the utility in this process as
    vLLM runs it in the engine process (the EngineCore method of that name)."""

    def __init__(self, connectors) -> None:
        self.connectors = connectors

    async def call_utility_all_async(self, name: str, request: dict):
        from vllm.v1.engine.core import EngineCoreProc

        method = getattr(EngineCoreProc, name)  # the engine process's class
        cores = [SimpleNamespace(scheduler=SimpleNamespace(get_kv_connector=lambda c=c: c))
                 for c in self.connectors]
        return [method(core, request) for core in cores]


def _connector(side):
    from vllm_hybridcache.adapter.connector import HybridSnapshotConnector

    conn = object.__new__(HybridSnapshotConnector)
    conn._sched = side
    return conn


@pytest.fixture
def clear_utility(monkeypatch):
    """expose_connector_utility as the connector calls it, undone after the test."""
    from vllm.v1.engine.core import EngineCore, EngineCoreProc

    from vllm_hybridcache.adapter.connector import CLEAR_UTILITY, clear_utility
    from vllm_hybridcache.compat import expose_connector_utility

    monkeypatch.setattr(EngineCore, CLEAR_UTILITY, None, raising=False)
    expose_connector_utility(CLEAR_UTILITY, clear_utility)
    bound = getattr(EngineCoreProc, CLEAR_UTILITY).__get__(object())
    # vLLM checks utility arguments against the method's signature (one plain dict here)
    assert EngineCoreProc._convert_msgspec_args(bound, ({"tier": "all"},)) == ({"tier": "all"},)
    return CLEAR_UTILITY


def _clear(side, **params):
    from vllm_hybridcache.serving.http import clear

    client = SimpleNamespace(engine_core=_FakeCore([_connector(side)]))
    params = {"tier": "all", "kind": "all", **params}
    resp = asyncio.run(clear(client, params["tier"], params["kind"]))
    return resp.status_code, json.loads(resp.body)


def _side_with_both_kinds():
    from tests.adapter.test_unkeyed_inputs import _commit_cuts

    side = _side()
    assert _commit_cuts(side, _request("t", TOKENS), TOKENS) == 1
    _finish(side, "a", [*TOKENS, 9, 9])
    assert len(side.tree) == 1 and len(side.anchors) == 1
    return side


def test_clear_reaches_the_engine_with_its_tier_and_kind(clear_utility):
    side = _side_with_both_kinds()
    status, body = _clear(side, kind="anchor")
    assert status == 200 and body["links"] == 1 and body["tiers"] == ["ram"]
    assert len(side.tree) == 1 and len(side.anchors) == 0
    status, body = _clear(side, tier="ram")
    assert status == 200 and body["links"] == 1 and len(side.tree) == 0


def test_clear_of_a_tier_the_engine_lacks_is_a_400_and_clears_nothing(clear_utility):
    side = _side_with_both_kinds()
    status, body = _clear(side, tier="disk")
    assert status == 400 and "unknown tier 'disk'" in body["error"]
    assert body["tiers"] == ["ram"]
    status, body = _clear(side, kind="session")
    assert status == 400 and "unknown kind" in body["error"]
    assert len(side.tree) == 1 and len(side.anchors) == 1


def test_clear_without_a_utility_path_is_a_501():
    from vllm_hybridcache.serving.http import clear

    resp = asyncio.run(clear(SimpleNamespace(engine_core=object()), "all", "all"))
    assert resp.status_code == 501


# ------------------------------------------------------------------ 7d: engine restarts
@pytest.fixture
def prom():
    from tests.prom_registry import private_prom

    return private_prom()


def _payload(epoch: str, seq: int, hits: int, anchor_hits: int = 0):
    from vllm_hybridcache.adapter.stats import encode
    from vllm_hybridcache.core import CacheStats

    return encode({("ram", "tree"): CacheStats(hits=hits, links=hits),
                   ("ram", "anchor"): CacheStats(hits=anchor_hits)}, seq, epoch)


def _hits(reg, kind: str = "tree") -> float:
    v = reg.get_sample_value("vllm:hybridcache_hits_total",
                             {"engine": "0", "tier": "ram", "kind": kind})
    return v or 0.0


def test_counters_keep_counting_after_an_engine_restart(prom):
    """Defect 7d: a restarted engine core numbers its snapshots from 1 again, and the observer
    dropped every one of them as older than the last seq it had seen."""
    p, reg = prom
    p.observe(_payload("first", 1, 3))
    p.observe(_payload("first", 40, 10, anchor_hits=2))
    p.observe(_payload("first", 39, 99))  # a late snapshot of the same instance: dropped
    assert _hits(reg) == 10 and _hits(reg, "anchor") == 2
    p.observe(_payload("second", 1, 4))  # restarted: counters start over
    assert _hits(reg) == 14 and _hits(reg, "anchor") == 2
    p.observe(_payload("second", 2, 6, anchor_hits=1))
    assert _hits(reg) == 16 and _hits(reg, "anchor") == 3
    gauge = reg.get_sample_value("vllm:hybridcache_links",
                                 {"engine": "0", "tier": "ram", "kind": "tree"})
    assert gauge == 6


def test_every_series_has_tier_and_kind_labels(prom):
    _, reg = prom
    names = {(s.name, tuple(sorted(s.labels))) for m in reg.collect() for s in m.samples}
    assert ("vllm:hybridcache_misses_total", ("engine", "kind", "reason", "tier")) in names
    assert all({"tier", "kind"} <= set(lab) for n, lab in names if "hybridcache" in n)
    kinds = {s.labels["kind"] for m in reg.collect() for s in m.samples}
    assert kinds == {"tree", "anchor"}


def test_stats_json_has_tier_totals_and_kinds():
    from vllm_hybridcache.serving.http import aggregate

    out = aggregate({0: _payload("e", 1, 3, anchor_hits=2), 1: _payload("f", 1, 1)})
    ram = out["tiers"]["ram"]
    assert out["engines"] == 2 and set(out["tiers"]) == {"ram"}
    assert ram["hits"] == 6 and ram["kinds"]["tree"]["hits"] == 4
    assert ram["kinds"]["anchor"]["hits"] == 2
    assert ram["hit_depth"]["count"] == 0


def test_snapshot_aggregation_prefers_a_new_epoch():
    from vllm_hybridcache.adapter.stats import HybridCacheStats

    old = HybridCacheStats(data=_payload("first", 50, 9))
    new = HybridCacheStats(data=_payload("second", 1, 1))
    assert old.aggregate(new).data["epoch"] == "second"
    assert new.aggregate(HybridCacheStats(data=_payload("second", 2, 2))).data["seq"] == 2
    assert HybridCacheStats(data=_payload("second", 3, 2)).aggregate(new).data["seq"] == 3
    assert old.reduce()["hybridcache hits"] == 9


def test_tensor_free_plans_pickle():
    import pickle

    from vllm_hybridcache.adapter.plans import CaptureJob, LoadJob, StepPlan, StepReport

    plan = StepPlan(loads=[LoadJob("r", "ram", "tree", (LinkRef(1, 0, 64),), [[0]])],
                    captures=[CaptureJob(LinkAddr("ram", "anchor", 2), "r", 0, 64, [[0]])],
                    drops=[LinkAddr("ram", "tree", 3)])
    again = pickle.loads(pickle.dumps(plan))
    assert again.loads[0].chain == plan.loads[0].chain and again.drops == plan.drops
    rep = StepReport(saved={LinkAddr("ram", "tree", 1): 0.1}).aggregate(
        StepReport(saved={LinkAddr("ram", "tree", 1): 0.2}))
    assert rep.saved_count == {LinkAddr("ram", "tree", 1): 2}


# ------------------------------------------------------------------ issue 33: hit choices
def _choice_payload(seq: int, tree: dict[str, int], anchor: dict[str, int]):
    from vllm_hybridcache.adapter.stats import encode
    from vllm_hybridcache.core import CacheStats

    return encode({("ram", "tree"): CacheStats(hits=sum(tree.values()), choices=tree),
                   ("ram", "anchor"): CacheStats(hits=sum(anchor.values()), choices=anchor)},
                  seq, "e")


def _choices(reg, kind: str, reason: str) -> float | None:
    return reg.get_sample_value("vllm:hybridcache_hit_choices_total",
                                {"engine": "0", "tier": "ram", "kind": kind, "reason": reason})


def test_hit_choices_are_counted_by_reason_under_the_chosen_route(prom):
    p, reg = prom
    # every reason is exported as a zero before any snapshot arrives
    assert _choices(reg, "tree", "cold_exact") == 0.0
    assert _choices(reg, "anchor", "deepest") == 0.0
    p.observe(_choice_payload(1, {"cheaper": 2}, {"deepest": 1}))
    p.observe(_choice_payload(2, {"cheaper": 5, "cold_exact": 1}, {"deepest": 1}))
    assert _choices(reg, "tree", "cheaper") == 5.0
    assert _choices(reg, "tree", "cold_exact") == 1.0
    assert _choices(reg, "anchor", "deepest") == 1.0
    assert _choices(reg, "anchor", "cheaper") == 0.0    # negative control: nothing leaks


def test_stats_json_sums_hit_choices():
    from vllm_hybridcache.serving.http import aggregate

    out = aggregate({0: _choice_payload(1, {"cheaper": 2}, {"deepest": 1}),
                     1: _choice_payload(1, {"cheaper": 1, "only": 3}, {})})
    ram = out["tiers"]["ram"]
    assert ram["kinds"]["tree"]["choices"] == {"cheaper": 3, "only": 3}
    assert ram["kinds"]["anchor"]["choices"] == {"deepest": 1}
    assert ram["choices"] == {"cheaper": 3, "only": 3, "deepest": 1}
