"""The disk tier's write-behind: which RAM links become files, and the writer's operations.

Holds what the disk tier needs beside its lookups (core/tiers/disk.py): the writes queued for
the worker's writer thread (core/disk/writer.py), the files it must forget or clear, the read
buffers to warm once at start, and, with session spill, the end anchors RAM may hand down
(core/disk/spill.py). The facade tells it what happens to RAM links (core/tiers/lower.py);
each plan carries one `DiskOps` for the worker's DiskHandler (core/disk/handler.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from ..disk.spill import SpillBook
from ..disk.writer import DiskTarget
from ..keys import PromptKeys, in_tenant
from ..linkformat.job import WriteJob
from ..linkformat.reader import SourceOrigin
from .base import LinkAddr, LinkKind, LookupResult, Tier
from .disk import DiskTier
from .disk_anchors import DiskAnchors
from .lower import LowerTier

__all__ = ["DiskBehind", "DiskOps"]

_RAM_TREE = (Tier.RAM.value, LinkKind.TREE.value)
_RAM_ANCHOR = (Tier.RAM.value, LinkKind.ANCHOR.value)


class DiskOps(msgspec.Struct):
    """One step's operations for the worker's disk writer.

    `target` rides in every plan, so a worker starts its writer on the first one. `writes`:
    committed RAM links to write (`when="now"`) or end anchors to keep in mind for the
    shutdown drain (`when="spill"`). `forget`: files the scheduler side deleted, which the
    writer's index must forget; `clear`: delete every file; `clear_tenants`: (tenant tag, kind)
    of tenants' clears, applied after the writes queued before, in order. `warm`: (start, end)
    of the files found at start-up that a disk hit is likeliest to read, in the first plan only.
    """

    target: DiskTarget
    writes: list[WriteJob] = msgspec.field(default_factory=list)
    forget: list[str] = msgspec.field(default_factory=list)
    clear: bool = False
    clear_tenants: list[tuple[bytes, str]] = msgspec.field(default_factory=list)
    warm: list[tuple[int, int]] = msgspec.field(default_factory=list)


class DiskBehind(LowerTier):
    """Disk write-behind: admission-gated writes of committed RAM tree links, session spill.

    Invariant: `writes` holds only jobs not yet sent; a job of `when="spill"` is an end anchor
    the spill book announced (`SpillBook.reserved`), every other job a link the disk tier
    admitted (`DiskTier.write_job`) or an anchor RAM evicted (`SpillBook.dropped`).
    """

    name = Tier.DISK.value

    def __init__(self, disk: DiskTier, target: DiskTarget, origin: SourceOrigin,
                 anchors: DiskAnchors | None = None,
                 warm: Sequence[tuple[int, int]] = ()) -> None:
        self.disk = disk
        self.anchors = anchors
        # session spill: the end anchors RAM may hand to disk (on with the anchor tier)
        self.spill = SpillBook() if anchors is not None else None
        self.target = target
        self.origin = origin
        self.writes: list[WriteJob] = []
        self._warm = list(warm)  # sent once, with the first plan

    def tiers(self) -> list[Any]:
        return [self.disk]

    def anchor_tiers(self) -> list[Any]:
        return [self.anchors] if self.anchors is not None else []

    # ------------------------------------------------------------------ events from RAM
    def observe(self, keys: PromptKeys, domain: bytes, res: LookupResult) -> Sequence[int]:
        """Count the prompt's cuts for write admission before its prefill (core/disk/
        admission.py). Links it newly admits that RAM already holds (this prompt's hit: a
        prefix seen for the second time, found in RAM) are offered now; the others are written
        when their prefill commits them."""
        anchored = res.hit and res.kind == LinkKind.ANCHOR
        if not self.disk.observe(keys, domain, continues_session=anchored):
            return ()
        if res.hit and (res.tier, res.kind) == _RAM_TREE and res.plan:
            return [ref.link_id for ref in res.plan.chain]
        return ()

    def committed(self, addr: LinkAddr, record: Any) -> None:
        """A committed RAM tree link is queued for its file when the disk tier admits it (its
        bytes are in the worker's store; the writer thread copies them); a committed end
        anchor becomes one the spill may write."""
        route = (addr.tier, addr.kind)
        if route == _RAM_TREE and record is not None:
            job = self.disk.write_job(record)
            if job is not None:
                self.writes.append(job)
        elif route == _RAM_ANCHOR and self.spill is not None:
            self.spill.committed(addr.link_id)

    def anchor_reserved(self, addr: LinkAddr, keys: PromptKeys, domain: bytes, end: int,
                        tag: Any) -> None:
        """The worker keeps the anchor in mind for the shutdown drain (session spill)."""
        if self.spill is None or self.anchors is None or addr.tier != Tier.RAM:
            return
        job = self.anchors.spill_job(addr.link_id, domain, keys,
                                     self.disk.layout.view_rows(0, end), tag)
        if job is None:  # a tag no file can carry (counted): superseded all the same
            self.spill.superseded(domain, keys.tokens[:end])
        else:
            self.spill.reserved(job, keys.tokens[:end])
            self.writes.append(job)

    def failed(self, addrs: Sequence[LinkAddr]) -> None:
        """An end anchor whose bytes are missing or suspect is never written."""
        if self.spill is not None:
            self.spill.discard([a.link_id for a in addrs if (a.tier, a.kind) == _RAM_ANCHOR])

    def dropped(self, addrs: Sequence[LinkAddr]) -> None:
        """Committed end anchors RAM evicted are written now rather than lost (the worker hands
        them to its writer before it drops them)."""
        if self.spill is None or self.anchors is None:
            return
        for job in self.spill.dropped(a.link_id for a in addrs
                                      if (a.tier, a.kind) == _RAM_ANCHOR):
            self.writes.append(job)
            self.anchors.note_spilled(job.domain, job.end, job.digest)

    def cleared(self, tier: str | None, kind: str | None) -> None:
        if tier in (None, Tier.DISK) and kind in (None, LinkKind.TREE):
            # queued before the clear: never written (anchors announced for the shutdown
            # drain stay announced)
            self.writes = [j for j in self.writes if j.when == "spill"]
        if self.spill is not None and tier in (None, Tier.RAM) and kind in (None,
                                                                           LinkKind.ANCHOR):
            self.spill.discard_all()  # cleared, not evicted: nothing to write

    def cleared_tenant(self, tag: bytes, tier: str | None, kind: str | None) -> None:
        ours = in_tenant(tag)
        if tier in (None, Tier.DISK):
            # the tenant's writes of the kinds cleared, queued and not yet sent to the writer:
            # never written (anchors announced for the shutdown drain stay announced: the
            # drops of their RAM anchors, when those are cleared, withdraw them)
            kinds = {str(kind)} if kind is not None else {LinkKind.TREE.value,
                                                          LinkKind.ANCHOR.value}
            self.writes = [j for j in self.writes
                           if j.when == "spill" or j.kind not in kinds or not ours(j.domain)]
        if self.spill is not None and tier in (None, Tier.RAM) and kind in (None,
                                                                           LinkKind.ANCHOR):
            self.spill.discard_domains(ours)  # cleared, not evicted: nothing to write

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if self.disk.cost is not None:
            self.disk.cost.observe_prefill(tokens, seconds)

    # ------------------------------------------------------------------ worker traffic
    def take_ops(self) -> DiskOps:
        forget, clear = self.disk.take_writer_ops()
        ops = DiskOps(self.target, writes=self.writes, forget=forget, clear=clear,
                      clear_tenants=self.disk.take_tenant_clears(), warm=self._warm)
        self.writes, self._warm = [], []
        return ops

    def absorb(self, report: Any) -> None:
        """The writer's latest cumulative stats (core/disk/writer.py)."""
        if report is not None:
            self.disk.absorb_worker(report)

    def absorb_shard(self, rank: int, report: Any) -> None:
        """Another rank's writer's stats (TP > 1: each rank writes its own shard's files)."""
        if report is not None:
            self.disk.absorb_worker(report, rank)
