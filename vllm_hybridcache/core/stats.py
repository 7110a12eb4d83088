"""Stats: counters and gauges for every event, exported as one typed msgspec snapshot.

The tree owns one mutable StatsRecorder and hands out immutable CacheStats snapshots; the vLLM
adapter ships them as connector stats and exports them to Prometheus. Histograms use fixed
bucket bounds (Prometheus style: counts[i] counts observations <= bounds[i], the last count is
the +Inf bucket) so snapshots from several engines can be summed.
"""

from __future__ import annotations

import bisect
from enum import StrEnum

import msgspec

__all__ = ["CacheStats", "Histogram", "MissReason", "SkipReason", "StatsRecorder"]


class MissReason(StrEnum):
    """Why a lookup returned no link."""

    NO_PREFIX = "no_prefix"  # nothing stored on this prefix
    EVICTED = "evicted"  # a link on this prefix was stored and evicted recently
    VERIFY_FAILED = "verify_failed"  # a digest matched but the stored tokens differ
    DOMAIN_MISMATCH = "domain_mismatch"  # the tokens are stored, but only under another domain
    DISABLED = "disabled"  # budget 0: the cache is off
    # The prompt carries inputs its token ids do not name (images, audio, prompt embeddings):
    # placeholder tokens are the same for every image, so keys of token ids alone would restore
    # another input's state. Such requests are served without the cache.
    UNKEYED_INPUT = "unkeyed_input"


class SkipReason(StrEnum):
    """Why a capture (reservation) was refused."""

    BUDGET = "budget"  # could not free enough bytes (pinned/pending links) or larger than budget
    MEMORY_GUARD = "memory_guard"  # host available memory would fall under the floor
    TOO_LARGE = "too_large"  # larger than max_link_bytes
    PARENT_REFUSED = "parent_refused"  # an earlier cut on this prefix was refused or aborted
    DISABLED = "disabled"  # budget 0: the cache is off


HIT_TOKEN_BOUNDS: tuple[float, ...] = tuple(float(1 << k) for k in range(6, 19))  # 64 .. 256K
SECONDS_BOUNDS: tuple[float, ...] = (
    1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
)


class Histogram(msgspec.Struct):
    """Cumulative-free bucket counts; counts has len(bounds) + 1 entries (last is +Inf)."""

    bounds: tuple[float, ...]
    counts: list[int]
    sum: float = 0.0
    count: int = 0

    @classmethod
    def empty(cls, bounds: tuple[float, ...]) -> Histogram:
        return cls(bounds=bounds, counts=[0] * (len(bounds) + 1))

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def copy(self) -> Histogram:
        return Histogram(self.bounds, list(self.counts), self.sum, self.count)


class CacheStats(msgspec.Struct, kw_only=True):
    """One snapshot of the tree's counters (monotonic) and gauges (current values)."""

    # lookups (recorded by begin_restore / record_lookup; lookup() itself is pure)
    lookups: int = 0
    hits: int = 0
    prompt_tokens: int = 0  # sum of prompt lengths looked up
    hit_tokens: int = 0  # sum of hit depths (tokens a hit would serve)
    hit_chain_links: int = 0  # sum of chain lengths of hits
    misses: dict[str, int] = msgspec.field(default_factory=dict)  # by MissReason
    verify_collisions: int = 0  # digest matched, tokens differed (also on lookups that hit)
    shortened: int = 0  # lookups the adapter cut back to a shallower link (see record_shortened)
    # hits by why the facade chose this tier's among several (ChoiceReason, core/choice.py),
    # counted under the route chosen
    choices: dict[str, int] = msgspec.field(default_factory=dict)
    hit_depth: Histogram = msgspec.field(
        default_factory=lambda: Histogram.empty(HIT_TOKEN_BOUNDS)
    )
    # restores (end_restore)
    restores: int = 0
    restores_failed: int = 0
    tokens_served: int = 0  # tokens of successful restores only
    restore_bytes: int = 0
    restore_seconds: Histogram = msgspec.field(
        default_factory=lambda: Histogram.empty(SECONDS_BOUNDS)
    )
    # captures
    reservations: int = 0
    dedups: int = 0  # reserve of an already-present key: no new link
    captures: int = 0  # commits
    capture_bytes: int = 0
    capture_seconds: Histogram = msgspec.field(
        default_factory=lambda: Histogram.empty(SECONDS_BOUNDS)
    )
    aborts: int = 0  # links dropped by abort (cascade included)
    skips: dict[str, int] = msgspec.field(default_factory=dict)  # by SkipReason
    # eviction and housekeeping
    evictions: int = 0
    evicted_bytes: int = 0
    invalidated: int = 0  # links dropped by invalidate() (payload lost on the worker)
    cleared: int = 0  # links dropped by clear()
    expired: int = 0  # links dropped for being unused longer than a TTL (disk tier)
    promoted: int = 0  # links taken over from a slower tier's restore (a disk hit into RAM)
    swept: int = 0  # foreign fingerprint folders and stale temporaries deleted (disk tier)
    # gauges
    links: int = 0  # committed links
    links_pending: int = 0
    links_pinned: int = 0  # links pinned by an active restore
    bytes_held: int = 0  # committed + pending payload bytes
    bytes_pending: int = 0
    budget_bytes: int = 0
    domains: int = 0


class StatsRecorder:
    """The mutable counters behind CacheStats (gauges are filled in by the tree at snapshot)."""

    def __init__(self) -> None:
        self.s = CacheStats()

    def miss(self, reason: str) -> None:
        self.s.misses[reason] = self.s.misses.get(reason, 0) + 1

    def skip(self, reason: str) -> None:
        self.s.skips[reason] = self.s.skips.get(reason, 0) + 1

    def lookup(self, *, prompt_tokens: int, hit_tokens: int, chain_links: int,
               miss_reason: str | None, shortened: bool = False,
               verify_collisions: int = 0, choice: str | None = None) -> None:
        """Count one recorded lookup: a hit of `hit_tokens` over `chain_links` links when
        chain_links > 0 (and why it was chosen, when a cost model chose), else a miss by
        reason (no_prefix when none is given)."""
        s = self.s
        s.lookups += 1
        s.prompt_tokens += prompt_tokens
        s.shortened += shortened
        s.verify_collisions += verify_collisions
        if chain_links > 0:
            s.hits += 1
            s.hit_tokens += hit_tokens
            s.hit_chain_links += chain_links
            s.hit_depth.observe(float(hit_tokens))
            if choice is not None:
                s.choices[choice] = s.choices.get(choice, 0) + 1
        else:
            self.miss(miss_reason or MissReason.NO_PREFIX.value)

    def snapshot(self) -> CacheStats:
        s = self.s
        return msgspec.structs.replace(
            s,
            misses=dict(s.misses),
            skips=dict(s.skips),
            choices=dict(s.choices),
            hit_depth=s.hit_depth.copy(),
            restore_seconds=s.restore_seconds.copy(),
            capture_seconds=s.capture_seconds.copy(),
        )
