"""Spilled end anchors on disk (tier `disk`, kind `anchor`): the read side of session spill.

The anchor files a graceful shutdown or RAM's eviction wrote (core/disk/spill.py), served to a
prompt that extends them, session-exact, like the RAM end anchors (core/tiers/anchors.py);
everything but the lookup is the disk tier's (core/tiers/disk.py).
"""

from __future__ import annotations

from collections import OrderedDict

from ..disk.cost import ReadRefusal
from ..disk.spill import anchor_job
from ..keys import PromptKeys, in_tenant
from ..linkformat.job import ANCHOR, WriteJob
from ..linkformat.tags import TagCodec, TagProblem, UnencodableTag
from ..stats import CacheStats, MissReason
from .base import (
    Fits,
    LinkKind,
    LinkRef,
    LookupResult,
    RestorePlan,
    Tokens,
)
from .disk import OFFERED_MAX, DiskTier, payload_bytes
from .ram_tree import LinkRecord

__all__ = ["DiskAnchors"]


class DiskAnchors(DiskTier):
    """Spilled end anchors on disk (tier `disk`, kind `anchor`): session spill's read side.

    An end anchor written at a graceful shutdown, or when RAM evicted it (core/disk/spill.py),
    is one root file holding the whole prefix [0, n) of a finished request, under the anchor
    folder of its domain. This tier serves it to a request whose prompt strictly extends those
    tokens, like the RAM anchor tier: session-exact (`cold_exact` False, so the resumed request
    publishes nothing shared), never across domains (the domain includes `cache_salt`), and
    only when deeper than any RAM hit (`slow`).

    Candidates are the anchor files the shared directory indexed at start-up plus the ones
    this engine spilled since (`note_spilled`); a lookup opens only those whose name matches
    the digest of the prompt's prefix at their end, then verifies header and tokens. The
    staged ids are dropped after the restore (the request's own end anchor replaces it in
    RAM). Restores, sources, invalidation and drops work as in DiskTier; the files and the
    writer belong to the tree tier given here (one directory, one index, one writer).

    On a speculative (MTP) route an anchor's file carries the RAM anchor's draft tag in its
    header (`tags`: the adapter's anchor tag types; a tag no file can carry is not written,
    `spill_job`), and a lookup applies the same `fits` predicate as the RAM anchor tier: the
    deepest candidate that fits serves, a deeper one refused by its tag is counted as a
    `draft_tag` miss (the file stays: it may fit another prompt). A tagged file never serves
    a lookup without a predicate, nor an untagged one a lookup with one. On Flash-Next's MTP
    route the anchor's boundary hidden row and draft-pass geometry are sections of the layout,
    so they are parts of the file with their CRC-32 and MAC, and the worker rebuilds the anchor's
    boundary draft row from the staged copy as from a RAM anchor.
    """

    kind = LinkKind.ANCHOR
    cold_exact = False

    KNOWN_MAX = 4096  # candidate names remembered (a name whose file never came is a miss)

    def __init__(self, tree: DiskTier, tags: TagCodec | None = None) -> None:
        """tags: the codec of the end anchors' draft tags (their own types: a tree link's tag
        type in an anchor file decodes as unknown and fits nothing); none on the AR route."""
        on_delete = tree.dir.on_delete
        super().__init__(tree.layout, tree.dir, tree._cuts, next_id=tree._next_id,
                         hasher=tree._hasher, cost=tree.cost, baseline=tree._baseline,
                         tags=tags)
        self.dir.on_delete = on_delete  # deletions reach the tree tier's writer ops
        self._tenant_clears = tree._tenant_clears  # and a tenant's clear its writer
        self._known: OrderedDict[tuple[bytes, int, bytes], None] = OrderedDict()
        for e in tree.dir.anchors():
            self.note_spilled(e.domain, e.end, e.digest)

    def note_spilled(self, domain: bytes, end: int, digest: bytes) -> None:
        """An anchor file there is, or that this engine asked its writer to write (a lookup
        finds it once the file is there)."""
        key = (domain, end, digest)
        self._known[key] = None
        self._known.move_to_end(key)
        while len(self._known) > self.KNOWN_MAX:
            self._known.popitem(last=False)

    def lookup(self, tokens: Tokens, domain: bytes, limit: int | None = None,
               fits: Fits | None = None) -> LookupResult:
        """The deepest spilled anchor of `domain` whose tokens are a prefix of tokens[:limit],
        header and every token verified (no payload byte read), and whose draft tag fits the
        prompt (`fits(end, tag)` on a speculative route; untagged files only without it)."""
        keys = self._as_keys(tokens)
        n = len(keys)
        lim = n if limit is None else max(0, min(int(limit), n))
        cands = [(end, dg) for (dom, end, dg) in self._known if dom == domain and 0 < end <= lim]
        found = None
        refused = 0
        while cands and found is None:
            found = self.dir.lookup_anchor(keys, domain, lim, cands)
            if found is None:
                break
            header = found[1]
            cands = [(end, dg) for end, dg in cands if end < header.end]  # the next deepest
            tag = self.tags.decode(header.tag)
            if fits is None or tag is None:  # as in DiskTier.lookup
                ok = fits is None and tag is None
            else:
                ok = fits(header.end, tag)
            if not ok:
                refused = max(refused, header.end)
                found = None
            elif header.rows != self.layout.view_rows(0, header.end):
                found = None
        if refused > (found[1].end if found is not None else 0):
            self._misfit += 1
        if found is None:
            return self._miss(MissReason.NO_PREFIX, n, lim, refused)
        path, header, _ = found
        if not self._worth(keys, domain, lim, payload_bytes(header), header.end, fits):
            return self._miss(MissReason.NO_PREFIX, n, lim, refused)
        lid = self._next_id()
        self._offered[lid] = (path, keys, domain, self.tags.decode(header.tag))
        while len(self._offered) > OFFERED_MAX:
            self._offered.popitem(last=False)
        parts = {s.name: s.nbytes for s in self.layout.sections}
        for v in self.layout.views:
            parts[v.name] = v.bytes_per_row * self.layout.view_rows(0, header.end)
        plan = RestorePlan((LinkRef(lid, 0, header.end),), header.end, parts,
                           sum(parts.values()))
        return LookupResult(True, plan.tokens, plan, None, n, lim, tier=self.tier.value,
                            kind=self.kind.value, shortened=refused > plan.tokens,
                            refused=refused)

    def write_job(self, record: LinkRecord) -> WriteJob | None:
        return None  # anchors are written through session spill (core/disk/spill.py)

    def spill_job(self, link_id: int, domain: bytes, keys: PromptKeys, rows: int,
                  tag: object = None) -> WriteJob | None:
        """The session-spill write of a RAM end anchor just reserved (`when="spill"`), with its
        draft tag encoded for the header; None, counted as a `draft_tag` skip, when no file
        can carry the tag (the anchor stays in RAM only)."""
        try:
            enc = self.tags.encode(tag)
        except UnencodableTag:
            self._rec.skip(TagProblem.DRAFT_TAG.value)
            return None
        return anchor_job(link_id, domain, keys, rows, "spill", enc)

    def clear(self) -> int:
        """Delete every spilled anchor file of this fingerprint (each deletion reaches the
        writer's index through the tree tier's list)."""
        n = self.dir.clear(ANCHOR)
        self._known.clear()
        self._offered.clear()
        self._rec.s.cleared += n
        return n

    def clear_tenant(self, tag: bytes) -> int:
        """Delete one tenant's spilled anchor files (domains ending with `tag`); the writer,
        told through the tree tier's list, deletes its anchor writes that land afterwards."""
        n = self._clear_domains(tag, ANCHOR)
        ours = in_tenant(tag)
        for key in [k for k in self._known if ours(k[0])]:
            del self._known[key]
        self._rec.s.cleared += n
        return n

    def take_writer_ops(self) -> tuple[list[str], bool]:
        return [], False  # deletions go through the tree tier's list

    def take_tenant_clears(self) -> list[tuple[bytes, str]]:
        return []  # the tree tier's list holds them

    def stats(self) -> CacheStats:
        """Lookups and restores of spilled anchors; files and bytes as the start-up scan found
        them (the writer's totals, anchors included, are reported under kind `tree`)."""
        snap = self._rec.snapshot()
        if self._slow:
            snap.misses = {**snap.misses, ReadRefusal.SLOWER_THAN_PREFILL.value: self._slow}
        if self._misfit:
            snap.misses = {**snap.misses, TagProblem.DRAFT_TAG.value: self._misfit}
        snap.links = len(self)
        snap.bytes_held = self.bytes_held
        snap.links_pinned = sum(len(ids) for ids in self._active)
        snap.budget_bytes = self.dir.budget_bytes
        return snap

    def __len__(self) -> int:
        return len(self.dir.anchors())

    @property
    def bytes_held(self) -> int:
        return sum(e.nbytes for e in self.dir.anchors())
