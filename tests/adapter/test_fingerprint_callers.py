"""An engine without a fingerprint runs without the tiers that outlive it, and says why once.

`FingerprintUnavailable` (adapter/fingerprint.py) reaches the two callers: the disk tier
(`adapter/disk_setup.open_disk`) and the cluster tier (`cluster.engine.open_cluster`). Each
logs one warning, leaves its tier off (`SchedulerSide.tiers_off`) and the engine serves on
from RAM; neither crashes the start-up nor falls back to a fingerprint by name. Real scheduler
side, no engine (tests/unit/test_disk_tier_adapter.py's harness).
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from tests.adapter.test_unkeyed_inputs import (
    TOKENS,
    _commit_cuts,
    _kv_cache_config,
    _request,
    _vllm_config,
)
from tests.keys import CLUSTER_SECRET_FILE
from vllm_hybridcache.config import CacheSettings


def _unfindable_config(tmp_path, monkeypatch):
    """A hub name that is in no cache this process can see."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    cfg = _vllm_config()
    cfg.model_config = SimpleNamespace(model="org/updated-under-an-old-name", revision=None,
                                       dtype="float32")
    return cfg


def _side(cfg, **settings):
    from vllm_hybridcache.adapter.scheduler_side import SchedulerSide

    return SchedulerSide(cfg, _kv_cache_config(), CacheSettings(
        grid=64, message_end_ids=(-1,), memory_floor_bytes=0, disk_min_free_bytes=0,
        disk_write_first_tokens=0, **settings))


def _warnings(caplog, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and text in r.getMessage()]


def test_no_fingerprint_means_no_disk_tier_and_one_warning(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="vllm_hybridcache")
    disk = tmp_path / "disk"
    side = _side(_unfindable_config(tmp_path, monkeypatch), disk_dir=str(disk))
    assert side.active and side.cache.lower("disk") is None
    assert ("disk", "tree") not in side.cache.routes()
    assert "org/updated-under-an-old-name" in side.tiers_off["disk"]
    (warning,) = _warnings(caplog, "disk tier off")
    assert "org/updated-under-an-old-name" in warning
    assert [p.name for p in disk.iterdir()] == []  # no fingerprint folder, no memo of a guess
    # the engine serves on from RAM
    assert _commit_cuts(side, _request("a", TOKENS), TOKENS) == 1
    assert side.get_num_new_matched_tokens(_request("b", [*TOKENS, 1]), 0) == (len(TOKENS),
                                                                               True)
    assert side.build_plan(SimpleNamespace(
        scheduled_new_reqs=[], num_scheduled_tokens={}, scheduled_cached_reqs=SimpleNamespace(
            req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[]))
    ).tier_ops == {}  # nothing for a disk writer


def test_negative_control_a_findable_checkpoint_keeps_the_disk_tier(tmp_path, caplog):
    """The same settings with the checkpoint where vLLM loads it: the disk tier is on (so the
    test above fails if the fingerprint falls back to a guess)."""
    caplog.set_level(logging.INFO, logger="vllm_hybridcache")
    side = _side(_vllm_config(), disk_dir=str(tmp_path / "disk"))
    assert side.cache.lower("disk") is not None and ("disk", "tree") in side.cache.routes()
    assert side.tiers_off == {} and _warnings(caplog, "disk tier off") == []


def test_no_fingerprint_means_no_cluster_tier_and_no_connection(tmp_path, monkeypatch,
                                                                 caplog):
    """The cluster tier never connects without a fingerprint: its directory is keyed by it."""
    from vllm_hybridcache.cluster import transport

    def refuse(self):
        raise AssertionError("connected without a fingerprint")

    monkeypatch.setattr(transport.RayTransport, "connect", refuse)
    caplog.set_level(logging.INFO, logger="vllm_hybridcache")
    side = _side(_unfindable_config(tmp_path, monkeypatch), cluster_address="127.0.0.1:1",
                 cluster_secret_file=str(CLUSTER_SECRET_FILE))
    assert side.active and side.cache.lower("cluster") is None
    assert [t for t, _ in side.cache.routes()] == ["ram", "ram"]
    assert "org/updated-under-an-old-name" in side.tiers_off["cluster"]
    (warning,) = _warnings(caplog, "cluster tier off")
    assert "org/updated-under-an-old-name" in warning
    # negative control: with a fingerprint the tier goes on to connect (refused here)
    with pytest.raises(RuntimeError, match="connected without a fingerprint"):
        _side(_vllm_config(), cluster_address="127.0.0.1:1",
              cluster_secret_file=str(CLUSTER_SECRET_FILE))
