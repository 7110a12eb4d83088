"""The disk tier's worker handler: the writer thread, the start-up warm-up, the spill drain.

Executes the `DiskOps` of each plan (core/tiers/disk_behind.py): starts the writer
(core/disk/writer.py) on the first plan, hands it committed RAM links before the plan's drops
(so their buffers are alive), keeps the end anchors announced for the shutdown drain, defers
the drop of a link the writer still reads, and reports the writer's cumulative stats when they
change.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

from ..cpus import widen_thread_affinity
from ..linkformat.job import WriteJob
from ..linkformat.reader import warm_read_buffers
from ..store import MissingLinkError
from ..tiers.handler import TierHandler
from .writer import LinkWriter

__all__ = ["DiskHandler"]

logger = logging.getLogger("vllm_hybridcache")


class DiskHandler(TierHandler):
    """One worker's disk writer, warm-up thread and spill book."""

    defers_reads = True  # a hit's other links' states are read when first needed

    def __init__(self, store: Any, between_steps: threading.Event) -> None:
        super().__init__(store, between_steps)
        self.writer: LinkWriter | None = None
        self.warm: threading.Thread | None = None  # warms the disk reads' buffers at start
        # ids whose drop waits for the writer to finish reading their buffers
        self.deferred_drops: set[int] = set()
        self._version = -1  # the writer stats version last reported
        # session spill: end anchors captured here, oldest first, written at shutdown (the
        # scheduler announced each with its capture; a drop forgets it)
        self.spillable: OrderedDict[int, WriteJob] = OrderedDict()

    def start(self, ops: Any) -> None:
        """Start the writer on the first plan; warm the read buffers it names (once)."""
        if self.writer is None:
            self.writer = LinkWriter(ops.target, rank=self.rank)  # this rank's files
            atexit.register(self.writer.close, 10.0)
        if ops.warm and self.store is not None and self.warm is None:
            self.warm = threading.Thread(target=self._warm_buffers, args=(ops.warm,),
                                         name="hybridcache-disk-warm", daemon=True)
            self.warm.start()

    def _warm_buffers(self, spans: list[tuple[int, int]]) -> None:
        """Fault in read buffers for the files found at start-up, off the request path (and
        only between steps): a restarted server's first disk hits then read into warm memory
        (PagePool.prewarm)."""
        t0 = time.perf_counter()
        widen_thread_affinity()  # not only the core of the forward's first thread

        def between_steps() -> Iterator[tuple[int, int]]:
            for span in spans:
                self.between_steps.wait()
                yield span

        n = warm_read_buffers(self.store, between_steps())
        logger.info("hybridcache: disk tier: %d MiB of read buffers warmed for the %d likeliest "
                    "of the files found at start-up (%.2f s)", n >> 20, len(spans),
                    time.perf_counter() - t0)

    def after_captures(self, ops: Any) -> None:
        """Hand committed RAM links to the writer, pass the scheduler's deletions on, and drop
        what the writer finished reading."""
        w = self.writer  # started by `start`, which the worker calls first for every plan
        assert w is not None
        for lid in w.take_done():
            if lid in self.deferred_drops:
                self.deferred_drops.discard(lid)
                self.store.drop([lid])
        if ops.forget:
            w.forget(ops.forget)
        if ops.clear:
            w.clear()
        for tag, kind in ops.clear_tenants:
            w.clear_tenant(tag, kind)
        for job in ops.writes:
            if not self.store.has(job.link_id):
                continue  # dropped before its write was planned: nothing to copy
            if job.when == "spill":  # an end anchor just captured: written at shutdown
                self.spillable[job.link_id] = job
                continue
            self.spillable.pop(job.link_id, None)  # evicted from RAM: written now
            try:
                bufs = self.store.buffers(job.link_id)
            except MissingLinkError as e:  # a promoted disk link whose state failed
                logger.warning("hybridcache: link %d not written: %s", job.link_id, e)
                continue
            w.submit(job, {**bufs.sections, **bufs.views})

    def holds(self, link_ids: list[int]) -> set[int]:
        if self.writer is None:
            return set()
        busy = {i for i in link_ids if self.writer.busy(i)}
        self.deferred_drops |= busy
        return busy

    def dropped(self, link_ids: list[int]) -> None:
        for i in link_ids:
            self.spillable.pop(i, None)

    def direct_reads(self) -> bool:
        return self.writer is not None and self.writer.target.direct_reads

    def read_failed(self, problem: str) -> bool:
        if self.writer is None:
            return False
        self.writer.note_read_failure(problem)
        return True

    def report(self) -> dict | None:
        if self.writer is not None and self.writer.version != self._version:
            self._version = self.writer.version
            return self.writer.snapshot()
        return None

    def shutdown(self) -> None:
        """Session spill: the end anchors still in the store are written first, newest first,
        then the queued tree writes, within the target's time limit; the log says what was
        written and what was dropped. Only reached when vLLM lets the engine process drain
        (--shutdown-timeout above 0); a write cut short by a kill leaves a temporary file,
        swept at a later start."""
        w = self.writer
        if w is None or self.store is None:
            return
        self.writer = None
        target = w.target
        anchors = []
        if target.spill:
            for lid, job in reversed(self.spillable.items()):
                if self.store.has(lid):
                    try:
                        bufs = self.store.buffers(lid)
                    except MissingLinkError:
                        continue
                    anchors.append((job, {**bufs.sections, **bufs.views}))
        self.spillable.clear()
        queued = w.snapshot()["queued"]
        r = w.drain(anchors, target.drain_s)
        spilled = (f"session spill wrote {r.anchors_written} of {r.anchors} end anchors "
                   f"({r.anchor_bytes} bytes)" if target.spill else "session spill off")
        logger.info("hybridcache: shutdown drain: %s to %s; %d tree writes were queued; %d "
                    "writes dropped at the %g s limit; %.2f s%s", spilled, target.root, queued,
                    r.skipped, target.drain_s, r.seconds,
                    "" if r.finished else " (a write was still running: left as a temporary)")
