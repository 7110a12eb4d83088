"""The cluster tier's transfer figures on their way out: `/v1/cache/stats` sums them across
engines (and the front across replicas) and Prometheus gets them as counters and histograms,
from the cumulative snapshots the connector sends (no engine, no Ray)."""

from __future__ import annotations

from tests.prom_registry import private_prom
from vllm_hybridcache.adapter.stats import encode
from vllm_hybridcache.core import CacheStats
from vllm_hybridcache.core.tiers.cluster import ClusterStats
from vllm_hybridcache.fleet.front import sum_stats
from vllm_hybridcache.serving.http import aggregate


def _cluster(fetches: int, nbytes: int, seconds: list[float]) -> ClusterStats:
    st = ClusterStats(fetches=fetches, fetch_bytes=nbytes, restores=fetches)
    for s in seconds:
        st.fetch_seconds.observe(s)
        st.locate_seconds.observe(s / 10)
    return st


def _payload(seq: int, st: ClusterStats) -> dict:
    return encode({("ram", "tree"): CacheStats(hits=1), ("cluster", "tree"): st}, seq, "e")


def test_fetch_figures_reach_prometheus_as_growth():
    prom, reg = private_prom()
    labels = {"engine": "0", "tier": "cluster", "kind": "tree"}
    prom.observe(_payload(1, _cluster(1, 1000, [0.004])))
    prom.observe(_payload(2, _cluster(3, 5000, [0.004, 0.02, 0.3])))
    assert reg.get_sample_value("vllm:hybridcache_remote_fetches_total", labels) == 3
    assert reg.get_sample_value("vllm:hybridcache_remote_fetch_bytes_total", labels) == 5000
    assert reg.get_sample_value("vllm:hybridcache_remote_fetch_seconds_count", labels) == 3
    assert reg.get_sample_value("vllm:hybridcache_remote_locate_seconds_count", labels) == 3
    ram = {**labels, "tier": "ram"}
    assert not reg.get_sample_value("vllm:hybridcache_remote_fetch_seconds_count", ram)


def test_fetch_figures_are_summed_per_server_and_across_replicas():
    one = aggregate({0: _payload(1, _cluster(2, 3000, [0.01, 0.03]))})
    two = aggregate({0: _payload(1, _cluster(1, 500, [0.02]))})
    c = one["tiers"]["cluster"]
    assert c["fetches"] == 2 and c["fetch_bytes"] == 3000
    assert c["fetch_seconds"]["sum"] == 0.04 and c["kinds"]["tree"]["fetch_seconds"]["count"] == 2
    both = sum_stats({"r0": one, "r1": two})["tiers"]["cluster"]
    assert both["fetches"] == 3 and both["fetch_bytes"] == 3500
    assert both["fetch_seconds"]["count"] == 3
    assert abs(both["fetch_seconds"]["sum"] - 0.06) < 1e-12
