"""What crosses the process boundary each step: scheduler -> workers, and back.

Plain dataclasses of ints, strings and lists (pickled by vLLM's IPC); no tensors, no tree
objects. Every link is named by its address (tier, kind, link id): the worker executes in the
store of `tier`, and echoes the address in its report so the scheduler routes the commit or
abort to the tier that reserved it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from vllm_hybridcache.adapter.draft_rows import DraftRebuild
from vllm_hybridcache.core import LinkAddr, LinkRef
from vllm_hybridcache.core.linkformat.reader import SourceKey, SourceOrigin


@dataclass
class LoadJob:
    """Restore a chain of links of one tier into one request's state slot and KV blocks.

    `chain`: (link id, first token, end token) root -> deepest; the deepest link's sections and
    every link's view rows are restored. `fail`: set when the scheduler already knows the load
    cannot happen (the chain changed between lookup and allocation): the worker reports it
    failed, and vLLM, which already counts the tokens as loading, recomputes the request.
    """

    req_id: str
    tier: str
    kind: str
    chain: tuple[LinkRef, ...]
    block_ids: list[list[int]]                 # per KV-cache group
    fail: str | None = None
    # files to read into the store under the chain's ids before restoring (a disk or cluster
    # hit), one per chain link, and where they come from (fingerprint, key, folder); () and
    # None for RAM hits
    sources: tuple[str, ...] = ()
    origin: SourceOrigin | None = None
    # what each source must hold (kind, domain, digest), as the lookup found it: a file
    # renamed or swapped in between is refused by the worker
    expect: tuple[SourceKey, ...] = ()
    # MTP route: rebuild each link's boundary draft row for this prompt (adapter/draft_rows.py)
    draft: DraftRebuild | None = None
    # attention K/V in place: the first tokens vLLM's shared blocks already hold; the view
    # blocks below it are not written (other requests read them)
    in_place: int = 0
    # loaded in the step that runs the request (vLLM's synchronous load): not one of vLLM's
    # asynchronous receives, so neither finished nor failed there; a failure reaches the
    # scheduler in the report's `failed_loads` only
    sync: bool = False

    def addr(self, link_id: int) -> LinkAddr:
        return LinkAddr(self.tier, self.kind, link_id)


@dataclass
class CaptureJob:
    """Copy one request's state at the end of this step into a reserved link.

    `finishing`: an end anchor of a finished request whose blocks vLLM keeps until the worker
    reports the copy done (delay_free), then frees. `section_block`: which of the request's
    blocks in each section group holds the state to copy. Prefills read and write block 0;
    with speculative decoding a verify step writes the state after its j-th token to block j,
    so an end anchor copies the block of the last accepted token.
    """

    addr: LinkAddr
    req_id: str
    row_start: int
    row_end: int
    block_ids: list[list[int]]
    finishing: bool = False
    section_block: int = 0
    # fine segmentation: > 0 captures the state `inner_offset` tokens after the step's start,
    # inside the step (the model hands it to the worker's inner-capture hook); 0: the state at
    # the end of the step, from the state block
    inner_offset: int = 0
    # MTP route: the first position of the prefill step that ends at row_end; the link keeps
    # the draft head's boundary input of that step (adapter/draft_rows.py). -1: none. For an
    # end anchor (`finishing`): the request's last verify step, from draft_step, draft_len
    # tokens long, whose first draft pass wrote the anchor's boundary row
    draft_step: int = -1
    draft_len: int = 0

    @property
    def link_id(self) -> int:
        return self.addr.link_id


@dataclass
class StepPlan(KVConnectorMetadata):
    loads: list[LoadJob] = field(default_factory=list)
    captures: list[CaptureJob] = field(default_factory=list)
    drops: list[LinkAddr] = field(default_factory=list)
    # (req_id, prompt tokens, block ids) of prefills that end this step, when an instrumented
    # engine asks for state probes (tests; see vllm_hybridcache/testing/instrumentation.py)
    probes: list[tuple[str, int, list[list[int]]]] = field(default_factory=list)
    # the lower tiers' worker operations, by tier name (core/tiers/lower.py `take_ops`), for
    # the worker handler of that name (core/tiers/handler.py); the adapter never reads them
    tier_ops: dict[str, Any] = field(default_factory=dict)


@dataclass
class StepReport(KVConnectorWorkerMetadata):
    """Worker results of one step; aggregated over TP/PP workers.

    A capture counts as saved only if every worker saved its shard, so `saved` holds a count
    per link and `workers` the number of reports merged. `tier_reports`: each lower tier's
    handler report by tier name, when it has one (core/tiers/handler.py `report`), from the
    worker of tensor-parallel rank 0; `shard_reports`: the other ranks' handler reports, by
    tier name and rank (at TP > 1 each rank's disk writer writes its own shard's files).
    """

    saved: dict[LinkAddr, float] = field(default_factory=dict)  # link -> seconds (max)
    saved_count: dict[LinkAddr, int] = field(default_factory=dict)
    failed_saves: set[LinkAddr] = field(default_factory=set)
    loaded: dict[str, float] = field(default_factory=dict)     # req_id -> seconds (max)
    failed_loads: set[str] = field(default_factory=set)
    lost_links: set[LinkAddr] = field(default_factory=set)     # payload missing on a worker
    workers: int = 1
    tier_reports: dict[str, Any] = field(default_factory=dict)
    shard_reports: dict[str, dict[int, Any]] = field(default_factory=dict)
    # staged files a worker refused as it read their parts, by (tier, kind) and problem (a
    # LinkFileProblem value: checksum, unauthenticated, ...), for tiers that count them
    # themselves (the disk tier's writer counts its own)
    refused: dict[tuple[str, str], dict[str, int]] = field(default_factory=dict)
    # the worker's connector seconds by phase (adapter/overhead.py WorkerPhase) since its
    # previous report; the slowest worker's (ranks copy their shards side by side)
    seconds: dict[str, float] = field(default_factory=dict)

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
            out.tier_reports.update(src.tier_reports)
            for name, by_rank in src.shard_reports.items():
                out.shard_reports.setdefault(name, {}).update(by_rank)
            for k, v in src.seconds.items():
                out.seconds[k] = max(out.seconds.get(k, 0.0), v)
            for k, probs in src.refused.items():
                acc = out.refused.setdefault(k, {})
                for problem, n in probs.items():
                    acc[problem] = acc.get(problem, 0) + n
        return out
