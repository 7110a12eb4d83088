"""Eviction policies over the tree's candidate set: committed, unpinned leaves.

The tree decides *what may* be evicted (leaves only: a link with children is pinned by them;
links of an active restore plan are pinned; pending links are never candidates) and tells the
policy as links enter and leave the candidate set. The policy only decides *which* candidate
goes first. Both policies order candidates by a key that does not change with the passage of
time, so a binary heap with lazy invalidation gives O(log n) per event:

- LRU: key = last access time.
- Cost: score = saved_tokens / nbytes * sum over uses i of 2 ** (-(now - t_i) / half_life):
  the recompute work a link saves per byte it holds, weighted by a decayed count of its uses
  (its capture and every restore through it). Evicting a leaf loses only its own rows (a later
  hit lands on its parent), so saved_tokens = p - parent.p. The sum is kept incrementally as
  freq = sum_i 2 ** ((t_i - last_access) / half_life), and because every candidate decays at the
  same rate, log(score) = log(saved / nbytes) + log(freq) + last_access * ln2 / half_life
  - now * ln2 / half_life, whose order is fixed by the first three terms alone.
"""

from __future__ import annotations

import heapq
import math
from abc import ABC, abstractmethod
from typing import Protocol

__all__ = ["CostPolicy", "EvictionPolicy", "LRUPolicy", "PolicyLink", "make_policy"]


class PolicyLink(Protocol):
    """What a policy may read from a link."""

    id: int
    p: int
    start: int
    nbytes: int
    hits: int
    last_access: float
    freq: float


class EvictionPolicy(Protocol):
    name: str

    def add(self, link: PolicyLink) -> None:
        """`link` became a candidate (or its key changed): (re)insert it."""

    def discard(self, link: PolicyLink) -> None:
        """`link` is no longer a candidate (no-op when it was not one)."""

    def accessed(self, link: PolicyLink, now: float) -> None:
        """`link` was captured or used at `now` (any link, candidate or not): update its
        recency fields and reorder it if it is a candidate."""

    def victim(self, exclude: object | None = None) -> PolicyLink | None:
        """The candidate to evict next, other than `exclude`; not removed."""

    def __contains__(self, link_id: int) -> bool: ...

    def __len__(self) -> int: ...


class _HeapPolicy(ABC):
    """Min-heap of (key, seq, link id) with lazy invalidation by sequence number."""

    name = "heap"

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, int]] = []
        self._cand: dict[int, tuple[PolicyLink, int, float]] = {}
        self._seq = 0

    @abstractmethod
    def key(self, link: PolicyLink) -> float:
        """Eviction order: the link with the smallest key goes first."""

    def add(self, link: PolicyLink) -> None:
        self._seq += 1
        k = self.key(link)
        self._cand[link.id] = (link, self._seq, k)
        heapq.heappush(self._heap, (k, self._seq, link.id))
        if len(self._heap) > 2 * len(self._cand) + 64:
            self._heap = [(k, s, i) for i, (_, s, k) in self._cand.items()]
            heapq.heapify(self._heap)

    def discard(self, link: PolicyLink) -> None:
        self._cand.pop(link.id, None)

    def accessed(self, link: PolicyLink, now: float) -> None:
        link.last_access = now
        if link.id in self._cand:
            self.add(link)

    def victim(self, exclude: object | None = None) -> PolicyLink | None:
        heap = self._heap
        held: list[tuple[float, int, int]] = []
        found: PolicyLink | None = None
        while heap:
            _, seq, lid = heap[0]
            ent = self._cand.get(lid)
            if ent is None or ent[1] != seq:
                heapq.heappop(heap)  # stale entry
                continue
            if ent[0] is exclude:
                held.append(heapq.heappop(heap))
                continue
            found = ent[0]
            break
        for e in held:
            heapq.heappush(heap, e)
        return found

    def __contains__(self, link_id: int) -> bool:
        return link_id in self._cand

    def __len__(self) -> int:
        return len(self._cand)


class LRUPolicy(_HeapPolicy):
    """Least recently used leaf first."""

    name = "lru"

    def key(self, link: PolicyLink) -> float:
        return link.last_access


class CostPolicy(_HeapPolicy):
    """Least recompute work saved per byte held, decayed with age, first."""

    name = "cost"

    def __init__(self, half_life_s: float = 600.0) -> None:
        super().__init__()
        self._rate = math.log(2.0) / half_life_s

    def accessed(self, link: PolicyLink, now: float) -> None:
        age = max(now - link.last_access, 0.0)
        link.freq = link.freq * math.exp(-age * self._rate) + 1.0
        super().accessed(link, now)

    def score(self, link: PolicyLink, now: float) -> float:
        """Decayed recompute tokens saved per byte held, at time `now`."""
        saved = max(link.p - link.start, 1)
        age = max(now - link.last_access, 0.0)
        return saved / max(link.nbytes, 1) * link.freq * math.exp(-age * self._rate)

    def key(self, link: PolicyLink) -> float:
        saved = max(link.p - link.start, 1)
        return (
            math.log(saved / max(link.nbytes, 1)) + math.log(link.freq)
            + link.last_access * self._rate
        )


def make_policy(name: str, half_life_s: float = 600.0) -> EvictionPolicy:
    if name == "lru":
        return LRUPolicy()
    if name == "cost":
        return CostPolicy(half_life_s)
    raise ValueError(f"unknown eviction policy {name!r}")
