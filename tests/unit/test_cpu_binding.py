"""A CPU worker running our KV connector is bound to cores as vLLM binds one without a connector
(compat.reserve_cpus_as_without_connector): vLLM 0.32 reserves a core more for any connector,
for NIXL's transfer thread, which on a small host leaves the worker's OpenMP threads sharing
every core with the busy-polling engine-core process. Built on vLLM's own OMPProcessManager
with stand-in configs; no engine."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_hybridcache import compat
from vllm_hybridcache.registrations import CONNECTOR_NAME


@pytest.fixture(autouse=True)
def cpu_platform(monkeypatch):
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        # OMPProcessManager returns at once off the CPU platform: there is no binding to check
        pytest.skip("vLLM binds workers to cores on its CPU platform only")
    monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU", raising=False)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "auto")


@pytest.fixture
def manager_class(monkeypatch):
    """vLLM's class with the bend installed for the test only (the original restored)."""
    from vllm.utils.ompmultiprocessing import OMPProcessManager

    original = getattr(OMPProcessManager.__init__, "_hybridcache_original",
                       OMPProcessManager.__init__)
    monkeypatch.setattr(OMPProcessManager, "__init__", original)  # put back after the test
    assert compat.reserve_cpus_as_without_connector(frozenset({CONNECTOR_NAME}))
    assert not compat.reserve_cpus_as_without_connector(frozenset({CONNECTOR_NAME}))
    return OMPProcessManager, original


def _config(connector: str | None):
    parallel = SimpleNamespace(local_world_size=1, data_parallel_rank_local=None,
                               _api_process_count=1, assigned_physical_gpu_ids=None)
    kv = None if connector is None else SimpleNamespace(kv_connector=connector)
    return SimpleNamespace(parallel_config=parallel, kv_transfer_config=kv)


def test_our_connector_reserves_what_no_connector_does(manager_class):
    cls, _ = manager_class
    none = cls(_config(None))
    ours = cls(_config(CONNECTOR_NAME))
    assert ours.reserve_cpu_num == none.reserve_cpu_num == 1
    assert ours.cpu_lists == none.cpu_lists and ours.reserved_cpu_list == none.reserved_cpu_list
    # another connector keeps vLLM's extra core (NIXL's transfer thread)
    assert cls(_config("NixlConnector")).reserve_cpu_num == 2


def test_negative_control_vllm_alone_reserves_a_core_more_for_ours(manager_class):
    _, original = manager_class
    from vllm.utils.ompmultiprocessing import OMPProcessManager

    plain = object.__new__(OMPProcessManager)
    original(plain, _config(CONNECTOR_NAME))
    assert plain.reserve_cpu_num == 2


def test_the_users_reservation_still_wins(manager_class, monkeypatch):
    cls, _ = manager_class
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    assert cls(_config(CONNECTOR_NAME)).reserve_cpu_num == 0


def test_the_stand_in_config_hides_only_the_connector():
    from vllm_hybridcache.compat.engine import _WithoutConnector

    cfg = _config(CONNECTOR_NAME)
    seen = _WithoutConnector(cfg)
    assert seen.kv_transfer_config is None and seen.parallel_config is cfg.parallel_config
    with pytest.raises(AttributeError):
        seen.not_a_field  # noqa: B018
