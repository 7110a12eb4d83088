"""Test hooks stay out of production: a connector built as vLLM builds it has one empty
`instrumentation` slot per half and runs every path without it."""

from __future__ import annotations

from tests.harness.engine import HarnessEngine, cache_stats

PROMPT = [100 + (i * 7) % 3000 for i in range(150)]    # cuts at 64 and 128


def test_a_production_connector_has_no_instrumentation():
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    e = HarnessEngine()
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        conn = KVConnectorFactory.create_connector(config=e.vllm_config, role=role,
                                                   kv_cache_config=e.scheduler.kv_cache_config)
        side = conn._sched if role == KVConnectorRole.SCHEDULER else conn._worker
        assert side.instrumentation is None
        for gone in ("fault_injector", "probe_results", "totals", "probe_states",
                     "state_digests"):
            assert not hasattr(side, gone), gone


def test_the_engine_runs_without_instrumentation():
    """With the slots emptied, captures and restores still happen (nothing depends on the
    hooks) and no probe is planned."""
    e = HarnessEngine()
    e.connector._sched.instrumentation = None
    for w in e.workers:
        w.connector._worker.instrumentation = None
    first = e.run(PROMPT)
    again = e.run(PROMPT)
    assert first.state is None and again.state is None
    assert not any(plan.probes for plan in e.plans)
    assert again.cached == 128 and again.tokens == first.tokens
    assert cache_stats(e)["restores"] == 1
