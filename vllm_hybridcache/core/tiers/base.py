"""The tier interface: what every place that holds links offers the cache facade.

The cache serves a request from *links* (resumable states). They can live in several places
(today host RAM; next a local disk and a cluster store) and come in several kinds (cold-exact
`tree` links at prefill cuts, session-exact `anchor` links at a finished request's end). One
`CacheTier` object holds the links of one (tier, kind) pair and makes every decision about
them; the facade (`core/cache.py`) asks every tier and routes each later call by the tier and
kind written in the data it handed out, never by the value of a link id.

Everything defined here that crosses the scheduler/worker boundary is plain data: msgspec
structs of ints and strings, or a NamedTuple, so it pickles and msgpack-encodes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from enum import StrEnum
from typing import Any, NamedTuple

import msgspec
import numpy as np

from ..keys import PromptKeys
from ..stats import CacheStats, StatsRecorder

__all__ = [
    "CacheTier",
    "Fits",
    "IdSource",
    "LinkAddr",
    "LinkKind",
    "LinkRef",
    "LookupResult",
    "Reservation",
    "RestorePlan",
    "Tier",
    "Tokens",
    "record_lookup",
]

Tokens = Sequence[int] | np.ndarray | PromptKeys

# fits(p, tag) -> bool: whether a link ending at cut p, reserved with `tag`, may serve the
# prompt being looked up. A link that does not fit ends the chain there (see CacheTier.lookup).
Fits = Callable[[int, Any], bool]


class Tier(StrEnum):
    """Where a link's bytes live (the `tier` label of every metric)."""

    RAM = "ram"
    DISK = "disk"
    CLUSTER = "cluster"  # links committed on another replica (core/tiers/cluster.py)


class LinkKind(StrEnum):
    """What kind of state a link holds (the `kind` label of every metric).

    TREE links are cold-exact (a prefill cut reached by the segmentation), shared between
    requests of a domain. ANCHOR links are session-exact (the state a finished request's decode
    left behind): a request resumed from one publishes nothing into the tree.
    """

    TREE = "tree"
    ANCHOR = "anchor"


class LinkAddr(NamedTuple):
    """The full address of a link: commands route on tier and kind, stores index by link_id."""

    tier: str
    kind: str
    link_id: int


class LinkRef(msgspec.Struct, frozen=True, array_like=True):
    """One link of a restore chain and the view rows [start, end) it holds."""

    link_id: int
    start: int
    end: int


class RestorePlan(msgspec.Struct, frozen=True):
    """What a restore moves: the chain root -> deepest and the bytes per part.

    Sections are copied from the deepest link only; view rows come from every link in order, and
    their concatenation is exactly the rows [0, tokens) of the prefix. An end anchor is a chain
    of one link holding rows [0, tokens).
    """

    chain: tuple[LinkRef, ...]
    tokens: int
    part_bytes: dict[str, int]
    total_bytes: int

    @property
    def deepest(self) -> int:
        return self.chain[-1].link_id

    @property
    def link_ids(self) -> tuple[int, ...]:
        return tuple(r.link_id for r in self.chain)


class LookupResult(msgspec.Struct, frozen=True):
    """Outcome of a lookup (pure; record it with begin_restore / record_lookup).

    `tier`/`kind` name the tier that answered: the one holding the hit, or on a miss the one
    whose miss reason is reported. `pending`: the hit's copy is not confirmed yet; the caller
    should ask again after the next step rather than miss (end anchors of a request that has
    just finished). `shortened`: a link matched the prompt's tokens deeper than the hit but was
    refused by the `fits` predicate; `refused`: the deepest such cut (0 if none), so the facade
    can tell whether a refusal in one tier was deeper than another tier's hit.
    """

    hit: bool
    tokens: int  # depth served, 0 on a miss
    plan: RestorePlan | None
    miss_reason: str | None  # a MissReason value on a miss
    prompt_tokens: int = 0
    limit: int = 0
    verify_collisions: int = 0  # digests that matched with different tokens on the way
    tier: str = Tier.RAM.value
    kind: str = LinkKind.TREE.value
    pending: bool = False
    shortened: bool = False
    refused: int = 0
    # why the facade served this hit among the tiers' (a ChoiceReason value, core/choice.py);
    # None when no cost model chose (or on a miss)
    choice: str | None = None
    # a session-exact hit's first rows that a cold prefill of the same tokens writes bit for bit
    # (what the capturing request computed on the segmentation from cold state, as its
    # reservation said); 0 when unknown. The adapter serves attention K/V below it from vLLM's
    # own blocks (never mixing rows of two provenances); unused for a cold-exact hit.
    cold_rows: int = 0


class Reservation(msgspec.Struct, frozen=True):
    """Outcome of a reservation.

    link_id is the new pending link to fill with view rows [start, end) and every section at
    end, or None: then skip_reason says why it was refused, or existing_id names the link that
    already holds this exact key (a dedup: nothing to capture, not a skip).
    """

    link_id: int | None
    parent_id: int | None
    start: int
    end: int
    skip_reason: str | None = None
    existing_id: int | None = None
    nbytes: int = 0
    tier: str = Tier.RAM.value
    kind: str = LinkKind.TREE.value

    @property
    def addr(self) -> LinkAddr | None:
        """Where the new pending link lives (None when nothing was reserved)."""
        return None if self.link_id is None else LinkAddr(self.tier, self.kind, self.link_id)


class CacheTier(ABC):
    """Metadata and decisions for the links of one (tier, kind) pair (scheduler side).

    Contract shared by every implementation (the facade and the adapter rely on it):
    - `lookup` is pure (no stats, recency or pins); only committed links are served, and every
      served link's tokens equal the prompt's (compared, never trusted from a digest).
    - `begin_restore` records the lookup and pins what it serves; `end_restore` unpins and
      raises KeyError for a restore that is not active (a double release is a bug).
    - Two-phase publication: `reserve` creates a pending link (never served), `commit` publishes
      it, `abort` drops it. Only committed bytes plus pending bytes count towards the budget.
    - A link's id is handed out by `drain_dropped` exactly once, and never while a restore pins
      it; ids are never reused (the facade gives every tier one shared id source, so one worker
      store can hold the links of several tiers).
    Single-threaded: called from the scheduler thread only.
    """

    tier: Tier
    kind: LinkKind
    cold_exact: bool  # whether a request resumed from this tier may publish tree links
    # A slow tier (disk, cluster) loses every tie to a faster tier's hit: on a tie the bytes
    # are already in RAM, and reading them again costs time for nothing. (Without a cost model
    # it serves a hit only when strictly deeper; with one, core/choice.py prices its reads at
    # its own measured rate, so a slightly deeper slow hit can lose to a RAM hit too.)
    slow: bool = False

    def sources(self, plan: RestorePlan) -> tuple[str, ...]:
        """What the worker must read before it restores `plan` (one entry per chain link), or
        () when the payloads are already in its store (RAM tiers). Valid between a successful
        begin_restore and end_restore."""
        return ()

    @property
    @abstractmethod
    def enabled(self) -> bool:
        """Whether this tier can hold links at all (budget or count 0 turns it off)."""

    @abstractmethod
    def keys(self, tokens: Sequence[int] | np.ndarray) -> PromptKeys:
        """A digest cache for one prompt, with this tier's hasher."""

    @abstractmethod
    def lookup(
        self, tokens: Tokens, domain: bytes, limit: int | None = None, fits: Fits | None = None
    ) -> LookupResult:
        """Deepest committed link whose tokens are a prefix of tokens[:limit] (pure).

        `fits(p, tag)` (optional) is asked for every link met on the way, with the tag given at
        its reservation; a link that does not fit is not served and ends its chain there.
        """

    @abstractmethod
    def record_lookup(self, res: LookupResult) -> None:
        """Count a lookup outcome this tier answered, without restoring."""

    @abstractmethod
    def begin_restore(self, res: LookupResult) -> bool:
        """Record the lookup; pin its links and return True if they are all still there."""

    @abstractmethod
    def end_restore(self, plan: RestorePlan, ok: bool, seconds: float = 0.0) -> None:
        """Unpin a restore begun here; count it (served only when ok). KeyError if not active."""

    @abstractmethod
    def reserve(self, tokens: Tokens, p: int, domain: bytes, tag: Any = None,
                cold_rows: int = 0) -> Reservation:
        """A pending link for the state at cut p of `tokens`; `tag` is kept for `fits`.
        `cold_rows`: of a session-exact link (an end anchor), how many of its first rows a cold
        prefill of the same tokens writes bit for bit (LookupResult.cold_rows); tiers of
        cold-exact links ignore it."""

    @abstractmethod
    def commit(self, link_id: int, seconds: float = 0.0) -> bool:
        """Publish a pending link; False (no change) for an unknown or committed id."""

    @abstractmethod
    def abort(self, link_id: int) -> int:
        """Drop a pending link (and what depends on it); returns the links dropped."""

    @abstractmethod
    def invalidate(self, link_ids: Sequence[int]) -> int:
        """Drop links whose payload a worker reported lost or corrupt."""

    @abstractmethod
    def evict(self, nbytes: int) -> int:
        """Evict by policy until `nbytes` are freed or nothing evictable is left."""

    @abstractmethod
    def clear(self) -> int:
        """Drop every link (pinned ones leave lookups now, their payload when unpinned)."""

    @abstractmethod
    def clear_tenant(self, tag: bytes) -> int:
        """Drop every link of one tenant: those whose domain ends with `tag` (core/keys.py
        `tenant_tag`, `tenant_of`), with clear()'s guarantees; links of other tenants stay.
        Returns the links dropped."""

    @abstractmethod
    def drain_dropped(self) -> list[int]:
        """Link ids whose payload the workers must free now."""

    @abstractmethod
    def stats(self) -> CacheStats:
        """A snapshot of this tier's counters and gauges."""

    @abstractmethod
    def sanity_check(self) -> None:
        """Recount every invariant from scratch; AssertionError on the first one broken."""

    @abstractmethod
    def link_ids(self) -> list[int]:
        """Ids of the links held (committed and pending)."""

    @abstractmethod
    def __len__(self) -> int:
        """Links held (committed and pending)."""

    @property
    @abstractmethod
    def bytes_held(self) -> int:
        """Payload bytes of committed and pending links (what the budget bounds)."""


def record_lookup(rec: StatsRecorder, res: LookupResult) -> None:
    """Count a lookup outcome in a tier's recorder (every tier counts lookups alike)."""
    chain = len(res.plan.chain) if res.hit and res.plan is not None else 0
    rec.lookup(prompt_tokens=res.prompt_tokens, hit_tokens=res.tokens, chain_links=chain,
               miss_reason=res.miss_reason, shortened=res.shortened,
               verify_collisions=res.verify_collisions,
               choice=res.choice if chain else None)


class IdSource:
    """Link ids shared by every tier of one cache: unique across tiers, never reused.

    One worker store holds the payloads of every RAM tier under these ids, so two tiers must
    never hand out the same id; routing never looks at an id's value.
    """

    def __init__(self, first: int = 1) -> None:
        self._next = first

    def __call__(self) -> int:
        i = self._next
        self._next += 1
        return i
