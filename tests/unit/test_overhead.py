"""The plugin's own seconds beside the engine's busy seconds (adapter/overhead.py), with an
injected clock; their export on /metrics; and, over vLLM's real scheduler without a model
(tests/harness/engine.py), that every phase a request goes through is counted."""

from __future__ import annotations

import pytest

from tests.harness.engine import HarnessEngine
from vllm_hybridcache.adapter.overhead import Overhead, Phase, share


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_each_hook_counts_under_its_phase():
    clock = Clock()
    o = Overhead(clock)
    with o.timed(Phase.LOOKUP):
        clock.now += 0.25
    with pytest.raises(RuntimeError), o.timed(Phase.PLAN):   # counted even when it raises
        clock.now += 0.5
        raise RuntimeError
    assert o.scheduler["lookup"] == 0.25 and o.scheduler["plan"] == 0.5
    assert o.scheduler["report"] == 0.0


def test_overlapping_steps_count_their_busy_time_once():
    """Async scheduling plans the next step before the previous one's report: the engine was
    busy from the first plan to the last report, not for the sum of both windows."""
    clock = Clock()
    o = Overhead(clock)
    o.step_planned()            # t = 0
    clock.now = 1.0
    o.step_planned()            # t = 1, one in flight already
    clock.now = 2.0
    o.step_reported()           # the first step's report
    clock.now = 3.0
    o.step_reported()           # t = 3: idle
    clock.now = 10.0            # idle time is not busy time
    o.step_planned()
    clock.now = 10.5
    o.step_reported()
    assert o.busy_s == pytest.approx(3.5) and o.steps == 3
    # negative control: summing each step's own window counts the overlap twice (2 + 2 + 0.5)
    assert o.busy_s != pytest.approx(4.5)
    o.step_reported()           # a report without a planned step changes nothing
    assert o.busy_s == pytest.approx(3.5)


def test_worker_seconds_and_the_share():
    o = Overhead(Clock())
    o.add_worker({"restore": 0.1, "save": 0.3})
    o.add_worker({"save": 0.1})
    o.busy_s = 9.0
    o.scheduler["plan"] = 1.0
    p = o.payload()
    assert p["worker_s"] == {"restore": 0.1, "save": pytest.approx(0.4)}
    assert share(p) == pytest.approx((1.0 + 0.5) / (9.0 + 1.0))
    o.add_worker({"copy": 0.5})     # a phase this side does not know: kept, in the share
    assert o.payload()["worker_s"]["copy"] == 0.5
    assert share(o.payload()) == pytest.approx((1.0 + 1.0) / (9.0 + 1.0))
    assert share(Overhead(Clock()).payload()) is None     # nothing busy yet: no share


def test_the_seconds_reach_prometheus_as_growth():
    from tests.prom_registry import private_prom
    from vllm_hybridcache.adapter.stats import encode

    prom, reg = private_prom()
    for seq, (plan, save, busy) in enumerate(((0.5, 0.2, 4.0), (0.75, 0.5, 6.0)), start=1):
        data = encode({}, seq, "e")
        data["overhead"] = {"scheduler_s": {"plan": plan}, "worker_s": {"save": save},
                            "busy_s": busy, "steps": seq}
        prom.observe(data)
    get = reg.get_sample_value
    assert get("vllm:hybridcache_overhead_seconds_total",
               {"engine": "0", "side": "scheduler", "phase": "plan"}) == 0.75
    assert get("vllm:hybridcache_overhead_seconds_total",
               {"engine": "0", "side": "worker", "phase": "save"}) == 0.5
    assert get("vllm:hybridcache_busy_seconds_total", {"engine": "0"}) == 6.0


def test_a_request_s_path_is_counted_in_every_phase_on_vllm_s_scheduler():
    prompt = [100 + (i * 7) % 3000 for i in range(200)]
    e = HarnessEngine()
    e.run(prompt)
    warm = e.run(prompt)                 # a hit: restore on the worker, alloc on the scheduler
    assert warm.cached > 0
    data = e.connector.get_kv_connector_stats().data
    o = data["overhead"]
    assert o["steps"] == e.steps
    assert o["busy_s"] > 0
    for phase in Phase:
        assert o["scheduler_s"][phase.value] > 0, phase
    assert o["worker_s"]["restore"] > 0 and o["worker_s"]["save"] > 0
    assert 0 < share(o) < 1


def test_the_stats_route_sums_the_engines_and_gives_the_share():
    from vllm_hybridcache.serving.http import aggregate

    def payload(plan: float, save: float, busy: float) -> dict:
        return {"epoch": "e", "seq": 1, "tiers": {},
                "overhead": {"scheduler_s": {"plan": plan}, "worker_s": {"save": save},
                             "busy_s": busy, "steps": 2}}

    out = aggregate({0: payload(1.0, 1.0, 8.0), 1: payload(1.0, 0.0, 10.0)})["overhead"]
    assert out["scheduler_s"] == {"plan": 2.0} and out["busy_s"] == 18.0
    assert out["steps"] == 4 and out["share"] == pytest.approx(3.0 / 20.0)
    assert "overhead" not in aggregate({0: {"epoch": "e", "seq": 1, "tiers": {}}})
