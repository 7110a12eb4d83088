"""What crosses the process boundary each step: scheduler -> workers, and back.

Plain dataclasses of ints and lists (pickled by vLLM's IPC); no tensors, no tree objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from vllm_hybridcache.core import RestorePlan


@dataclass
class LoadJob:
    """Restore a chain of links into one request's state slot and KV blocks."""

    req_id: str
    plan: RestorePlan | None                   # chain root -> deepest; None = fail this load
    block_ids: list[list[int]]                 # per KV-cache group


@dataclass
class CaptureJob:
    """Copy one request's state at the end of this step into a reserved link.

    `finishing`: an end anchor of a finished request whose blocks vLLM keeps until the worker
    reports the copy done (delay_free), then frees.
    """

    link_id: int
    req_id: str
    row_start: int
    row_end: int
    block_ids: list[list[int]]
    finishing: bool = False


@dataclass
class StepPlan(KVConnectorMetadata):
    loads: list[LoadJob] = field(default_factory=list)
    captures: list[CaptureJob] = field(default_factory=list)
    drops: list[int] = field(default_factory=list)
    # (req_id, prompt tokens, block ids) of prefills that end this step, when an instrumented
    # engine asks for state probes (tests; see vllm_hybridcache/instrumentation.py)
    probes: list[tuple[str, int, list[list[int]]]] = field(default_factory=list)


@dataclass
class StepReport(KVConnectorWorkerMetadata):
    """Worker results of one step; aggregated over TP/PP workers.

    A capture counts as saved only if every worker saved its shard, so `saved` holds a count
    per link and `workers` the number of reports merged.
    """

    saved: dict[int, float] = field(default_factory=dict)      # link_id -> seconds (max)
    saved_count: dict[int, int] = field(default_factory=dict)
    failed_saves: set[int] = field(default_factory=set)
    loaded: dict[str, float] = field(default_factory=dict)     # req_id -> seconds (max)
    failed_loads: set[str] = field(default_factory=set)
    lost_links: set[int] = field(default_factory=set)          # payload missing on a worker
    workers: int = 1

    def aggregate(self, other: KVConnectorWorkerMetadata) -> StepReport:
        assert isinstance(other, StepReport)
        out = StepReport(workers=self.workers + other.workers)
        for src in (self, other):
            for k, v in src.saved.items():
                out.saved[k] = max(out.saved.get(k, 0.0), v)
                out.saved_count[k] = out.saved_count.get(k, 0) + src.saved_count.get(k, 1)
            for k, v in src.loaded.items():
                out.loaded[k] = max(out.loaded.get(k, 0.0), v)
            out.failed_saves |= src.failed_saves
            out.failed_loads |= src.failed_loads
            out.lost_links |= src.lost_links
        return out
