"""Cache stats on their way to Prometheus and /v1/cache/stats.

The scheduler side sends every tier's cumulative `CacheStats` snapshot as connector stats every
step; vLLM carries it to the API-server process (process 0), where `HybridCacheProm.observe`
turns counter growth into Prometheus increments, sets the gauges, and keeps the latest snapshot
per engine for the HTTP route. Sending cumulative snapshots (not deltas) makes a lost or merged
message harmless: the next one carries the whole truth.

Every series has two labels: `tier`, where the bytes live (`ram` or `disk`), and `kind`, what
kind of link it counts (`tree`: cold-exact prefill cuts; `anchor`: end-of-request states).
For `tier="disk"` captures are file writes (bytes, seconds), restores are reads of files into
RAM plus the restore (bytes, seconds), links and bytes are the files held, a file refused
while reading is a miss by its problem (`checksum`, `truncated`, `foreign`, ...), a write the
writer was too busy to take is a capture skip `queue_full` (see docs/disk-tier.md).

Payload: {"epoch": id of the connector instance, "seq": n, "tiers": {tier: {kind: stats}}}.
`seq` counts snapshots of one instance; an engine core that restarts builds a new connector,
whose counters and `seq` start over under a new `epoch`, and the observer counts its snapshots
as growth from zero instead of dropping them as old.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import msgspec

from vllm_hybridcache.core import (
    CacheStats,
    ChoiceReason,
    LinkKind,
    MissReason,
    SkipReason,
    Tier,
)

_latest_lock = threading.Lock()
_latest: dict[int, dict[str, Any]] = {}


def latest_snapshots() -> dict[int, dict[str, Any]]:
    """The newest stats of every engine seen by this (API-server) process."""
    with _latest_lock:
        return {k: dict(v) for k, v in _latest.items()}


def _remember(engine_idx: int, data: dict[str, Any]) -> None:
    with _latest_lock:
        _latest[engine_idx] = data


def encode(stats: dict[tuple[str, str], CacheStats], seq: int, epoch: str,
           segmentation: str | None = None) -> dict[str, Any]:
    """The connector-stats payload of one snapshot of every (tier, kind); `segmentation`: the
    engine's segmentation mode (`step` or `fine`, docs/split-invariance.md)."""
    tiers: dict[str, dict[str, Any]] = {}
    for (tier, kind), st in stats.items():
        tiers.setdefault(tier, {})[kind] = msgspec.to_builtins(st)
    out: dict[str, Any] = {"epoch": epoch, "seq": seq, "tiers": tiers}
    if segmentation is not None:
        out["segmentation"] = segmentation
    return out


def _series(data: dict[str, Any]):
    """(tier, kind, stats) of every series in a payload."""
    for tier, kinds in data.get("tiers", {}).items():
        for kind, st in kinds.items():
            yield tier, kind, st


def newer(cur: dict[str, Any], prev: dict[str, Any]) -> bool:
    """Whether payload `cur` supersedes `prev` (same instance and later, or another instance:
    a restarted engine, whose snapshots arrive after the old one's)."""
    if not prev:
        return True
    if cur.get("epoch") != prev.get("epoch"):
        return True
    return cur.get("seq", 0) > prev.get("seq", -1)


from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (  # noqa: E402
    KVConnectorPromMetrics,
    KVConnectorStats,
)


@dataclass
class HybridCacheStats(KVConnectorStats):
    """Connector stats payload: {"epoch", "seq", "tiers": {tier: {kind: CacheStats}}}."""

    data: dict[str, Any] = field(default_factory=dict)

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> HybridCacheStats:
        # Cumulative snapshots: the newer one carries everything.
        if not self.data or other.data.get("seq", -1) == self.data.get("seq", -1) or newer(
                other.data, self.data):
            return HybridCacheStats(data=dict(other.data))
        return self

    def reduce(self) -> dict[str, int | float]:
        tot: dict[str, int] = {}
        for _, _, st in _series(self.data):
            for key in ("hits", "lookups", "tokens_served", "links", "bytes_held"):
                tot[key] = tot.get(key, 0) + st.get(key, 0)
        return {
            "hybridcache hits": tot.get("hits", 0),
            "hybridcache lookups": tot.get("lookups", 0),
            "hybridcache tokens served": tot.get("tokens_served", 0),
            "hybridcache links": tot.get("links", 0),
            "hybridcache MiB": round(tot.get("bytes_held", 0) / 2**20, 1),
        }

    def is_empty(self) -> bool:
        return not self.data


# name -> (help, source field); counters grow, gauges are set. Every series carries `tier`
# (where the bytes live) and `kind` (tree: prefill-cut links; anchor: end-of-request states).
_BY = " By tier (where the bytes live) and kind (tree or anchor link)."
COUNTERS: dict[str, tuple[str, str]] = {
    "vllm:hybridcache_lookups": ("Snapshot-cache lookups, counted under the kind that answered "
                                 "(misses under tree)." + _BY, "lookups"),
    "vllm:hybridcache_hits": ("Snapshot-cache lookups that found an exact link." + _BY, "hits"),
    "vllm:hybridcache_prompt_tokens": ("Prompt tokens of requests looked up in the snapshot "
                                       "cache." + _BY, "prompt_tokens"),
    "vllm:hybridcache_cached_tokens": ("Prompt tokens served from the snapshot cache (restored "
                                       "instead of prefilled)." + _BY, "tokens_served"),
    "vllm:hybridcache_restore_failures": ("Restores that failed and fell back to a cold "
                                          "prefill." + _BY, "restores_failed"),
    "vllm:hybridcache_captures": ("Links captured and committed." + _BY, "captures"),
    "vllm:hybridcache_capture_bytes": ("Bytes copied into the snapshot cache." + _BY,
                                       "capture_bytes"),
    "vllm:hybridcache_restore_bytes": ("Bytes restored from the snapshot cache." + _BY,
                                       "restore_bytes"),
    "vllm:hybridcache_evictions": ("Links evicted to stay within the budget." + _BY,
                                   "evictions"),
    "vllm:hybridcache_aborts": ("Reserved links dropped because their step or copy failed."
                                + _BY, "aborts"),
    "vllm:hybridcache_shortened_lookups": ("Lookups served from a shallower link than the "
                                           "deepest match, because the deeper link's state "
                                           "depends on a token after its cut (MTP draft head)."
                                           + _BY, "shortened"),
    "vllm:hybridcache_expired": ("Links deleted for being unused longer than the TTL (disk "
                                 "tier)." + _BY, "expired"),
    "vllm:hybridcache_promoted": ("Links of a disk hit taken over by the RAM tree after the "
                                  "restore (counted under tier ram)." + _BY, "promoted"),
    "vllm:hybridcache_swept": ("Folders of other engine fingerprints and stale temporary "
                               "files deleted (disk tier)." + _BY, "swept"),
    "vllm:hybridcache_remote_fetches": ("Chains of links fetched from another replica, staged "
                                        "and verified (cluster tier)." + _BY, "fetches"),
    "vllm:hybridcache_remote_fetch_bytes": ("Payload bytes fetched from other replicas "
                                            "(cluster tier)." + _BY, "fetch_bytes"),
}
GAUGES: dict[str, tuple[str, str]] = {
    "vllm:hybridcache_links": ("Links held in the snapshot cache." + _BY, "links"),
    "vllm:hybridcache_bytes": ("Bytes held by the snapshot cache." + _BY, "bytes_held"),
    "vllm:hybridcache_budget_bytes": ("Byte budget of the snapshot cache." + _BY,
                                      "budget_bytes"),
}
MISSES = ("vllm:hybridcache_misses", "Snapshot-cache misses by reason (no_prefix, evicted, "
          "verify_failed, domain_mismatch (the same tenant holds it under another route, "
          "adapter or rank; another tenant's links are a no_prefix), disabled, unkeyed_input; "
          "disk files and cluster payloads refused: checksum, unauthenticated, truncated, "
          "foreign, not_a_link, format, mismatch, symlink, gone, io_error)." + _BY)
SKIPS = ("vllm:hybridcache_capture_skips", "Captures skipped by reason (budget, memory_guard, "
         "too_large, parent_refused, disabled; disk writes: queue_full, min_free, disk_full, "
         "io_error)." + _BY)
CHOICES = ("vllm:hybridcache_hit_choices", "Hits served, by why the cache chose that link among "
           "every tier's hit for the prompt (only: one tier hit; deepest: the cheapest is "
           "also the deepest; cheaper: a shallower or slower-tier hit was expected to reach "
           "the first token sooner; cold_exact: a cold-exact link within the margin of a "
           "cheaper end anchor; docs/cache-core.md), counted under the link's tier and kind."
           + _BY)
HISTOGRAMS: dict[str, tuple[str, str]] = {
    "vllm:hybridcache_capture_seconds": ("Seconds to copy one link into the cache." + _BY,
                                         "capture_seconds"),
    "vllm:hybridcache_restore_seconds": ("Seconds to restore one chain of links." + _BY,
                                         "restore_seconds"),
    "vllm:hybridcache_remote_fetch_seconds": ("Seconds from a remote fetch issued to its chain "
                                              "staged and verified (cluster tier)." + _BY,
                                              "fetch_seconds"),
    "vllm:hybridcache_remote_locate_seconds": ("Seconds the cluster directory took to answer a "
                                               "locate (cluster tier)." + _BY,
                                               "locate_seconds"),
}
# attention K/V in place (docs/how-it-works.md): which source served restored hits' rows and
# the bytes the shared blocks did not copy, by the tier and kind of the restoring link, from
# the payload's `in_place` ({tier: {kind: counts}})
IN_PLACE: dict[str, tuple[str, str]] = {
    "vllm:hybridcache_in_place_tokens": ("Tokens of restored hits whose attention K/V was "
                                         "shared in place from vLLM's block pool.",
                                         "tokens_in_place"),
    "vllm:hybridcache_copied_tokens": ("Tokens of restored hits whose attention K/V was "
                                       "copied from a link (with attention_in_place on).",
                                       "tokens_copied"),
    "vllm:hybridcache_in_place_bytes_saved": ("Attention K/V bytes restored hits did not copy "
                                              "because the blocks were shared in place.",
                                              "bytes_saved"),
}
# the plugin's own seconds (adapter/overhead.py), from the payload's `overhead`
OVERHEAD = ("vllm:hybridcache_overhead_seconds", "Seconds the plugin spent inside the "
            "engine's steps, by side (scheduler: the connector's hooks; worker: its copies in "
            "the model runner, the slowest rank's) and phase (lookup, alloc, plan, report, "
            "finish; restore, save).")
BUSY = ("vllm:hybridcache_busy_seconds", "Wall seconds the engine was busy with steps, from a "
        "step's plan to its report, overlapping steps once: the plugin's share of the step "
        "time is its overhead seconds over these plus its scheduler-side seconds.")
# the (tier, kind) series exported as zeros before any snapshot arrives
SERIES: tuple[tuple[str, str], ...] = tuple(
    (t.value, k.value) for t in Tier for k in LinkKind)


class HybridCacheProm(KVConnectorPromMetrics):
    """Registers our metrics on vLLM's registry and updates them from stats snapshots."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._prev: dict[int, dict[str, Any]] = {}  # engine -> last payload counted
        tl = [*labelnames, "tier", "kind"]
        self._counters = {n: self._counter_cls(name=n, documentation=h, labelnames=tl)
                          for n, (h, _) in COUNTERS.items()}
        self._gauges = {n: self._gauge_cls(name=n, documentation=h, labelnames=tl,
                                           multiprocess_mode="mostrecent")
                        for n, (h, _) in GAUGES.items()}
        rl = [*tl, "reason"]
        self._misses = self._counter_cls(name=MISSES[0], documentation=MISSES[1], labelnames=rl)
        self._skips = self._counter_cls(name=SKIPS[0], documentation=SKIPS[1], labelnames=rl)
        self._choices = self._counter_cls(name=CHOICES[0], documentation=CHOICES[1],
                                          labelnames=rl)
        from vllm_hybridcache.core.stats import SECONDS_BOUNDS

        self._hists = {n: self._histogram_cls(name=n, documentation=h, labelnames=tl,
                                              buckets=list(SECONDS_BOUNDS))
                       for n, (h, _) in HISTOGRAMS.items()}
        self._in_place = {n: self._counter_cls(name=n, documentation=h + _BY, labelnames=tl)
                          for n, (h, _) in IN_PLACE.items()}
        self._overhead = self._counter_cls(name=OVERHEAD[0], documentation=OVERHEAD[1],
                                           labelnames=[*labelnames, "side", "phase"])
        self._busy = self._counter_cls(name=BUSY[0], documentation=BUSY[1],
                                       labelnames=list(labelnames))
        for values in per_engine_labelvalues.values():  # export zeros from the start
            for tier, kind in SERIES:
                for c in self._counters.values():
                    c.labels(*values, tier, kind)
                for r in MissReason:
                    self._misses.labels(*values, tier, kind, r.value)
                for r in SkipReason:
                    self._skips.labels(*values, tier, kind, r.value)
                for r in ChoiceReason:
                    self._choices.labels(*values, tier, kind, r.value)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Count the growth since this engine's previous snapshot.

        A snapshot of an older `seq` of the same instance is dropped (already counted). One of
        another `epoch` comes from a restarted engine core: its counters started over, so all
        of it is growth (measured from zero), and the old instance's snapshots are done.
        """
        data = transfer_stats_data
        if "tiers" not in data:
            return
        prev_all = self._prev.get(engine_idx, {})
        if not newer(data, prev_all):
            return
        if prev_all.get("epoch") != data.get("epoch"):
            prev_all = {}  # a new connector instance: its counters count from zero
        values = self.per_engine_labelvalues[engine_idx]
        for tier, kind, cur in _series(data):
            prev = prev_all.get("tiers", {}).get(tier, {}).get(kind, {})
            for name, (_, key) in COUNTERS.items():
                delta = cur.get(key, 0) - prev.get(key, 0)
                if delta > 0:
                    self._counters[name].labels(*values, tier, kind).inc(delta)
            for name, (_, key) in GAUGES.items():
                self._gauges[name].labels(*values, tier, kind).set(cur.get(key, 0))
            for metric, key in ((self._misses, "misses"), (self._skips, "skips"),
                                (self._choices, "choices")):
                for reason, n in cur.get(key, {}).items():
                    delta = n - prev.get(key, {}).get(reason, 0)
                    if delta > 0:
                        metric.labels(*values, tier, kind, reason).inc(delta)
            for name, (_, key) in HISTOGRAMS.items():
                self._observe_hist(self._hists[name].labels(*values, tier, kind),
                                   cur.get(key), prev.get(key))
        prev_ip = prev_all.get("in_place") or {}
        for tier, kinds in (data.get("in_place") or {}).items():
            for kind, cur in kinds.items():
                prev = prev_ip.get(tier, {}).get(kind, {})
                for name, (_, key) in IN_PLACE.items():
                    delta = cur.get(key, 0) - prev.get(key, 0)
                    if delta > 0:
                        self._in_place[name].labels(*values, tier, kind).inc(delta)
        self._observe_overhead(values, data.get("overhead") or {},
                               prev_all.get("overhead") or {})
        self._prev[engine_idx] = data
        _remember(engine_idx, data)

    def _observe_overhead(self, values, cur: dict[str, Any], prev: dict[str, Any]) -> None:
        for side in ("scheduler", "worker"):
            old = prev.get(f"{side}_s", {})
            for phase, seconds in cur.get(f"{side}_s", {}).items():
                delta = seconds - old.get(phase, 0.0)
                if delta > 0:
                    self._overhead.labels(*values, side, phase).inc(delta)
        delta = cur.get("busy_s", 0.0) - prev.get("busy_s", 0.0)
        if delta > 0:
            self._busy.labels(*values).inc(delta)

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
