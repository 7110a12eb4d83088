"""End anchors: the state where a conversation's last request stopped (live continuation).

An agent's next turn is the previous prompt, plus the answer, plus a tool result. The shared
tree only holds cold-exact states at prefill cuts, so the answer and everything after the last
cut would be prefilled again. An *end anchor* keeps the state at the last position a finished
request forwarded (its prompt plus all but the last sampled token); a request whose tokens
strictly extend those tokens resumes there and forwards only what is new.

That state descends from decode steps, so it is *session-exact*, not cold-exact (design.md):
anchors live apart from the shared tree, are never served across domains (the domain includes
`cache_salt`), and a request resumed from one never publishes links into the tree. They are
bounded by count and bytes, least recently used first.

Metadata only, like SnapshotTree: payloads live in the worker's LinkStore under the anchor's id
(ids come from a range disjoint from the tree's).
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from .keys import as_tokens
from .layout import StateLayout
from .stats import CacheStats, StatsRecorder

__all__ = ["ANCHOR_ID_BASE", "AnchorHit", "SessionAnchors"]

ANCHOR_ID_BASE = 1 << 48  # tree link ids count up from 1; anchors never collide with them


class _Anchor:
    __slots__ = ("committed", "domain", "id", "nbytes", "pins", "tokens")

    def __init__(self, aid: int, domain: bytes, tokens: np.ndarray, nbytes: int) -> None:
        self.id = aid
        self.domain = domain
        self.tokens = tokens
        self.nbytes = nbytes
        self.committed = False
        self.pins = 0


class AnchorHit:
    """An anchor a prompt strictly extends: restore `tokens` tokens from anchor `anchor_id`.

    `pending`: its copy is not confirmed yet (the request that left it finished a moment ago);
    the caller should ask again after the next step rather than miss.
    """

    __slots__ = ("anchor_id", "pending", "tokens")

    def __init__(self, anchor_id: int, tokens: int, pending: bool = False) -> None:
        self.anchor_id = anchor_id
        self.tokens = tokens
        self.pending = pending


class SessionAnchors:
    """Bounded LRU of end anchors (scheduler side; single-threaded like the tree)."""

    def __init__(self, layout: StateLayout, max_count: int, budget_bytes: int) -> None:
        self.layout = layout
        self.max_count = max_count
        self.budget_bytes = budget_bytes
        self._anchors: OrderedDict[int, _Anchor] = OrderedDict()  # LRU order: oldest first
        self._next = ANCHOR_ID_BASE
        self._bytes = 0
        self._dropped: list[int] = []
        self._rec = StatsRecorder()

    @property
    def enabled(self) -> bool:
        return self.max_count > 0 and self.budget_bytes > 0

    def nbytes(self, tokens: int) -> int:
        return self.layout.link_bytes(self.layout.view_rows(0, tokens))

    def lookup(self, tokens, domain: bytes, limit: int) -> AnchorHit | None:
        """Deepest anchor of `domain` (committed or pending) whose tokens are a prefix of
        tokens[:limit]."""
        if not self.enabled:
            return None
        arr = as_tokens(tokens)
        best: _Anchor | None = None
        for a in self._anchors.values():
            n = a.tokens.shape[0]
            if (a.domain == domain and 0 < n <= limit
                    and (best is None or n > best.tokens.shape[0])
                    and np.array_equal(arr[:n], a.tokens)):
                best = a
        if best is None:
            return None
        return AnchorHit(best.id, int(best.tokens.shape[0]), pending=not best.committed)

    def begin_restore(self, hit: AnchorHit) -> bool:
        a = self._anchors.get(hit.anchor_id)
        if a is None or not a.committed:
            return False
        a.pins += 1
        self._anchors.move_to_end(a.id)
        s = self._rec.s
        s.lookups += 1  # a lookup served by an anchor is counted here, not by the tree
        s.hits += 1
        s.hit_tokens += hit.tokens
        s.hit_depth.observe(hit.tokens)
        return True

    def end_restore(self, anchor_id: int, ok: bool, seconds: float) -> None:
        a = self._anchors.get(anchor_id)
        if a is not None:
            a.pins = max(0, a.pins - 1)
        s = self._rec.s
        if ok:
            s.restores += 1
            s.tokens_served += a.tokens.shape[0] if a is not None else 0
            s.restore_bytes += a.nbytes if a is not None else 0
            s.restore_seconds.observe(seconds)
        else:
            s.restores_failed += 1
            if a is not None:
                self._drop(a)
        self._evict_to_fit(0)

    def reserve(self, tokens, domain: bytes) -> int | None:
        """A pending anchor for `tokens` in `domain`, replacing any anchor those tokens extend.

        Returns None (counted as a skip) when it cannot fit; the caller then captures nothing.
        """
        if not self.enabled:
            return None
        arr = np.array(as_tokens(tokens), copy=True)
        n = int(arr.shape[0])
        nbytes = self.nbytes(n)
        s = self._rec.s
        s.reservations += 1
        if n == 0 or nbytes > self.budget_bytes:
            self._rec.skip("too_large" if n else "budget")
            return None
        # The conversation moved on: an older anchor that this one extends is obsolete.
        for a in list(self._anchors.values()):
            m = a.tokens.shape[0]
            if a.domain == domain and a.pins == 0 and m <= n and np.array_equal(arr[:m], a.tokens):
                self._drop(a)
        if not self._evict_to_fit(nbytes):
            self._rec.skip("budget")
            return None
        aid = self._next
        self._next += 1
        self._anchors[aid] = _Anchor(aid, domain, arr, nbytes)
        self._bytes += nbytes
        return aid

    def commit(self, anchor_id: int, seconds: float = 0.0) -> bool:
        a = self._anchors.get(anchor_id)
        if a is None:
            return False
        a.committed = True
        s = self._rec.s
        s.captures += 1
        s.capture_bytes += a.nbytes
        s.capture_seconds.observe(seconds)
        return True

    def abort(self, anchor_id: int) -> None:
        a = self._anchors.get(anchor_id)
        if a is not None:
            self._rec.s.aborts += 1
            self._drop(a)

    def _drop(self, a: _Anchor) -> None:
        self._anchors.pop(a.id, None)
        self._bytes -= a.nbytes
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

    def drain_dropped(self) -> list[int]:
        out, self._dropped = self._dropped, []
        return out

    def clear(self) -> int:
        n = 0
        for a in list(self._anchors.values()):
            if a.pins == 0:
                self._drop(a)
                n += 1
        self._rec.s.cleared += n
        return n

    def __len__(self) -> int:
        return len(self._anchors)

    @property
    def bytes_held(self) -> int:
        return self._bytes

    def stats(self) -> CacheStats:
        s = self._rec.snapshot()
        s.links = sum(1 for a in self._anchors.values() if a.committed)
        s.links_pending = len(self._anchors) - s.links
        s.links_pinned = sum(1 for a in self._anchors.values() if a.pins)
        s.bytes_held = self._bytes
        s.budget_bytes = self.budget_bytes
        return s
