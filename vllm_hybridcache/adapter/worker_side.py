"""Worker side of the connector: moves bytes between vLLM's KV-cache tensors and the store.

Runs in each worker process on the model runner's thread. It decides nothing: it executes the
scheduler's plan (loads before the forward needs them, captures after the step's forward,
drops last) and reports what succeeded. Any exception in a copy is contained: a failed load is
reported so vLLM recomputes the request from scratch (an asynchronous one through vLLM's
failed receives, kv_load_failure_policy=recompute; a synchronous one through the report, for the
segmentation scheduler to withdraw its step), a failed capture is discarded and its link
aborted.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from vllm_hybridcache.adapter.draft_rows import (
    DRAFT_INPUT,
    DRAFT_PASS,
    BoundaryTap,
    PassGeometry,
    find_draft_head,
    rebuild_input,
    with_draft_input,
)
from vllm_hybridcache.adapter.inner_states import InnerStates
from vllm_hybridcache.adapter.overhead import WorkerPhase
from vllm_hybridcache.adapter.parts import PartMap, UnsupportedModel, part_map
from vllm_hybridcache.adapter.plans import CaptureJob, LoadJob, StepPlan, StepReport
from vllm_hybridcache.adapter.tier_registry import handler_class
from vllm_hybridcache.core import LinkStore, MissingLinkError
from vllm_hybridcache.core.linkformat.reader import LOCAL_PROBLEMS, DiskReadError, stage_chain
from vllm_hybridcache.core.tiers.handler import TierHandler
from vllm_hybridcache.ops.link_copy import gather_link
from vllm_hybridcache.ops.paged_blocks import PagedBlocks

if TYPE_CHECKING:
    from vllm_hybridcache.adapter.probes import StepProbes

logger = logging.getLogger("vllm_hybridcache")


class WorkerSide:
    def __init__(self, vllm_config, kv_cache_config) -> None:
        self.vllm_config = vllm_config
        self.num_blocks = int(kv_cache_config.num_blocks)
        self.kv_cache_groups = kv_cache_config.kv_cache_groups
        self.parts: PartMap | None = None
        try:
            self.parts = with_draft_input(part_map(kv_cache_config), rebuild_input(vllm_config))
        except UnsupportedModel:
            self.parts = None
        # MTP route: the draft head's boundary inputs (adapter/draft_rows.py); None elsewhere
        self._tap: BoundaryTap | None = None
        self.store = LinkStore(self.parts.layout) if self.parts is not None else None
        self._sections: dict[str, tuple[int, torch.Tensor]] = {}   # name -> (gid, [blocks,...])
        self._rows: dict[str, tuple[int, PagedBlocks]] = {}        # name -> (gid, accessor)
        # fine segmentation: states inside a step, from the layers that take a capture hook
        self._inner: InnerStates | None = None
        self._report = StepReport(workers=1)
        # connector seconds by phase not yet reported (a step without results sends no
        # report: its seconds ride with the next one)
        self._seconds: dict[str, float] = {}
        self._recving: set[str] = set()
        self._sending: set[str] = set()
        self._failed_recving: set[str] = set()
        # the lower tiers' worker handlers by tier name (core/tiers/handler.py), each created
        # by the first plan carrying its operations (adapter/tier_registry.py)
        self.handlers: dict[str, TierHandler] = {}
        self._started: StepPlan | None = None  # the plan whose handlers were started
        # set between steps, clear while one runs (bind to save): background work of a
        # handler waits for it, so it never shares the cores with a forward or a hit's read
        self._between_steps = threading.Event()
        self._between_steps.set()
        # tests and benchmarks only (fault injection, state probes, copy totals); see
        # vllm_hybridcache/testing/instrumentation.py. None in production.
        self.instrumentation: StepProbes | None = None
        # this worker's tensor-parallel rank: whose shard of every link it holds, and so
        # which rank's files of a disk link it writes and reads (core/linkformat/shard.py)
        self.rank = _tp_rank()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self.parts is None:
            return
        from vllm_hybridcache.compat import forward_layers  # vLLM's static forward context
        ctx = forward_layers(self.vllm_config)
        specs = {s.name: s for s in self.parts.layout.sections}
        for name, gid, layer, idx in self.parts.sections:
            t = ctx[layer].kv_cache[idx]
            spec = specs[name]
            dtype = str(t.dtype).removeprefix("torch.")
            if tuple(t.shape[1:]) != spec.shape or dtype != spec.dtype:
                raise UnsupportedModel(
                    f"state tensor {name} is {tuple(t.shape[1:])}/{t.dtype}, spec says "
                    f"{spec.shape}/{spec.dtype}"
                )
            self._sections[name] = (gid, t)
        self._inject_inner_hooks(ctx)
        for name, gid, layer in self.parts.views:
            self._rows[name] = (gid, PagedBlocks(kv_caches[layer], self.num_blocks,
                                                 self.parts.block_bytes[name]))
        draft = [s for s in self.parts.layout.sections if s.name == DRAFT_INPUT]
        if draft:
            k = int(self.vllm_config.speculative_config.num_speculative_tokens)
            self._tap = find_draft_head(ctx, self.kv_cache_groups, draft[0], 1 + k)

    def _inject_inner_hooks(self, ctx) -> None:
        """Give every state layer that can hand over states inside a step (an `inner_capture`
        attribute: flash_next/gdn.py; vLLM's Qwen GDN layers on CPU with the bend in place,
        compat.takes_cpu_gdn_inner_capture) a hook; only when all of them can, so an inner
        capture never lacks a section. The scheduler side plans inner captures only in fine
        mode."""
        from vllm_hybridcache.compat import takes_cpu_gdn_inner_capture

        layers = {layer for _, _, layer, _ in self.parts.sections}
        if not layers or not all(hasattr(ctx[layer], "inner_capture")
                                 or takes_cpu_gdn_inner_capture(ctx[layer]) for layer in layers):
            return
        self._inner = InnerStates({name: (gid, layer, idx)
                                   for name, gid, layer, idx in self.parts.sections})
        for _, gid, layer, _ in self.parts.sections:
            ctx[layer].inner_capture = self._inner.hook(gid)

    def begin_step(self) -> None:
        """A step begins (its plan is bound): background work waits until `save` ends it."""
        self._between_steps.clear()

    def arm_inner(self, plan: StepPlan) -> None:
        """Before the step's forward: the offsets this step's inner captures want."""
        if self._inner is not None:
            self._inner.arm(plan)

    # ------------------------------------------------------------------ loads
    def _load(self, job: LoadJob) -> None:
        if self.instrumentation is not None:
            self.instrumentation.before_load(job)
        if job.fail is not None:
            raise MissingLinkError(None, job.fail)
        if job.sources:
            self._stage(job)
        dst = {name: t[job.block_ids[gid][0]] for name, (gid, t) in self._sections.items()}
        if self._tap is not None:  # each link's boundary input: read below, not restored
            dst[DRAFT_INPUT] = self._tap.scratch
            dst[DRAFT_PASS] = self._tap.pass_scratch

        shared = job.in_place // self.parts.layout.view_block_tokens  # vLLM's, never written

        def sink(name: str, start: int, rows: torch.Tensor) -> None:
            gid, acc = self._rows[name]
            skip = min(max(0, shared - start), rows.shape[0])
            if skip < rows.shape[0]:
                acc.scatter(job.block_ids[gid], start + skip, rows[skip:])

        self.store.restore(job.chain, dst, sink)
        if job.draft is not None and self._tap is not None:
            kept = [self.store.buffers(ref.link_id).sections for ref in job.chain]
            self._tap.rebuild(job.draft, [k[DRAFT_INPUT] for k in kept],
                              [PassGeometry.of(k[DRAFT_PASS]) for k in kept],
                              job.block_ids[self._tap.gid])

    def _stage(self, job: LoadJob) -> None:
        """Read a disk hit's files into the store under the chain's ids (core/linkformat/reader.py);
        a refused file fails the load and is counted by its problem."""
        handler = self.handlers.get(job.tier)
        try:
            direct = handler is not None and handler.direct_reads()
            # the other links' states are read when one of them is first needed, where the
            # tier's files stay (not from the cluster tier's staging folder); not on the MTP
            # route (the draft rebuild reads every link's sections now)
            defer = handler is not None and handler.defers_reads and job.draft is None
            origin = job.origin
            if origin is None:
                raise DiskReadError(job.chain[0].link_id if job.chain else -1, "mismatch",
                                    "a load with files but no origin")
            sources, shard = origin.for_rank(self.rank, job.sources)  # this rank's files
            stage_chain(self.store, job.chain, sources, origin.fingerprint, direct, defer,
                        key=origin.key(), root=Path(origin.root), expect=job.expect or None,
                        shard=shard)
        except DiskReadError as e:
            if handler is not None and handler.read_failed(e.problem):
                raise  # counted by the tier's own handler
            probs = self._report.refused.setdefault((job.tier, job.kind), {})
            probs[e.problem] = probs.get(e.problem, 0) + 1
            if e.problem in LOCAL_PROBLEMS:  # this worker's staging copy, not the payload:
                raise RuntimeError(str(e)) from e  # the load fails, the link is not lost
            raise

    def _start_handlers(self, plan: StepPlan) -> None:
        """Create the handler of every tier the plan carries operations for (first time) and
        let each start its work for this step, once per plan (from start_load, or from save
        when vLLM loaded nothing this step)."""
        if plan is self._started:
            return
        self._started = plan
        for name, ops in plan.tier_ops.items():
            handler = self.handlers.get(name)
            if handler is None:
                handler = self.handlers[name] = handler_class(name)(self.store,
                                                                    self._between_steps)
                handler.rank = self.rank
            handler.start(ops)

    def _count(self, phase: WorkerPhase, t0: float) -> None:
        self._seconds[phase.value] = (self._seconds.get(phase.value, 0.0)
                                      + time.perf_counter() - t0)

    def start_load(self, plan: StepPlan) -> None:
        t0 = time.perf_counter()
        try:
            self._start_load(plan)
        finally:
            self._count(WorkerPhase.RESTORE, t0)

    def _start_load(self, plan: StepPlan) -> None:
        self._start_handlers(plan)
        for job in plan.loads:
            t0 = time.perf_counter()
            try:
                self._load(job)
                dt = time.perf_counter() - t0
                self._report.loaded[job.req_id] = dt
                if self.instrumentation is not None:
                    self.instrumentation.after_load(job, dt)
            except Exception as e:
                logger.warning("hybridcache: restore of %s failed, recomputing: %s", job.req_id, e,
                               exc_info=not isinstance(e, MissingLinkError))
                if isinstance(e, MissingLinkError) and e.link_id is not None:
                    self._report.lost_links.add(job.addr(e.link_id))  # never offered again
                self._report.failed_loads.add(job.req_id)
                if not job.sync:
                    self._failed_recving.add(job.req_id)
            if not job.sync:
                self._recving.add(job.req_id)

    # --------------------------------------------------------------- captures
    def _capture(self, job: CaptureJob) -> None:
        if self.instrumentation is not None:
            self.instrumentation.before_capture(job)
        layout = self.parts.layout
        bufs = self.store.allocate(job.link_id, layout.view_rows(job.row_start, job.row_end))
        first = job.row_start // layout.view_block_tokens
        if job.inner_offset > 0:  # a state inside the step, handed over by the model
            if self._inner is None:
                raise RuntimeError("an inner capture on a model without inner-capture hooks")
            inner = self._inner.sections(job)
            srcs = [(inner[name], bufs.sections[name]) for name in self._sections]
        else:
            srcs = [(t[job.block_ids[gid][job.section_block]], bufs.sections[name])
                    for name, (gid, t) in self._sections.items()]
        # state slots and every layer's KV blocks: one launch per link (ops/link_copy.py)
        gather_link(
            srcs,
            [(acc, job.block_ids[gid], first, bufs.views[name])
             for name, (gid, acc) in self._rows.items()])
        if self._tap is not None:
            dst, geometry = bufs.sections[DRAFT_INPUT], bufs.sections[DRAFT_PASS]
            first_block = job.block_ids[self._tap.gid][0]
            if job.draft_step >= 0 and job.finishing:  # an end anchor: its last verify step
                row, g = self._tap.take_anchor(first_block, job.row_end, job.draft_step,
                                               job.draft_len)
                dst.copy_(row)
                geometry.copy_(g.as_tensor())
            elif job.draft_step >= 0:
                dst.copy_(self._tap.take(first_block, job.row_end, job.draft_step))
                geometry.copy_(PassGeometry.step(job.draft_step, job.row_end).as_tensor())
            else:
                dst.zero_()  # no boundary row is rebuilt from this link
                geometry.zero_()
        self.store.seal(job.link_id)

    def save(self, plan: StepPlan) -> None:
        """After the step's forward: captures, the lower tiers' hand-offs, drops; the step
        ends here (`begin_step`)."""
        t0 = time.perf_counter()
        try:
            self._save(plan)
        finally:
            self._count(WorkerPhase.SAVE, t0)
            self._between_steps.set()

    def _save(self, plan: StepPlan) -> None:
        for job in plan.captures:
            t0 = time.perf_counter()
            try:
                self._capture(job)
                dt = time.perf_counter() - t0
                self._report.saved[job.addr] = dt
                if self.instrumentation is not None:
                    self.instrumentation.after_capture(job, dt)
                self._report.saved_count[job.addr] = 1
            except Exception as e:
                logger.warning("hybridcache: capture of link %d failed: %s", job.link_id, e,
                               exc_info=True)
                self.store.discard(job.link_id)
                self._report.failed_saves.add(job.addr)
            if job.finishing:
                self._sending.add(job.req_id)  # vLLM may free the request's blocks now
        if self._inner is not None:
            self._inner.clear()
        self._start_handlers(plan)
        for name, ops in plan.tier_ops.items():  # before the drops: their buffers are alive
            self.handlers[name].after_captures(ops)
        if plan.drops:  # this store holds every tier's payloads (disk hits staged in RAM)
            ids = [a.link_id for a in plan.drops]
            held: set[int] = set()  # a handler still reads them: it drops them later
            for handler in self.handlers.values():
                held |= handler.holds(ids)
                handler.dropped(ids)
            self.store.drop([i for i in ids if i not in held])
        if plan.probes and self.instrumentation is not None:
            for req_id, tokens, block_ids in plan.probes:
                self.instrumentation.on_prefill_end(self, req_id, tokens, block_ids)
        if self._tap is not None:
            self._tap.clear()  # this step's draft passes are done

    def shutdown(self) -> None:
        """vLLM's graceful shutdown (the connector's shutdown hook): each handler finishes
        or drops what it queued, within its tier's limit (the disk tier's session spill)."""
        if self.store is None:
            return
        for handler in self.handlers.values():
            handler.shutdown()

    # ---------------------------------------------------------------- results
    def take_report(self) -> StepReport | None:
        r = self._report
        for name, handler in self.handlers.items():
            rep = handler.report()
            if rep is not None:
                if self.rank == 0:
                    r.tier_reports[name] = rep
                else:
                    r.shard_reports[name] = {self.rank: rep}
        if not (r.saved or r.failed_saves or r.loaded or r.failed_loads or r.lost_links
                or r.tier_reports or r.shard_reports):
            return None
        r.seconds, self._seconds = self._seconds, {}
        self._report = StepReport(workers=1)
        return r

    def take_finished_sending(self) -> set[str]:
        done, self._sending = self._sending, set()
        return done

    def take_finished_recving(self) -> tuple[set[str], set[str]]:
        done, failed = self._recving, self._failed_recving
        self._recving, self._failed_recving = set(), set()
        return done, failed


def _tp_rank() -> int:
    """This worker's tensor-parallel rank (0 before vLLM's parallel groups exist: a worker
    built outside an engine, as the no-model harness does)."""
    from vllm.distributed.parallel_state import (
        get_tensor_model_parallel_rank,
        model_parallel_is_initialized,
    )

    if not model_parallel_is_initialized():
        return 0
    return int(get_tensor_model_parallel_rank())
