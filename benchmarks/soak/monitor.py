"""The time series: cache stats, vLLM's preemptions, the worker's injected-fault counts (failed
and corrupted restores) and the
server's resident memory, sampled every few seconds.

Counters start from zero in each life of the server (a kill -9 loses them), so the series
carries totals over lives: the last sample of every finished life plus the current one.
Resident memory is summed over the server's process tree (API server, engine core, workers;
pages shared between them are counted in each, which is fine for a trend).
"""

from __future__ import annotations

import threading
from typing import Any

import psutil
import requests

from benchmarks.soak.traffic import Context


def tree_rss(pid: int | None) -> int | None:
    if pid is None:
        return None
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return None
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            continue
    return total


def metric_sum(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def flatten(stats: dict[str, Any]) -> dict[str, float]:
    """Counters of /v1/cache/stats as flat names: `hits.ram.tree`, `misses.ram.tree.no_prefix`,
    `skips.ram.tree.budget`, `evictions.ram.tree`, `bytes_held.ram` (the tier, every kind),
    `bytes_held.ram.tree` and `budget_bytes.ram.tree` (one kind), ..."""
    out: dict[str, float] = {}
    for tier, entry in (stats.get("tiers") or {}).items():
        for kind, st in (entry.get("kinds") or {}).items():
            for name in ("lookups", "hits", "restores", "restores_failed", "captures",
                         "evictions", "aborts", "invalidated", "cleared", "promoted", "expired",
                         "swept"):
                if isinstance(st.get(name), int | float):
                    out[f"{name}.{tier}.{kind}"] = float(st[name])
            for gauge in ("bytes_held", "budget_bytes", "links"):
                if isinstance(st.get(gauge), int | float):
                    out[f"{gauge}.{tier}.{kind}"] = float(st[gauge])
            for group in ("misses", "skips"):
                for reason, n in (st.get(group) or {}).items():
                    out[f"{group}.{tier}.{kind}.{reason}"] = float(n)
        for gauge in ("bytes_held", "links"):
            if isinstance(entry.get(gauge), int | float):
                out[f"{gauge}.{tier}"] = float(entry[gauge])
    return out


GAUGES = ("bytes_held.", "budget_bytes.", "links.")


class Monitor:
    """Samples every `interval_s` in its own thread until stopped."""

    def __init__(self, ctx: Context, interval_s: float) -> None:
        self.ctx = ctx
        self.interval_s = interval_s
        self.samples: list[dict[str, Any]] = []
        self._base: dict[str, float] = {}      # counter totals of finished lives
        self._last: dict[str, float] = {}      # the current life's latest counters
        self._life = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="soak-monitor")
        self.http = ctx.session()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def _fetch(self) -> dict[str, float] | None:
        root = self.ctx.root
        try:
            stats = self.http.get(root + "/v1/cache/stats", timeout=10).json()
            metrics = self.http.get(root + "/metrics", timeout=10).text
            rpc = self.http.post(root + "/collective_rpc", timeout=10,
                                 json={"method": "hybridcache_fault_counts"}).json()
        except (requests.RequestException, ValueError):
            return None
        values = flatten(stats)
        values["preemptions"] = metric_sum(metrics, "vllm:num_preemptions_total")
        values["vllm_requests_aborted"] = sum(
            float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
            if line.startswith("vllm:request_success_total{")
            and 'finished_reason="abort"' in line)
        workers = [r for r in rpc.get("results", []) if isinstance(r, dict)]
        values["restore_faults_fired"] = float(sum(r.get("fired", 0) for r in workers))
        values["restore_corruptions"] = float(sum(r.get("corrupted", 0) for r in workers))
        # the in-place check's counters (testing/in_place_check.py: shared blocks vs stored rows)
        for k in sorted({k for r in workers for k in r if k.startswith("in_place_")}):
            values[k] = float(sum(r.get(k, 0) for r in workers))
        return values

    def sample(self) -> dict[str, Any] | None:
        ctx = self.ctx
        if not ctx.server.up.is_set():
            return None
        life = ctx.server.life
        values = self._fetch()
        if values is None or life != ctx.server.life:
            return None
        if life != self._life:                  # a new life: bank the old one's counters
            for k, v in self._last.items():
                if not k.startswith(GAUGES):
                    self._base[k] = self._base.get(k, 0.0) + v
            self._life, self._last = life, {}
        self._last = values
        totals = {k: v + (0.0 if k.startswith(GAUGES) else self._base.get(k, 0.0))
                  for k, v in values.items()}
        for k, v in self._base.items():
            totals.setdefault(k, v)
        sample = {"t": round(ctx.now(), 2), "life": life, "rss": tree_rss(ctx.server.pid),
                  **totals}
        self.samples.append(sample)
        return sample
