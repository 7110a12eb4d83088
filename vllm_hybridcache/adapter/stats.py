"""Cache stats on their way to Prometheus and /v1/cache/stats.

The scheduler side sends the tree's cumulative `CacheStats` snapshot as connector stats every
step; vLLM carries it to the API-server process (process 0), where `HybridCacheProm.observe`
turns counter growth into Prometheus increments, sets the gauges, and keeps the latest snapshot
per engine for the HTTP route. Sending cumulative snapshots (not deltas) makes a lost or merged
message harmless: the next one carries the whole truth.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import msgspec

from vllm_hybridcache.core import CacheStats, MissReason, SkipReason

TIER = "ram"
SESSION_TIER = "session"  # end anchors (live continuation)

_latest_lock = threading.Lock()
_latest: dict[int, dict[str, Any]] = {}


def latest_snapshots() -> dict[int, dict[str, Any]]:
    """The newest stats of every engine seen by this (API-server) process."""
    with _latest_lock:
        return {k: dict(v) for k, v in _latest.items()}


def _remember(engine_idx: int, data: dict[str, Any]) -> None:
    with _latest_lock:
        _latest[engine_idx] = data


def encode(stats: CacheStats, seq: int, session: CacheStats | None = None) -> dict[str, Any]:
    tiers = {TIER: msgspec.to_builtins(stats)}
    if session is not None:
        tiers[SESSION_TIER] = msgspec.to_builtins(session)
    return {"seq": seq, "tiers": tiers}


from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (  # noqa: E402
    KVConnectorPromMetrics,
    KVConnectorStats,
)


@dataclass
class HybridCacheStats(KVConnectorStats):
    """Connector stats payload: {"seq": n, "tiers": {tier: CacheStats as builtins}}."""

    data: dict[str, Any] = field(default_factory=dict)

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> HybridCacheStats:
        # Cumulative snapshots: the newer one carries everything.
        if not self.data or other.data.get("seq", -1) >= self.data.get("seq", -1):
            return HybridCacheStats(data=dict(other.data))
        return self

    def reduce(self) -> dict[str, int | float]:
        ram = self.data.get("tiers", {}).get(TIER, {})
        return {
            "hybridcache hits": ram.get("hits", 0),
            "hybridcache lookups": ram.get("lookups", 0),
            "hybridcache tokens served": ram.get("tokens_served", 0),
            "hybridcache links": ram.get("links", 0),
            "hybridcache MiB": round(ram.get("bytes_held", 0) / 2**20, 1),
        }

    def is_empty(self) -> bool:
        return not self.data


# name -> (help, source field); counters grow, gauges are set
COUNTERS: dict[str, tuple[str, str]] = {
    "vllm:hybridcache_lookups": ("Snapshot-cache lookups, by tier.", "lookups"),
    "vllm:hybridcache_hits": ("Snapshot-cache lookups that found an exact link, by tier.", "hits"),
    "vllm:hybridcache_prompt_tokens": ("Prompt tokens of requests looked up in the snapshot "
                                       "cache.", "prompt_tokens"),
    "vllm:hybridcache_cached_tokens": ("Prompt tokens served from the snapshot cache (restored "
                                       "instead of prefilled), by tier.", "tokens_served"),
    "vllm:hybridcache_restore_failures": ("Restores that failed and fell back to a cold "
                                          "prefill.", "restores_failed"),
    "vllm:hybridcache_captures": ("Links captured and committed, by tier.", "captures"),
    "vllm:hybridcache_capture_bytes": ("Bytes copied into the snapshot cache.", "capture_bytes"),
    "vllm:hybridcache_restore_bytes": ("Bytes restored from the snapshot cache.",
                                       "restore_bytes"),
    "vllm:hybridcache_evictions": ("Links evicted to stay within the budget, by tier.",
                                   "evictions"),
    "vllm:hybridcache_aborts": ("Reserved links dropped because their step or copy failed.",
                                "aborts"),
    "vllm:hybridcache_shortened_lookups": ("Lookups served from a shallower link than the "
                                           "deepest match, because the deeper link's state "
                                           "depends on a token after its cut (MTP draft head).",
                                           "shortened"),
}
GAUGES: dict[str, tuple[str, str]] = {
    "vllm:hybridcache_links": ("Links held in the snapshot cache, by tier.", "links"),
    "vllm:hybridcache_bytes": ("Bytes held by the snapshot cache, by tier.", "bytes_held"),
    "vllm:hybridcache_budget_bytes": ("Byte budget of the snapshot cache, by tier.",
                                      "budget_bytes"),
}
MISSES = ("vllm:hybridcache_misses", "Snapshot-cache misses by reason (no_prefix, evicted, "
          "verify_failed, domain_mismatch, disabled, unkeyed_input).")
SKIPS = ("vllm:hybridcache_capture_skips", "Captures skipped by reason (budget, memory_guard, "
         "too_large, parent_refused, disabled).")
HISTOGRAMS: dict[str, tuple[str, str]] = {
    "vllm:hybridcache_capture_seconds": ("Seconds to copy one link into the cache.",
                                         "capture_seconds"),
    "vllm:hybridcache_restore_seconds": ("Seconds to restore one chain of links.",
                                         "restore_seconds"),
}


class HybridCacheProm(KVConnectorPromMetrics):
    """Registers our metrics on vLLM's registry and updates them from stats snapshots."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._prev: dict[int, dict[str, Any]] = {}
        tl = [*labelnames, "tier"]
        self._counters = {n: self._counter_cls(name=n, documentation=h, labelnames=tl)
                          for n, (h, _) in COUNTERS.items()}
        self._gauges = {n: self._gauge_cls(name=n, documentation=h, labelnames=tl,
                                           multiprocess_mode="mostrecent")
                        for n, (h, _) in GAUGES.items()}
        rl = [*labelnames, "tier", "reason"]
        self._misses = self._counter_cls(name=MISSES[0], documentation=MISSES[1], labelnames=rl)
        self._skips = self._counter_cls(name=SKIPS[0], documentation=SKIPS[1], labelnames=rl)
        from vllm_hybridcache.core.stats import SECONDS_BOUNDS

        self._hists = {n: self._histogram_cls(name=n, documentation=h, labelnames=tl,
                                              buckets=list(SECONDS_BOUNDS))
                       for n, (h, _) in HISTOGRAMS.items()}
        for idx, values in per_engine_labelvalues.items():  # export zeros from the start
            for c in self._counters.values():
                c.labels(*values, TIER)
            for r in MissReason:
                self._misses.labels(*values, TIER, r.value)
            for r in SkipReason:
                self._skips.labels(*values, TIER, r.value)
            del idx

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        data = transfer_stats_data
        if "tiers" not in data:
            return
        prev_all = self._prev.get(engine_idx, {})
        if prev_all and data.get("seq", 0) <= prev_all.get("seq", -1):
            return
        values = self.per_engine_labelvalues[engine_idx]
        for tier, cur in data["tiers"].items():
            prev = prev_all.get("tiers", {}).get(tier, {})
            for name, (_, key) in COUNTERS.items():
                delta = cur.get(key, 0) - prev.get(key, 0)
                if delta > 0:
                    self._counters[name].labels(*values, tier).inc(delta)
            for name, (_, key) in GAUGES.items():
                self._gauges[name].labels(*values, tier).set(cur.get(key, 0))
            for metric, key in ((self._misses, "misses"), (self._skips, "skips")):
                for reason, n in cur.get(key, {}).items():
                    delta = n - prev.get(key, {}).get(reason, 0)
                    if delta > 0:
                        metric.labels(*values, tier, reason).inc(delta)
            for name, (_, key) in HISTOGRAMS.items():
                self._observe_hist(self._hists[name].labels(*values, tier), cur.get(key),
                                   prev.get(key))
        self._prev[engine_idx] = data
        _remember(engine_idx, data)

    @staticmethod
    def _observe_hist(metric, cur: dict | None, prev: dict | None) -> None:
        """Replay new observations bucket by bucket (each at its bucket's upper bound)."""
        if not cur:
            return
        bounds = cur["bounds"]
        old = prev["counts"] if prev else [0] * len(cur["counts"])
        for i, (n_new, n_old) in enumerate(zip(cur["counts"], old, strict=True)):
            value = bounds[i] if i < len(bounds) else bounds[-1] * 2
            for _ in range(max(0, n_new - n_old)):
                metric.observe(value)
