"""End anchors: the state where a conversation's last request stopped (tier `ram`, kind `anchor`).

An agent's next turn is the previous prompt, plus the answer, plus a tool result. The shared
tree only holds cold-exact states at prefill cuts, so the answer and everything after the last
cut would be prefilled again. An *end anchor* keeps the state at the last position a finished
request forwarded (its prompt plus all but the last sampled token); a request whose tokens
strictly extend those tokens resumes there and forwards only what is new.

That state descends from decode steps, so it is *session-exact*, not cold-exact: anchors live
apart from the shared tree, are never served across domains (the domain includes
`cache_salt`), and a request resumed from one never publishes links into the tree
(`cold_exact = False`). They are bounded by count and bytes, least recently used first.

Metadata only, like SnapshotTree: payloads live in the worker's LinkStore under the anchor's
id, which comes from the id source the cache shares between its tiers.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

import msgspec
import numpy as np

from ..keys import PromptKeys, as_tokens, blake2b_128, in_tenant
from ..layout import StateLayout
from ..stats import CacheStats, MissReason, SkipReason, StatsRecorder
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

__all__ = ["EndAnchors"]


class _Anchor:
    __slots__ = ("cold_rows", "committed", "domain", "doomed", "id", "nbytes", "pins", "tag",
                 "tokens")

    def __init__(self, aid: int, domain: bytes, tokens: np.ndarray, nbytes: int,
                 tag: object, cold_rows: int = 0) -> None:
        self.id = aid
        self.domain = domain
        self.tokens = tokens  # the whole prefix [0, n) as int64: an anchor is a chain of one
        self.nbytes = nbytes
        self.committed = False  # pending until the worker confirms its copy; never served
        self.pins = 0  # active restores; a pinned anchor is never evicted or handed to drops
        self.doomed = False  # dropped while pinned: its id is drained when the last pin goes
        self.tag = tag  # opaque, from reserve(); only a lookup's `fits` predicate reads it
        # its first rows a cold prefill writes bit for bit (reserve's word; <= len(tokens))
        self.cold_rows = cold_rows


class EndAnchors(CacheTier):
    """Bounded LRU of end anchors (scheduler side; single-threaded like the tree)."""

    tier = Tier.RAM
    kind = LinkKind.ANCHOR
    cold_exact = False

    def __init__(self, layout: StateLayout, max_count: int, budget_bytes: int,
                 next_id: Callable[[], int] | None = None, shards: int = 1) -> None:
        if shards < 1:
            raise ValueError("shards must be >= 1")
        self.layout = layout
        # processes holding their own shard of every anchor (TP ranks): an anchor's bytes
        # against the budget are the host bytes of all of them (core/config.py TreeConfig)
        self.shards = shards
        self.max_count = max_count
        self.budget_bytes = budget_bytes
        # live anchors in LRU order (oldest first); doomed ones are only in _doomed
        self._anchors: OrderedDict[int, _Anchor] = OrderedDict()
        self._doomed: dict[int, _Anchor] = {}
        self._next_id = next_id if next_id is not None else IdSource()
        self._bytes = 0  # bytes of the live anchors (what the budget bounds)
        self._dropped: list[int] = []
        self._rec = StatsRecorder()

    @property
    def enabled(self) -> bool:
        return self.max_count > 0 and self.budget_bytes > 0

    def keys(self, tokens: Sequence[int] | np.ndarray) -> PromptKeys:
        return PromptKeys(tokens, blake2b_128)

    def nbytes(self, tokens: int) -> int:
        return self.shards * self.layout.link_bytes(self.layout.view_rows(0, tokens))

    def _plan(self, a: _Anchor) -> RestorePlan:
        n = int(a.tokens.shape[0])
        parts = {s.name: s.nbytes for s in self.layout.sections}
        rows = self.layout.view_rows(0, n)
        for v in self.layout.views:
            parts[v.name] = v.bytes_per_row * rows
        return RestorePlan((LinkRef(a.id, 0, n),), n, parts, sum(parts.values()))

    # ------------------------------------------------------------------ lookups and restores
    def lookup(
        self, tokens: Tokens, domain: bytes, limit: int | None = None, fits: Fits | None = None
    ) -> LookupResult:
        """Deepest anchor of `domain` (committed or pending) whose tokens are a prefix of
        tokens[:limit]. A pending one is returned with `pending` set: ask again next step."""
        arr = tokens.tokens if isinstance(tokens, PromptKeys) else as_tokens(tokens)
        n_prompt = int(arr.shape[0])
        lim = n_prompt if limit is None else max(0, min(int(limit), n_prompt))
        if not self.enabled:
            return self._miss(MissReason.DISABLED, n_prompt, lim)
        best: _Anchor | None = None
        refused = 0
        for a in self._anchors.values():
            n = a.tokens.shape[0]
            if (a.domain == domain and 0 < n <= lim
                    and (best is None or n > best.tokens.shape[0])
                    and np.array_equal(arr[:n], a.tokens)):
                if fits is not None and not fits(n, a.tag):
                    refused = max(refused, n)
                    continue
                best = a
        depth = int(best.tokens.shape[0]) if best is not None else 0
        if best is None:
            return self._miss(MissReason.NO_PREFIX, n_prompt, lim, refused)
        return LookupResult(True, depth, self._plan(best), None, n_prompt, lim,
                            tier=self.tier.value, kind=self.kind.value,
                            pending=not best.committed, shortened=refused > depth,
                            refused=refused, cold_rows=best.cold_rows)

    def _miss(self, reason: MissReason, n: int, lim: int, refused: int = 0) -> LookupResult:
        return LookupResult(False, 0, None, reason.value, n, lim, tier=self.tier.value,
                            kind=self.kind.value, shortened=refused > 0, refused=refused)

    def record_lookup(self, res: LookupResult) -> None:
        record_lookup(self._rec, res)

    def begin_restore(self, res: LookupResult) -> bool:
        """Pin the anchor of a hit; False (recorded as an `evicted` miss) if it is gone, not
        committed, or no longer the state the lookup described."""
        a = self._anchors.get(res.plan.deepest) if res.hit and res.plan is not None else None
        if a is None or not a.committed or a.tokens.shape[0] != res.tokens:
            self.record_lookup(msgspec.structs.replace(
                res, hit=False, tokens=0, plan=None, pending=False,
                miss_reason=res.miss_reason if not res.hit else MissReason.EVICTED.value))
            return False
        self.record_lookup(res)
        a.pins += 1
        self._anchors.move_to_end(a.id)
        return True

    def end_restore(self, plan: RestorePlan, ok: bool, seconds: float = 0.0) -> None:
        """Unpin; a failed restore drops the anchor (its payload is suspect), deferred while
        another restore still holds it. KeyError when the anchor is not pinned (a double
        release would otherwise let its payload be freed under a running restore)."""
        aid = plan.deepest
        a = self._anchors.get(aid) or self._doomed.get(aid)
        if a is None or a.pins <= 0:
            raise KeyError(f"restore of anchor {aid} is not active")
        a.pins -= 1
        s = self._rec.s
        if ok:
            s.restores += 1
            s.tokens_served += plan.tokens
            s.restore_bytes += a.nbytes
            s.restore_seconds.observe(seconds)
        else:
            s.restores_failed += 1
            self._drop(a)
        if a.doomed and a.pins == 0:
            del self._doomed[a.id]
            self._dropped.append(a.id)
        self._evict_to_fit(0)

    # ------------------------------------------------------------------ two-phase publication
    def reserve(self, tokens: Tokens, p: int, domain: bytes, tag: object = None,
                cold_rows: int = 0) -> Reservation:
        """A pending anchor for tokens[:p] in `domain`, replacing any anchor those tokens extend.

        Refused (counted as a skip) when it cannot fit; the caller then captures nothing.
        `cold_rows` (clamped to [0, p]) is handed back with every hit on it.
        """
        src = tokens.tokens if isinstance(tokens, PromptKeys) else as_tokens(tokens)
        arr = np.array(src[:p], copy=True)
        n = int(arr.shape[0])
        if not self.enabled:
            return self._refuse(n, SkipReason.DISABLED, 0)
        nbytes = self.nbytes(n)
        self._rec.s.reservations += 1
        if n == 0 or nbytes > self.budget_bytes:
            return self._refuse(n, SkipReason.TOO_LARGE if n else SkipReason.BUDGET, nbytes)
        # The conversation moved on: an older anchor that this one extends is obsolete.
        for a in list(self._anchors.values()):
            m = a.tokens.shape[0]
            if a.domain == domain and a.pins == 0 and m <= n and np.array_equal(arr[:m], a.tokens):
                self._drop(a)
        if not self._evict_to_fit(nbytes):
            return self._refuse(n, SkipReason.BUDGET, nbytes)
        aid = self._next_id()
        self._anchors[aid] = _Anchor(aid, domain, arr, nbytes, tag,
                                     max(0, min(int(cold_rows), n)))
        self._bytes += nbytes
        return Reservation(aid, None, 0, n, None, None, nbytes, self.tier.value, self.kind.value)

    def _refuse(self, n: int, reason: SkipReason, nbytes: int) -> Reservation:
        self._rec.skip(reason.value)
        return Reservation(None, None, 0, n, reason.value, None, nbytes, self.tier.value,
                           self.kind.value)

    def commit(self, link_id: int, seconds: float = 0.0) -> bool:
        a = self._anchors.get(link_id)
        if a is None or a.committed:
            return False
        a.committed = True
        s = self._rec.s
        s.captures += 1
        s.capture_bytes += a.nbytes
        s.capture_seconds.observe(seconds)
        return True

    def abort(self, link_id: int) -> int:
        a = self._anchors.get(link_id)
        if a is None or a.committed:
            return 0
        self._rec.s.aborts += 1
        self._drop(a)
        return 1

    def invalidate(self, link_ids: Sequence[int]) -> int:
        n = 0
        for lid in link_ids:
            a = self._anchors.get(lid)
            if a is not None:
                self._drop(a)
                n += 1
        self._rec.s.invalidated += n
        return n

    # ------------------------------------------------------------------ eviction and clear
    def _drop(self, a: _Anchor) -> None:
        """Take a live anchor out of lookups and the budget; hand its id out now or, if a
        restore pins it, when that restore ends."""
        if a.doomed:
            return
        self._anchors.pop(a.id, None)
        self._bytes -= a.nbytes
        if a.pins > 0:
            a.doomed = True
            self._doomed[a.id] = a
        else:
            self._dropped.append(a.id)

    def _evict_to_fit(self, incoming: int) -> bool:
        """Evict least recently used unpinned anchors until count and bytes fit."""
        while (len(self._anchors) + (1 if incoming else 0) > self.max_count
               or self._bytes + incoming > self.budget_bytes):
            victim = next((a for a in self._anchors.values() if a.pins == 0), None)
            if victim is None:
                return False
            self._rec.s.evictions += 1
            self._rec.s.evicted_bytes += victim.nbytes
            self._drop(victim)
        return True

    def evict(self, nbytes: int) -> int:
        freed = 0
        while freed < nbytes:
            victim = next((a for a in self._anchors.values() if a.pins == 0 and a.committed),
                          None)
            if victim is None:
                break
            freed += victim.nbytes
            self._rec.s.evictions += 1
            self._rec.s.evicted_bytes += victim.nbytes
            self._drop(victim)
        return freed

    def clear(self) -> int:
        """Drop every anchor; one a restore pins leaves lookups now and its payload later."""
        n = len(self._anchors)
        for a in list(self._anchors.values()):
            self._drop(a)
        self._rec.s.cleared += n
        return n

    def clear_tenant(self, tag: bytes) -> int:
        """Drop the anchors of one tenant (domain ending with `tag`); pinned ones as in
        clear()."""
        ours = in_tenant(tag)
        gone = [a for a in self._anchors.values() if ours(a.domain)]
        for a in gone:
            self._drop(a)
        self._rec.s.cleared += len(gone)
        return len(gone)

    def drain_dropped(self) -> list[int]:
        out, self._dropped = self._dropped, []
        return out

    # ------------------------------------------------------------------ introspection
    def __len__(self) -> int:
        return len(self._anchors)

    def link_ids(self) -> list[int]:
        return list(self._anchors)

    @property
    def bytes_held(self) -> int:
        return self._bytes

    def stats(self) -> CacheStats:
        s = self._rec.snapshot()
        s.links = sum(1 for a in self._anchors.values() if a.committed)
        s.links_pending = len(self._anchors) - s.links
        s.links_pinned = sum(1 for a in (*self._anchors.values(), *self._doomed.values())
                             if a.pins)
        s.bytes_held = self._bytes
        s.bytes_pending = sum(a.nbytes for a in self._anchors.values() if not a.committed)
        s.budget_bytes = self.budget_bytes
        s.domains = len({a.domain for a in self._anchors.values()})
        return s

    def sanity_check(self) -> None:
        """Recount bytes and bounds; every doomed anchor must still be pinned."""
        assert self._bytes == sum(a.nbytes for a in self._anchors.values())
        assert self._bytes <= self.budget_bytes or not self.enabled
        assert len(self._anchors) <= max(self.max_count, 0)
        for a in self._anchors.values():
            assert not a.doomed and a.pins >= 0
            assert a.nbytes == self.nbytes(int(a.tokens.shape[0]))
            assert 0 <= a.cold_rows <= int(a.tokens.shape[0])
        for aid, a in self._doomed.items():
            assert a.doomed and a.pins > 0 and aid not in self._anchors
