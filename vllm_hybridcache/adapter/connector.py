"""`HybridSnapshotConnector`: the snapshot-tree prefix cache as a vLLM KV connector.

Load it with `vllm serve --plugin hybridcache MODEL`, or with stock flags:
`--kv-transfer-config '{"kv_connector":"HybridSnapshotConnector","kv_role":"kv_both",
"kv_connector_module_path":"vllm_hybridcache.adapter.connector",
"kv_load_failure_policy":"recompute"}' --no-enable-prefix-caching
--scheduler-cls vllm_hybridcache.adapter.scheduler.SegmentedScheduler`.

vLLM builds one instance per process and role; this class only routes each call to the
scheduler half (tree, planning) or the worker half (copies).
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

from vllm_hybridcache.compat import require_supported_vllm

# vLLM imports this module when a kv-transfer config names the connector: the cache is asked
# for, so an unsupported vLLM is refused here (as the settings loader does at construction),
# before anything of vLLM's that may have moved is imported.
require_supported_vllm()

from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource  # noqa: E402

from vllm_hybridcache.adapter.overhead import Phase  # noqa: E402
from vllm_hybridcache.adapter.plans import StepPlan, StepReport  # noqa: E402
from vllm_hybridcache.adapter.stats import (  # noqa: E402
    HybridCacheProm,
    HybridCacheStats,
    encode,
)
from vllm_hybridcache.config import CONNECTOR_NAME, load_settings  # noqa: E402, F401 (re-exported)

logger = logging.getLogger("vllm_hybridcache")

MODULE_PATH = "vllm_hybridcache.adapter.connector"
CLEAR_UTILITY = "hybridcache_clear"  # engine utility behind POST /v1/cache/clear
ALL = "all"


def clear_utility(connector: Any, request: dict) -> dict[str, Any]:
    """Engine side of `POST /v1/cache/clear`: clear one tier and/or kind of this engine's cache.

    request: {"tier": name or "all", "kind": name or "all"[, "cache_salt": salt]}; with a
    `cache_salt` (a str, "" for requests without one) only that tenant's links are dropped.
    Answers {"cleared": links, "tiers": the tiers this engine has} or, for a tier or kind it
    does not have, {"error": why, "tiers": ...}: the route turns that into a 400, never a
    silent no-op. The salt is never logged (it is the tenant's secret, docs/security.md).
    """
    if not isinstance(connector, HybridSnapshotConnector) or connector._sched is None:
        return {"error": "the hybridcache connector is not installed in this engine",
                "tiers": []}
    sched = connector._sched
    tier, kind = request.get("tier", ALL), request.get("kind", ALL)
    salt = request.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        return {"error": "cache_salt must be a string", "tiers": sched.tier_names()}
    try:
        n = sched.clear(None if tier == ALL else tier, None if kind == ALL else kind,
                        cache_salt=salt)
    except ValueError as e:
        return {"error": str(e), "tiers": sched.tier_names()}
    logger.info("hybridcache: cleared %d links (tier %s, kind %s%s)", n, tier, kind,
                "" if salt is None else ", one tenant")
    return {"cleared": n, "tiers": sched.tier_names()}


class HybridSnapshotConnector(KVConnectorBase_V1, SupportsHMA):
    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
        self.settings = load_settings(extra)
        self._sched = None
        self._worker = None
        # Stats snapshots are numbered per instance; the epoch tells an observer that a new
        # instance (a restarted engine core) started its counters and numbering over.
        self._seq = 0
        self._epoch = uuid.uuid4().hex
        if role == KVConnectorRole.SCHEDULER:
            from vllm_hybridcache.adapter.scheduler_side import SchedulerSide
            from vllm_hybridcache.compat import expose_connector_utility

            self._sched = SchedulerSide(vllm_config, kv_cache_config, self.settings)
            expose_connector_utility(CLEAR_UTILITY, clear_utility)
        else:
            from vllm_hybridcache.adapter.worker_side import WorkerSide

            self._worker = WorkerSide(vllm_config, kv_cache_config)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped capture is only a future miss

    # ======================= worker side =======================
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        if self._worker is not None:
            self._worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        # before the forward: inner captures of this step (fine segmentation) arm the hook
        if self._worker is not None and isinstance(connector_metadata, StepPlan):
            self._worker.begin_step()
            self._worker.arm_inner(connector_metadata)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if self._worker is not None and isinstance(meta, StepPlan) and meta.loads:
            self._worker.start_load(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        if self._worker is not None and isinstance(meta, StepPlan):
            self._worker.save(meta)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if self._worker is None:
            return KVConnectorTransferResults()
        done, failed = self._worker.take_finished_recving()
        return KVConnectorTransferResults(finished_sending=self._worker.take_finished_sending(),
                                          finished_recving=done, failed_recving=failed)

    def build_connector_worker_meta(self) -> StepReport | None:
        return self._worker.take_report() if self._worker is not None else None

    def shutdown(self) -> None:
        """vLLM's graceful shutdown of the worker: the disk tier's drain (session spill)."""
        if self._worker is not None:
            self._worker.shutdown()

    # ====================== scheduler side =====================
    # each hook's seconds are counted by phase (adapter/overhead.py)
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        with self._sched.overhead.timed(Phase.LOOKUP):
            return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        with self._sched.overhead.timed(Phase.ALLOC):
            self._sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        with self._sched.overhead.timed(Phase.PLAN):
            plan = self._sched.build_plan(scheduler_output)
        self._sched.overhead.step_planned()
        return plan

    def update_connector_output(self, connector_output) -> None:
        self._sched.overhead.step_reported()
        with self._sched.overhead.timed(Phase.REPORT):
            self._sched.apply_report(connector_output.kv_connector_worker_meta)

    def request_finished(self, request, block_ids):
        with self._sched.overhead.timed(Phase.FINISH):
            self._sched.request_finished(request)
        return False, None

    def request_finished_all_groups(self, request, block_ids):
        with self._sched.overhead.timed(Phase.FINISH):
            return self._sched.request_finished(request, block_ids), None

    def reset_cache(self) -> bool:
        if self._sched is not None:
            n = self._sched.clear()
            logger.info("hybridcache: cleared %d links", n)
        return True

    def get_kv_connector_stats(self) -> HybridCacheStats | None:
        if self._sched is None or not self._sched.active:
            return None
        self._seq += 1
        data = encode(self._sched.cache.stats(), self._seq, self._epoch,
                      self._sched.segmentation_mode)
        if self._sched.in_place_block:
            data["in_place"] = self._sched.in_place_payload()
        data["overhead"] = self._sched.overhead.payload()
        return HybridCacheStats(data=data)

    # =================== segmentation (for the scheduler hook) ===================
    @property
    def snapshot_cache_active(self) -> bool:
        return self._sched is not None and self._sched.active

    def cuts_for(self, request) -> list[int] | None:
        return self._sched.cuts_for(request) if self._sched is not None else None

    def waits_for_room(self, request) -> bool:
        return self._sched is not None and self._sched.waits_for_room(request)

    def in_place_side(self):
        """The scheduler side when attention K/V in place is asked for and possible (an
        active cache on the AR route), else None: the segmentation scheduler installs it."""
        sched = self._sched
        if (sched is None or not sched.active or not self.settings.attention_in_place
                or sched.speculative):
            return None
        return sched

    def sync_load_side(self):
        """The scheduler side when synchronous RAM loads are asked for and possible (an
        active cache on the AR route): the segmentation scheduler turns them on when it can
        withdraw a failed one (synchronous scheduling)."""
        sched = self._sched
        if (sched is None or not sched.active or not self.settings.sync_loads
                or sched.speculative):
            return None
        return sched

    # ========================= metrics =========================
    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> HybridCacheStats:
        return HybridCacheStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return HybridCacheProm(vllm_config, metric_types, labelnames, per_engine_labelvalues)
