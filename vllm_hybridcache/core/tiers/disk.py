"""DiskTier: cold-exact links kept as files on a local disk (tier `disk`, kind `tree`).

Scheduler side, metadata and decisions only, like the RAM tiers. The bytes live in link files
(core/linkformat/linkfile.py) under a directory several engines may share (core/disk/directory.py);
the scheduler runs on the same host as the workers, so it finds a prompt's chain by statting
the names of its cuts and verifying headers and tokens, without reading a payload byte.

How a disk hit is served (docs/disk-tier.md):
- `lookup` hands out a RestorePlan whose links carry fresh ids from the cache's shared id
  source (one per file, root first). The facade takes it only when it is strictly deeper than
  every RAM hit (`slow`).
- `begin_restore` checks the files are still there and keeps them for `sources(plan)`: the
  adapter ships the paths with the load job. The worker reads every file into its RAM store
  under those ids (every part's CRC-32 and MAC verified before a byte reaches the engine), then
  restores from RAM exactly like a RAM hit. A file that fails makes the load fail (vLLM
  recomputes the request cold), the worker reports the link lost, and `invalidate` deletes the
  file and every longer link of its chain.
- `end_restore` of a successful restore *promotes* the chain: the RAM tree adopts the staged
  links where it would have put them (`SnapshotTree.adopt`), so the next request on this
  prefix is served from RAM; the ids it does not take go back through `drain_dropped`, and
  the worker frees them with the next step's drops.

Writes are not reserved here: new links are captured into RAM (the facade admits new links in
the first tier of their kind) and the disk tier's write-behind (core/tiers/disk_behind.py)
asks `write_job` for every RAM tree link that commits; a background thread in the worker's
disk handler writes the file (core/disk/handler.py, core/disk/writer.py). Its cumulative stats
come back through `absorb_worker` and are part of `stats()`.

On a speculative (MTP) route a RAM tree link carries a draft tag (which prompts its draft rows
fit) and a lookup brings the adapter's `fits(p, tag)` predicate. A link file carries the tag
in its header (core/linkformat/tags.py), and a lookup applies the same predicate to every file of a
chain, ending it before the first that does not fit, as the RAM tree does; a promoted link
keeps its tag. A file with a tag never serves a lookup without one, nor the other way round.
On Flash-Next's MTP route the target's hidden row at each link's boundary is one more section
of the layout, so it is in the file with its CRC-32 and MAC like every part, and the worker rebuilds
the boundary draft rows from the staged copy as from a RAM link.

Single-threaded: the scheduler thread only.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from ..disk.admission import WriteAdmission
from ..disk.cost import ReadCost, ReadRefusal
from ..disk.directory import LinkDirectory
from ..keys import Hasher, PromptKeys, blake2b_128, in_tenant
from ..layout import StateLayout
from ..linkformat.job import TREE, WriteJob
from ..linkformat.tags import TagCodec, TagProblem, UnencodableTag
from ..stats import CacheStats, Histogram, MissReason, SkipReason, StatsRecorder
from .base import (
    CacheTier,
    Fits,
    IdSource,
    LinkKind,
    LinkRef,
    LookupResult,
    Reservation,
    RestorePlan,
    Tier,
    Tokens,
    record_lookup,
)
from .ram_tree import LinkRecord

__all__ = ["DiskTier"]

# promote(keys, domain, chain[, tags]) -> ids the RAM tree adopted (SnapshotTree.adopt); the
# links' draft tags are passed only when some link has one
Promote = Callable[..., list[int]]
# baseline(keys, domain, limit[, fits]) -> tokens the RAM tiers serve for this prompt (the
# cost check); the lookup's draft-row predicate is passed when there is one
Baseline = Callable[..., int]

# Ids handed out by lookups and not yet restored. vLLM allocates right after its lookup in the
# same scheduling pass, so a few are live at a time; the bound caps the memory of the prompts
# they keep (an id trimmed too early only makes begin_restore miss: the request goes cold).
OFFERED_MAX = 256
RECENT_MAX = 4096  # ids of ended restores whose files a late failure report may name


def payload_bytes(header) -> int:
    """Payload bytes of a link file (what staging it reads), from its header."""
    return max((e.offset + e.nbytes for e in header.parts), default=0)


class DiskTier(CacheTier):
    """Scheduler-side disk tier (see the module docstring and docs/disk-tier.md).

    directory: an opened LinkDirectory (swept, scanned, locked) of this engine's fingerprint.
    cuts: the prompt's cut positions (the segmentation; files only ever sit at cuts).
    """

    tier = Tier.DISK
    kind = LinkKind.TREE
    cold_exact = True
    slow = True

    def __init__(self, layout: StateLayout, directory: LinkDirectory,
                 cuts: Callable[[np.ndarray], list[int]],
                 next_id: Callable[[], int] | None = None, hasher: Hasher | None = None,
                 promote: Promote | None = None,
                 admission: WriteAdmission | None = None, cost: ReadCost | None = None,
                 baseline: Baseline | None = None, tags: TagCodec | None = None) -> None:
        self.layout = layout
        # draft tags in files (speculative routes): the adapter's tag types
        self.tags = tags if tags is not None else TagCodec()
        self._misfit = 0  # lookups a file's draft tag made shallower (counted misses)
        # which tree links are written (core/disk/admission.py); None: every committed link
        self.admission = admission
        # whether a hit is worth its read (core/disk/cost.py), against what RAM serves; None:
        # every deeper hit is taken
        self.cost = cost
        self._baseline = baseline
        self._slow = 0  # hits refused as slower than the prefill they save
        self.dir = directory
        self._cuts = cuts
        self._promote = promote
        self._next_id = next_id if next_id is not None else IdSource()
        self._hasher: Hasher = hasher if hasher is not None else blake2b_128
        # id -> (file, the prompt's keys, domain, the file's draft tag), for ids a lookup handed
        # out (bounded: unused ones are forgotten)
        self._offered: OrderedDict[int, tuple[Path, PromptKeys, bytes, object]] = OrderedDict()
        # plan link ids -> files of an active restore (begun, not ended), and what promotion
        # needs (the prompt's keys and domain, every link's draft tag)
        self._active: dict[tuple[int, ...], list[Path]] = {}
        self._active_keys: dict[tuple[int, ...], tuple[PromptKeys, bytes, list[object]]] = {}
        # id -> [its file, the longer files of its chain], for ended restores
        self._recent: OrderedDict[int, list[Path]] = OrderedDict()
        self._dropped: list[int] = []
        self._forget: list[str] = []  # files deleted here, for the writer's index
        self._clear_writer = False
        # (tenant tag, kind) of the tenants' clears since the writer last heard: it deletes
        # their files that land after the clear, and forgets the ones deleted here
        self._tenant_clears: list[tuple[bytes, str]] = []
        # clears (whole and per tenant) handed to the writers; until every writer reports as
        # many done, a file there may be an older write its queued clear is about to delete
        self._clears_sent = 0
        directory.on_delete = lambda p: self._forget.append(str(p))
        self._rec = StatsRecorder()
        self._worker: dict[str, Any] = {}  # the writer's latest cumulative stats
        self._shard_workers: dict[int, dict[str, Any]] = {}  # other ranks' writers (TP > 1)

    # ------------------------------------------------------------------ queries
    @property
    def enabled(self) -> bool:
        return True

    def keys(self, tokens: Sequence[int] | np.ndarray) -> PromptKeys:
        return PromptKeys(tokens, self._hasher)

    def _as_keys(self, tokens: Tokens) -> PromptKeys:
        if isinstance(tokens, PromptKeys) and tokens.hasher is self._hasher:
            return tokens
        raw = tokens.tokens if isinstance(tokens, PromptKeys) else tokens
        return PromptKeys(raw, self._hasher)

    def _miss(self, reason: MissReason, n: int, lim: int, refused: int = 0) -> LookupResult:
        return LookupResult(False, 0, None, reason.value, n, lim, tier=self.tier.value,
                            kind=self.kind.value, shortened=refused > 0, refused=refused)

    def lookup(self, tokens: Tokens, domain: bytes, limit: int | None = None,
               fits: Fits | None = None) -> LookupResult:
        """The deepest chain of files on the prompt's cuts <= limit, every header and token
        verified, every link fitting the prompt's draft rows (`fits(end, tag)` on a speculative
        route; untagged files only without it). No stats or pins; a damaged file met on the
        way is deleted (it can never serve anyone) and counted in the directory's refusals; a
        chain a file's tag made shallower is counted as a `draft_tag` miss (the result's
        `refused` says how deep it went, as the RAM tree's does)."""
        keys = self._as_keys(tokens)
        n = len(keys)
        lim = n if limit is None else max(0, min(int(limit), n))
        tags: dict[int, object] = {}

        def accept(h) -> bool:
            tag = self.tags.decode(h.tag)
            tags[h.end] = tag
            if fits is None or tag is None:  # a tag never serves an untagged lookup, and
                return fits is None and tag is None  # an untagged file no tagged lookup
            return fits(h.end, tag)

        chain, refused = self.dir.lookup_fitting(keys, domain, self._cuts(keys.tokens), lim,
                                                 accept)
        depth = chain[-1][1].end if chain else 0
        if refused > depth:
            self._misfit += 1
        if not chain or any(h.rows != self.layout.view_rows(h.start, h.end)
                            for _, h, _ in chain):
            return self._miss(MissReason.NO_PREFIX, n, lim, refused)
        nbytes = sum(payload_bytes(h) for _, h, _ in chain)
        if not self._worth(keys, domain, lim, nbytes, depth, fits):
            return self._miss(MissReason.NO_PREFIX, n, lim, refused)
        refs = []
        for path, header, _ in chain:
            lid = self._next_id()
            self._offered[lid] = (path, keys, domain, tags.get(header.end))
            refs.append(LinkRef(lid, header.start, header.end))
        while len(self._offered) > OFFERED_MAX:
            self._offered.popitem(last=False)
        parts = {s.name: s.nbytes for s in self.layout.sections}
        for v in self.layout.views:
            parts[v.name] = v.bytes_per_row * sum(
                self.layout.view_rows(r.start, r.end) for r in refs)
        plan = RestorePlan(tuple(refs), refs[-1].end, parts, sum(parts.values()))
        return LookupResult(True, plan.tokens, plan, None, n, lim, tier=self.tier.value,
                            kind=self.kind.value, shortened=refused > plan.tokens,
                            refused=refused)

    def _worth(self, keys: PromptKeys, domain: bytes, limit: int, nbytes: int,
               depth: int, fits: Fits | None = None) -> bool:
        """The cost check: reading `nbytes` must cost less than prefilling the tokens beyond
        what RAM serves to this prompt (its draft-row predicate applied; counted as
        `slower_than_prefill` when it does not). A chain no deeper than RAM's hit saves nothing
        and is not read, but it is not counted: the prompt is served from RAM, not prefilled,
        and counting it made the tier report reads refused as slow that no cost decided."""
        if self.cost is None:
            return True
        ram = 0
        if self._baseline is not None:
            ram = (self._baseline(keys, domain, limit) if fits is None
                   else self._baseline(keys, domain, limit, fits))
        if depth <= ram:
            return False
        if self.cost.worth(nbytes, depth - ram):
            return True
        self._slow += 1
        return False

    # ------------------------------------------------------------------ restores
    def record_lookup(self, res: LookupResult) -> None:
        record_lookup(self._rec, res)

    def begin_restore(self, res: LookupResult) -> bool:
        """Record the lookup; True when every file of the chain is still there (the worker
        verifies their bytes when it reads them)."""
        if not res.hit or res.plan is None:
            self.record_lookup(res)
            return False
        offered = [self._offered.pop(r.link_id, None) for r in res.plan.chain]
        if any(o is None or not self.dir.has_file(o[0]) for o in offered):
            self.record_lookup(msgspec.structs.replace(
                res, hit=False, tokens=0, plan=None, miss_reason=MissReason.EVICTED.value))
            return False
        self._active[res.plan.link_ids] = [o[0] for o in offered if o is not None]
        first = offered[0]
        assert first is not None
        self._active_keys[res.plan.link_ids] = (first[1], first[2],
                                                [o[3] for o in offered if o is not None])
        self.record_lookup(res)
        return True

    def sources(self, plan: RestorePlan) -> tuple[str, ...]:
        return tuple(str(p) for p in self._active[plan.link_ids])

    def end_restore(self, plan: RestorePlan, ok: bool, seconds: float = 0.0) -> None:
        paths = self._active.pop(plan.link_ids)  # KeyError: not active
        keys, domain, tags = self._active_keys.pop(plan.link_ids)
        s = self._rec.s
        if ok:
            s.restores += 1
            s.tokens_served += plan.tokens
            s.restore_bytes += plan.total_bytes
            s.restore_seconds.observe(seconds)
            if self.cost is not None:
                self.cost.observe_read(plan.total_bytes, seconds)
            for p in paths:
                self.dir.touch(p)
        else:
            s.restores_failed += 1
        for i, ref in enumerate(plan.chain):
            self._recent[ref.link_id] = paths[i:]
        while len(self._recent) > RECENT_MAX:
            self._recent.popitem(last=False)
        # Promotion: the staged links the RAM tree takes stay in the worker's store as RAM
        # links; the worker frees the others with the next step's drops.
        kept: set[int] = set()
        if ok and self._promote is not None:
            tagged = any(t is not None for t in tags)
            kept = set(self._promote(keys, domain, plan.chain, tags) if tagged
                       else self._promote(keys, domain, plan.chain))
        self._dropped.extend(i for i in plan.link_ids if i not in kept)

    # ------------------------------------------------------------------ publication
    def reserve(self, tokens: Tokens, p: int, domain: bytes, tag: Any = None,
                cold_rows: int = 0) -> Reservation:
        """Never used by the facade (new links are captured in RAM first); refused."""
        self._rec.skip(SkipReason.DISABLED.value)
        return Reservation(None, None, 0, p, SkipReason.DISABLED.value, tier=self.tier.value,
                           kind=self.kind.value)

    def commit(self, link_id: int, seconds: float = 0.0) -> bool:
        return False

    def abort(self, link_id: int) -> int:
        return 0

    def write_job(self, record: LinkRecord) -> WriteJob | None:
        """The write of a committed RAM tree link, or None when it is not admitted.

        Admission (docs/disk-tier.md): a committed cold-exact link whose file does not exist
        yet and whose prefix the admission counts admitted (seen in two prompts, or a line of
        a session's first long prompt; every link without an admission). On a speculative
        route the job carries the link's draft tag into the file; a tag no file can carry is
        not written (skip `draft_tag`). Writes that find the writer behind are dropped and
        counted there.
        """
        try:
            tag = self.tags.encode(record.tag)
        except UnencodableTag:
            self._rec.skip(TagProblem.DRAFT_TAG.value)
            return None
        if (not self._clear_in_flight()
                and self.dir.has_file(self.dir.path_for(record.domain, record.end,
                                                        record.digest))):
            return None  # on disk already (the writer skips it too, by the same check)
        if not self.admits(record.domain, record.end, record.digest):
            self._rec.skip("not_admitted")
            return None
        return WriteJob(record.link_id, record.domain, record.digest, record.parent_digest,
                        record.start, record.end, record.tokens,
                        self.layout.view_rows(record.start, record.end), tag=tag)

    def admits(self, domain: bytes, end: int, digest: bytes) -> bool:
        a = self.admission
        return a is None or a.first_prompt_tokens == 0 or a.admitted(domain, end, digest)

    def observe(self, tokens: Tokens, domain: bytes, continues_session: bool) -> list[int]:
        """Count a new prompt's cuts before its prefill (admission); the cuts now admitted."""
        if self.admission is None:
            return []
        keys = self._as_keys(tokens)
        return self.admission.observe(keys, domain, self._cuts(keys.tokens), continues_session)

    # ------------------------------------------------------------------ housekeeping
    def invalidate(self, link_ids: Sequence[int]) -> int:
        """A worker refused a file while reading it: delete it and the longer links of the
        chain that was being restored."""
        n = 0
        for lid in link_ids:
            files = self._recent.pop(lid, None)
            if files is None:
                for ids, paths in self._active.items():
                    if lid in ids:
                        files = paths[ids.index(lid):]
                        break
            if files:
                n += self.dir.delete(files)  # on_delete tells the writer's index
        self._rec.s.invalidated += n
        return n

    def evict(self, nbytes: int) -> int:
        freed = self.dir.evict(nbytes)
        return freed

    def clear(self) -> int:
        """Delete every tree link file of this engine's fingerprint (the writer's queued
        writes that land afterwards are deleted by its own clear, which follows them in its
        queue)."""
        n = self.dir.clear(TREE)
        self._offered.clear()
        self._clear_writer = True
        self._rec.s.cleared += n
        return n

    def clear_tenant(self, tag: bytes) -> int:
        """Delete the tree link files of one tenant (domains ending with `tag`) of this
        engine's fingerprint; the writer deletes that tenant's queued writes that land
        afterwards (`take_tenant_clears`). Other tenants' files stay."""
        n = self._clear_domains(tag, TREE)
        self._rec.s.cleared += n
        return n

    def _clear_domains(self, tag: bytes, kind: str) -> int:
        ours = in_tenant(tag)
        n = self.dir.clear_tenant(tag, kind)
        for lid in [i for i, o in self._offered.items() if ours(o[2])]:
            del self._offered[lid]  # a lookup's offer of a deleted file: begin_restore misses
        self._tenant_clears.append((bytes(tag), kind))
        return n

    def drain_dropped(self) -> list[int]:
        out, self._dropped = self._dropped, []
        return out

    def take_writer_ops(self) -> tuple[list[str], bool]:
        """(files the writer must forget, whether it must clear) since the last call."""
        forget, clear = self._forget, self._clear_writer
        self._forget, self._clear_writer = [], False
        self._clears_sent += int(clear)
        return forget, clear

    def take_tenant_clears(self) -> list[tuple[bytes, str]]:
        """(tenant tag, kind) of every tenant's clear since the last call, for the writer
        (DiskOps.clear_tenants), in order."""
        out = list(self._tenant_clears)
        self._tenant_clears.clear()  # in place: the anchor tier appends to this same list
        self._clears_sent += len(out)
        return out

    def _clear_in_flight(self) -> bool:
        """A clear was decided here that some writer has not carried out yet (or not yet
        reported): a link file found now may be an older write landing before that clear,
        which will then delete it, so a committed link is written again rather than trusted
        to it (the writer's queue runs the clear first, then this write)."""
        if self._clear_writer or self._tenant_clears:
            return True
        if not self._clears_sent:
            return False
        done = [int(w.get("clears", 0)) for w in (self._worker, *self._shard_workers.values())]
        if len(done) < getattr(self.dir, "world", 1):  # a rank that never reported
            return True
        return self._clears_sent > min(done)

    def absorb_worker(self, snapshot: dict[str, Any], rank: int = 0) -> None:
        """A writer's latest cumulative stats (see core/disk/writer.py): rank 0's, or at
        TP > 1 another rank's (each writes its own shard of every link)."""
        if rank == 0:
            self._worker = dict(snapshot)
        else:
            self._shard_workers[rank] = dict(snapshot)

    # ------------------------------------------------------------------ stats
    def stats(self) -> CacheStats:
        """Lookups and restores as counted here; writes, skips (writes dropped when the writer
        is behind: `queue_full`), files and bytes from the writer; misses by reason include
        every file refused (header at lookup, parts at read) by its problem."""
        snap = self._rec.snapshot()
        w = self._worker
        writers = [w, *self._shard_workers.values()]  # rank 0's first, then the others'
        ds = self.dir.stats
        snap.captures = int(w.get("writes", 0))  # links (rank 0 writes one file of each)
        snap.capture_bytes = sum(int(x.get("write_bytes", 0)) for x in writers)
        if w.get("write_seconds"):
            snap.capture_seconds = msgspec.convert(w["write_seconds"], Histogram)
        skips = dict(snap.skips)
        for x in writers:
            for reason, n in x.get("skips", {}).items():
                skips[reason] = skips.get(reason, 0) + n
        dropped = sum(int(x.get("dropped", 0)) for x in writers)
        if dropped:
            skips["queue_full"] = dropped
        snap.skips = skips
        misses = dict(snap.misses)
        if self._slow:
            misses[ReadRefusal.SLOWER_THAN_PREFILL.value] = self._slow
        if self._misfit:
            misses[TagProblem.DRAFT_TAG.value] = self._misfit
        for src in (ds.refused, *(x.get("read_failures", {}) for x in writers)):
            for reason, n in src.items():
                misses[reason] = misses.get(reason, 0) + n
        snap.misses = misses
        snap.evictions = ds.evictions + int(w.get("evictions", 0))
        snap.expired = ds.expired + int(w.get("expired", 0))
        snap.invalidated += ds.orphans
        snap.swept = ds.swept_dirs + ds.swept_temporaries
        snap.links = len(self)
        snap.links_pinned = sum(len(ids) for ids in self._active)
        snap.bytes_held = self.bytes_held
        snap.budget_bytes = self.dir.budget_bytes
        return snap

    def sanity_check(self) -> None:
        self.dir.sanity_check()
        active = [i for ids in self._active for i in ids]
        assert len(active) == len(set(active)), "an id in two active restores"
        assert not set(active) & set(self._offered), "an active id still offered"

    def link_ids(self) -> list[int]:
        """Ids staged in the worker's store for active restores (the facade checks that they
        never collide with another tier's)."""
        return [i for ids in self._active for i in ids]

    def __len__(self) -> int:
        """Files held: the writer's count once it reported, else the start-up scan's."""
        return int(self._worker["files"]) if "files" in self._worker else len(self.dir)

    @property
    def bytes_held(self) -> int:
        """Bytes of every rank's files: the writers' counts once each reported, else the
        start-up scan's."""
        if "bytes" not in self._worker:
            return self.dir.stats.bytes
        return sum(int(x.get("bytes", 0)) for x in (self._worker, *self._shard_workers.values()))
