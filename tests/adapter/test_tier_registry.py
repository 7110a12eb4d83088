"""The lower-tier registry (adapter/tier_registry.py): the adapter drives tiers it never names.

Every registered tier resolves to an opener and a TierHandler; a name or path that would make
two tiers share a plan key, or an import path that is not one, is refused; and a tier the
adapter has never heard of (registered here, in the test) plugs in end to end: its opener is
called at start-up, the links RAM commits reach its policy, its operations ride the step's plan
under its name, a worker creates its handler from the registry and runs it after the captures
(reading the committed link's bytes from the worker's store), and the handler's report comes
back to the same policy. That path is what lets disk and cluster live outside the adapter
(tests/foundation/test_import_graph.py: no arrow up from the adapter to a tier).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.unit.test_disk_tier_adapter import _commit_link, _worker
from tests.unit.test_tiered_cache_adapter import _no_steps
from vllm_hybridcache.adapter import tier_registry
from vllm_hybridcache.core.tiers.handler import TierHandler
from vllm_hybridcache.core.tiers.lower import LowerTier

OPENED: list[Any] = []  # the FakeBehind objects open_fake made (the test reads them)


class FakeBehind(LowerTier):
    """A policy that copies every committed RAM tree link, once."""

    name = "fake"

    def __init__(self) -> None:
        self.pending: list[int] = []
        self.records: dict[int, Any] = {}
        self.reports: list[Any] = []
        self.failed_ids: list[int] = []

    def committed(self, addr, record) -> None:
        if record is not None:
            self.pending.append(addr.link_id)
            self.records[addr.link_id] = record

    def failed(self, addrs) -> None:
        self.failed_ids += [a.link_id for a in addrs]

    def take_ops(self):
        if not self.pending:
            return None
        ops, self.pending = self.pending, []
        return ops

    def absorb(self, report) -> None:
        self.reports.append(report)


class FakeHandler(TierHandler):
    """Reads each named link's bytes out of the worker's store and reports their sums."""

    def __init__(self, store, between_steps) -> None:
        super().__init__(store, between_steps)
        self.sums: dict[int, float] = {}
        self._sent = 0

    def after_captures(self, ops) -> None:
        for lid in ops:
            self.sums[lid] = float(self.store.payload(lid).double().sum())

    def report(self):
        if len(self.sums) == self._sent:
            return None
        self._sent = len(self.sums)
        return dict(self.sums)


def open_fake(ctx) -> FakeBehind | None:
    if "fake" in ctx.tiers_off:
        return None
    OPENED.append(FakeBehind())
    return OPENED[-1]


@pytest.fixture
def fake_tier():
    OPENED.clear()
    tier_registry.register_tier("fake", f"{__name__}:open_fake", f"{__name__}:FakeHandler")
    try:
        yield
    finally:
        del tier_registry._TIERS["fake"]
        OPENED.clear()


def _side():
    from tests.adapter.test_unkeyed_inputs import _kv_cache_config, _vllm_config
    from vllm_hybridcache.adapter.scheduler_side import SchedulerSide
    from vllm_hybridcache.config import CacheSettings

    settings = CacheSettings(grid=64, message_end_ids=(-1,), memory_floor_bytes=0)
    return SchedulerSide(_vllm_config(), _kv_cache_config(), settings)


def test_every_registered_tier_resolves_to_an_opener_and_a_handler():
    names = [e.name for e in tier_registry.registered()]
    assert names[:2] == ["disk", "cluster"] and len(set(names)) == len(names)
    for entry in tier_registry.registered():
        assert callable(tier_registry.resolve(entry.open)), entry
        cls = tier_registry.handler_class(entry.name)
        assert isinstance(cls, type) and issubclass(cls, TierHandler), entry


def test_a_name_registered_twice_or_a_path_that_is_not_one_is_refused():
    before = tier_registry.registered()
    with pytest.raises(ValueError, match="registered already"):
        tier_registry.register_tier("disk", "a.b:c", "a.b:D")
    with pytest.raises(ValueError, match="module:attribute"):
        tier_registry.register_tier("other", "a.b.c", "a.b:D")
    assert tier_registry.registered() == before
    with pytest.raises(KeyError):
        tier_registry.handler_class("never-registered")


def test_a_tier_the_adapter_never_names_plugs_in_end_to_end(fake_tier):
    side, worker = _side(), _worker()
    (behind,) = OPENED
    assert side.cache.lower("fake") is behind
    r, plan = _commit_link(side, worker, 128)
    assert plan.tier_ops == {"fake": [r.link_id]}  # its ops, under its name
    assert behind.records[r.link_id] is not None   # the RAM tree's record came with it
    expected = float(worker.store.payload(r.link_id).double().sum())
    assert expected > 0
    worker.save(plan)
    handler = worker.handlers["fake"]
    assert isinstance(handler, FakeHandler) and handler.sums == {r.link_id: expected}
    side.apply_report(worker.take_report())
    assert behind.reports == [{r.link_id: expected}]
    # nothing new committed: no ops, and the handler has nothing new to report
    assert side.build_plan(_no_steps()).tier_ops == {}
    assert handler.report() is None


def test_without_the_registration_the_same_commits_carry_no_ops():
    """Negative control for the test above: the same commits, the tier not registered."""
    side, worker = _side(), _worker()
    assert OPENED == [] and side.cache.lower("fake") is None
    _, plan = _commit_link(side, worker, 128)
    assert "fake" not in plan.tier_ops
    worker.save(plan)
    assert "fake" not in worker.handlers


def test_an_opener_that_names_its_tier_wrongly_stops_the_start_up(fake_tier, monkeypatch):
    monkeypatch.setattr(FakeBehind, "name", "disk")
    with pytest.raises(RuntimeError, match="returned a tier named 'disk'"):
        _side()
