"""SnapshotTree: the RAM tier's cold-exact links (tier `ram`, kind `tree`). Metadata only.

A link at cut p holds every section at p and the view rows [parent.p, p), where the parent is
the deepest link stored on the same prefix and domain when the link was reserved. The tree keeps
ids, each link's own tokens [parent.p, p), digests, parents, sizes, pins, the eviction order,
the budget and the stats. It decides everything; the worker-side LinkStore only executes copy
commands identified by the integer link ids handed out here. Everything it returns is plain,
picklable msgspec data.

Threading: a SnapshotTree is not thread-safe; it is called from one thread only (the scheduler
thread of vLLM's EngineCore process). See docs/cache-core.md.

Why one module over ~500 lines: `SnapshotTree` is one data structure (nodes, pins, pending
links, byte accounting, eviction order, indexes) whose invariants `sanity_check` recounts
together; its parts change together.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

import msgspec
import numpy as np
import psutil

from ..config import TreeConfig
from ..eviction import EvictionPolicy, make_policy
from ..keys import Hasher, PromptKeys, blake2b_128, in_tenant, tenant_of
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

__all__ = ["COMMITTED", "PENDING", "LinkRecord", "SnapshotTree"]

Key = tuple[bytes, int, bytes]  # (domain, p, digest)

PENDING = 0
COMMITTED = 1


class _Node:
    """A tree node: a domain root (p = 0) or a link. kids: child position -> {id: link}."""

    __slots__ = ("kids", "nkids", "p")

    def __init__(self, p: int) -> None:
        self.p = p
        self.kids: dict[int, dict[int, _Link]] | None = None
        self.nkids = 0

    def add_kid(self, link: _Link) -> None:
        if self.kids is None:
            self.kids = {}
        self.kids.setdefault(link.p, {})[link.id] = link
        self.nkids += 1

    def remove_kid(self, link: _Link) -> None:
        assert self.kids is not None
        at = self.kids[link.p]
        del at[link.id]
        if not at:
            del self.kids[link.p]
        self.nkids -= 1

    def iter_kids(self) -> Iterator[_Link]:
        if self.kids:
            for at in self.kids.values():
                yield from at.values()


class _Root(_Node):
    __slots__ = ("domain", "links")

    def __init__(self, domain: bytes) -> None:
        super().__init__(0)
        self.domain = domain
        self.links = 0


class _Link(_Node):
    __slots__ = (
        "digest", "domain", "doomed", "freq", "hits", "id", "last_access", "nbytes", "parent",
        "pins", "start", "state", "tag", "tokens",
    )

    def __init__(
        self, link_id: int, domain: bytes, p: int, parent: _Node, tokens: bytes, digest: bytes,
        nbytes: int, now: float, tag: object = None,
    ) -> None:
        super().__init__(p)
        self.id = link_id
        self.domain = domain
        self.start = parent.p
        self.parent = parent
        self.tokens = tokens  # own tokens [start, p) as raw int64 bytes
        self.digest = digest
        self.nbytes = nbytes
        self.state = PENDING
        self.pins = 0
        self.hits = 0
        self.last_access = now
        self.freq = 0.0  # decayed use count, kept by the eviction policy
        self.doomed = False  # detached while pinned: payload dropped when the last pin goes
        self.tag = tag  # opaque, from reserve(); only a lookup's `fits` predicate reads it

    @property
    def key(self) -> Key:
        return (self.domain, self.p, self.digest)


class LinkRecord(NamedTuple):
    """A committed link as another tier stores it (see SnapshotTree.link_record)."""

    link_id: int
    domain: bytes
    start: int
    end: int
    digest: bytes
    parent_digest: bytes  # b"" for a root link (start 0)
    tokens: bytes  # own tokens [start, end) as int64 bytes
    tag: object


class _KeyMemory:
    """A bounded FIFO set of keys with a per-domain position count, for hash-only checks."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._keys: OrderedDict[Key, None] = OrderedDict()
        self._pos: dict[bytes, Counter[int]] = {}

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, key: Key) -> None:
        if self.capacity <= 0:
            return
        if key in self._keys:
            self._keys.move_to_end(key)
            return
        self._keys[key] = None
        self._pos.setdefault(key[0], Counter())[key[1]] += 1
        while len(self._keys) > self.capacity:
            old, _ = self._keys.popitem(last=False)
            self._forget_pos(old)

    def discard(self, key: Key) -> None:
        if key in self._keys:
            del self._keys[key]
            self._forget_pos(key)

    def _forget_pos(self, key: Key) -> None:
        pos = self._pos[key[0]]
        pos[key[1]] -= 1
        if pos[key[1]] <= 0:
            del pos[key[1]]
            if not pos:
                del self._pos[key[0]]

    def match(self, keys: PromptKeys, domain: bytes, lo: int, hi: int) -> bool:
        """Whether a remembered key of `domain` lies on this prompt at a cut in (lo, hi]."""
        pos = self._pos.get(domain)
        if not pos:
            return False
        return any(lo < q <= hi and (domain, q, keys.digest(q)) in self._keys for q in pos)

    def clear(self) -> None:
        self._keys.clear()
        self._pos.clear()

    def discard_domains(self, domains: Callable[[bytes], bool]) -> None:
        """Forget every key of the domains `domains(domain)` names (a tenant's clear)."""
        for key in [k for k in self._keys if domains(k[0])]:
            self.discard(key)


class SnapshotTree(CacheTier):
    """Scheduler-side snapshot tree (see module docstring and docs/cache-core.md).

    hasher: digest function for prefix keys (default blake2b-128); tests inject a weak one.
    available_memory: () -> bytes of host memory available (default psutil).
    clock: () -> seconds, for LRU order and ages (default time.monotonic).
    next_id: the id source shared with the cache's other tiers (default: ids from 1).
    """

    tier = Tier.RAM
    kind = LinkKind.TREE
    cold_exact = True

    def __init__(
        self,
        layout: StateLayout,
        config: TreeConfig | None = None,
        hasher: Hasher | None = None,
        available_memory: Callable[[], int] | None = None,
        clock: Callable[[], float] | None = None,
        next_id: Callable[[], int] | None = None,
    ) -> None:
        self.layout = layout
        self.config = config if config is not None else TreeConfig()
        self._hasher: Hasher = hasher if hasher is not None else blake2b_128
        self._available = available_memory or (lambda: int(psutil.virtual_memory().available))
        self._clock = clock or time.monotonic
        self.policy: EvictionPolicy = make_policy(self.config.policy, self.config.cost_half_life_s)
        self._roots: dict[bytes, _Root] = {}
        self._links: dict[int, _Link] = {}
        self._index: dict[Key, list[_Link]] = {}
        # root links (start 0) of every domain by (tenant, cut, digest), and their cuts per
        # tenant: what a miss's reason consults (another domain of the same tenant holds the
        # prefix). Keyed by tenant, so a lookup never even meets another tenant's links.
        self._root_index: dict[tuple[bytes, int, bytes], list[_Link]] = {}
        self._root_pos: dict[bytes, Counter[int]] = {}
        self._doomed: dict[int, _Link] = {}
        self._active: Counter[tuple[int, ...]] = Counter()
        self._ghosts = _KeyMemory(self.config.ghost_capacity)
        self._tombs = _KeyMemory(self.config.tombstone_capacity)
        self._dropped: list[int] = []
        self._next_id = next_id if next_id is not None else IdSource()
        self._bytes_held = 0
        self._bytes_pending = 0
        self._n_pending = 0
        self._n_pinned = 0
        self._bytes_pinned = 0
        self._rec = StatsRecorder()

    # ------------------------------------------------------------------ queries
    @property
    def enabled(self) -> bool:
        return self.config.enabled

    def keys(self, tokens: Sequence[int] | np.ndarray) -> PromptKeys:
        """Digest cache for one prompt; pass it to lookup/reserve to hash a prompt only once."""
        return PromptKeys(tokens, self._hasher)

    def _as_keys(self, tokens: Tokens) -> PromptKeys:
        if isinstance(tokens, PromptKeys) and tokens.hasher is self._hasher:
            return tokens
        if isinstance(tokens, PromptKeys):
            return PromptKeys(tokens.tokens, self._hasher)
        return PromptKeys(tokens, self._hasher)

    def __len__(self) -> int:
        """Links in the tree (committed and pending; not counting doomed pinned ones)."""
        return len(self._links)

    @property
    def bytes_held(self) -> int:
        """Payload bytes of committed and pending links (what the budget bounds)."""
        return self._bytes_held

    def has(self, link_id: int) -> bool:
        return link_id in self._links

    def _deepest(
        self, keys: PromptKeys, root: _Root, limit: int, committed_only: bool,
        fits: Fits | None = None,
    ) -> tuple[_Link | None, int, int]:
        """Deepest link under `root` whose whole token chain equals keys.tokens[:p], p <= limit.

        Walks down from the root through links whose own tokens match the prompt, so every link
        on the returned chain has been compared token for token. A link that matches but does
        not `fits` is neither taken nor descended into: every link of the returned chain fits.
        Returns (link, collisions, deepest cut refused by fits, 0 if none).
        """
        best: _Link | None = None
        collisions = 0
        refused = 0
        dom = root.domain
        index = self._index
        raw = keys.raw
        memo = keys.memo  # digests already computed for this prompt
        digest = keys.digest
        stack: list[_Node] = [root]
        while stack:
            node = stack.pop()
            if not node.kids:
                continue
            for q in node.kids:
                if q > limit:
                    continue
                d = memo.get(q)
                bucket = index.get((dom, q, d if d is not None else digest(q)))
                if bucket is None:
                    continue
                for child in bucket:
                    if child.parent is not node:
                        continue
                    if committed_only and child.state != COMMITTED:
                        continue
                    if raw[child.start * 8 : q * 8] != child.tokens:
                        collisions += 1
                        continue
                    if fits is not None and not fits(q, child.tag):
                        refused = max(refused, q)
                        continue
                    if best is None or q > best.p:
                        best = child
                    if child.kids:
                        stack.append(child)
        return best, collisions, refused

    def _tenant_domain_has(self, keys: PromptKeys, domain: bytes, limit: int) -> bool:
        """Whether another domain *of the same tenant* (another route, adapter or rank) holds
        a committed root link on this prompt. Another tenant's links are never consulted: a
        miss must not tell a tenant whether another one holds a prefix (docs/security.md)."""
        raw = keys.raw
        tenant = tenant_of(domain)
        for q in self._root_pos.get(tenant, ()):
            if q > limit:
                continue
            for link in self._root_index.get((tenant, q, keys.digest(q)), ()):
                if link.domain != domain and link.state == COMMITTED and (
                    raw[: q * 8] == link.tokens
                ):
                    return True
        return False

    def _plan(self, link: _Link) -> RestorePlan:
        chain: list[LinkRef] = []
        node: _Node = link
        while isinstance(node, _Link):
            chain.append(LinkRef(node.id, node.start, node.p))
            node = node.parent
        chain.reverse()
        parts = {s.name: s.nbytes for s in self.layout.sections}
        for v in self.layout.views:
            parts[v.name] = v.bytes_per_row * sum(
                self.layout.view_rows(r.start, r.end) for r in chain)
        return RestorePlan(tuple(chain), link.p, parts, sum(parts.values()))

    def lookup(
        self, tokens: Tokens, domain: bytes, limit: int | None = None, fits: Fits | None = None
    ) -> LookupResult:
        """Deepest committed link whose tokens are a prefix of tokens[:limit], and its plan.

        Pure: no stats, no LRU touch, no pins (vLLM may ask several times for one request).
        The adapter passes limit = len(prompt) - 1 so a hit always leaves a token to prefill.
        `fits(p, tag)` refuses links whose state depends on more than the tokens before p (with
        MTP, the draft head's row at p - 1 reads the token at p): the chain ends before such a
        link, and the result says `shortened` when the refused link was deeper than the hit.
        """
        keys = self._as_keys(tokens)
        n = len(keys)
        lim = n if limit is None else max(0, min(int(limit), n))
        if not self.config.enabled:
            return LookupResult(False, 0, None, MissReason.DISABLED.value, n, lim)
        root = self._roots.get(domain)
        best, collisions, refused = (None, 0, 0)
        if root is not None:
            best, collisions, refused = self._deepest(keys, root, lim, True, fits)
        shortened = refused > (best.p if best is not None else 0)
        if best is not None:
            plan = self._plan(best)
            return LookupResult(True, best.p, plan, None, n, lim, collisions,
                                shortened=shortened, refused=refused)
        if collisions:
            reason = MissReason.VERIFY_FAILED
        elif self._ghosts.match(keys, domain, 0, lim):
            reason = MissReason.EVICTED
        elif self._tenant_domain_has(keys, domain, lim):
            reason = MissReason.DOMAIN_MISMATCH
        else:
            reason = MissReason.NO_PREFIX
        return LookupResult(False, 0, None, reason.value, n, lim, collisions,
                            shortened=shortened, refused=refused)

    # ------------------------------------------------------------------ restores
    def record_lookup(self, res: LookupResult) -> None:
        """Count a lookup outcome without restoring (e.g. the adapter chose not to use it).

        A `shortened` lookup (a deeper link refused by `fits`) is counted so a user sees the
        reuse the predicate costs.
        """
        record_lookup(self._rec, res)

    def begin_restore(self, res: LookupResult) -> bool:
        """Record the lookup; on a hit whose chain is still intact, pin the chain and return True.

        If the chain changed since lookup (evicted, cleared, invalidated), the lookup is recorded
        as an `evicted` miss and False is returned: the adapter must prefill cold.
        """
        if not res.hit or res.plan is None:
            self.record_lookup(res)
            return False
        links: list[_Link] = []
        for ref in res.plan.chain:
            link = self._links.get(ref.link_id)
            if link is None or link.state != COMMITTED or (link.start, link.p) != (
                ref.start, ref.end
            ):
                self.record_lookup(
                    msgspec.structs.replace(
                        res, hit=False, tokens=0, plan=None,
                        miss_reason=MissReason.EVICTED.value,
                    )
                )
                return False
            links.append(link)
        self.record_lookup(res)
        now = self._clock()
        for link in links:
            self._pin(link)
            link.hits += 1
            self.policy.accessed(link, now)
        self._active[res.plan.link_ids] += 1
        return True

    def end_restore(self, plan: RestorePlan, ok: bool, seconds: float = 0.0) -> None:
        """Unpin a chain pinned by begin_restore; count the restore (served only when ok).

        Raises KeyError for a plan that is not active (never begun, or already ended).
        """
        ids = plan.link_ids
        if self._active[ids] <= 0:
            del self._active[ids]
            raise KeyError(f"restore plan {ids} is not active")
        self._active[ids] -= 1
        if self._active[ids] == 0:
            del self._active[ids]
        for lid in ids:
            link = self._links.get(lid) or self._doomed.get(lid)
            if link is not None:
                self._unpin(link)
        s = self._rec.s
        if ok:
            s.restores += 1
            s.tokens_served += plan.tokens
            s.restore_bytes += plan.total_bytes * self.config.shards  # every rank's copy
            s.restore_seconds.observe(seconds)
        else:
            s.restores_failed += 1

    def _pin(self, link: _Link) -> None:
        if link.pins == 0:
            self._n_pinned += 1
            self._bytes_pinned += link.nbytes
            self.policy.discard(link)
        link.pins += 1

    def _unpin(self, link: _Link) -> None:
        link.pins -= 1
        if link.pins > 0:
            return
        self._n_pinned -= 1
        self._bytes_pinned -= link.nbytes
        if link.doomed:
            del self._doomed[link.id]
            self._dropped.append(link.id)
        else:
            self._refresh(link)

    # ------------------------------------------------------------------ captures
    def reserve(self, tokens: Tokens, p: int, domain: bytes, tag: object = None,
                cold_rows: int = 0) -> Reservation:
        """Reserve a pending link at cut p of `tokens` (a prompt or a prefix of it, len >= p).

        The parent is the deepest committed or pending link on the same prefix and domain; the
        new link will hold view rows [parent.p, p). Refusals are counted by SkipReason; a key
        that is already present returns existing_id and no new link (a dedup, not a skip; the
        existing link keeps its tag). `tag` is kept for lookups' `fits` predicate.
        """
        keys = self._as_keys(tokens)
        if not 1 <= p <= len(keys):
            raise ValueError(f"cut {p} outside 1..{len(keys)}")
        if not isinstance(domain, bytes):
            raise TypeError("domain must be bytes (see make_domain)")
        s = self._rec.s
        s.reservations += 1
        if not self.config.enabled:
            return self._refuse(None, None, 0, p, SkipReason.DISABLED, 0)
        root = self._roots.get(domain)
        parent: _Link | None = None
        if root is not None:
            parent, collisions, _ = self._deepest(keys, root, p, committed_only=False)
            s.verify_collisions += collisions
        start = parent.p if parent is not None else 0
        parent_id = parent.id if parent is not None else None
        if parent is not None and parent.p == p:
            s.dedups += 1
            pid = parent.parent.id if isinstance(parent.parent, _Link) else None
            return Reservation(None, pid, parent.start, p, None, parent.id, parent.nbytes)
        key: Key = (domain, p, keys.digest(p))
        nbytes = self.config.shards * self.layout.link_bytes(self.layout.view_rows(start, p))
        cfg = self.config
        if self._tombs.match(keys, domain, start, p - 1):
            return self._refuse(key, parent_id, start, p, SkipReason.PARENT_REFUSED, nbytes)
        if cfg.max_link_bytes and nbytes > cfg.max_link_bytes:
            return self._refuse(key, parent_id, start, p, SkipReason.TOO_LARGE, nbytes)
        if nbytes > cfg.budget_bytes:
            return self._refuse(key, parent_id, start, p, SkipReason.BUDGET, nbytes)
        if self._available() - nbytes < cfg.memory_floor_bytes:
            return self._refuse(key, parent_id, start, p, SkipReason.MEMORY_GUARD, nbytes)
        if self._bytes_held + nbytes > cfg.budget_bytes:
            # Cheap bound first: pending and restore-pinned bytes cannot be freed now.
            stuck = self._bytes_pending + self._bytes_pinned
            if cfg.budget_bytes - stuck < nbytes or not self._make_room(nbytes, parent):
                return self._refuse(key, parent_id, start, p, SkipReason.BUDGET, nbytes)
        root = self._roots.get(domain)  # eviction above may have removed an emptied root
        if root is None:
            root = self._roots[domain] = _Root(domain)
        pnode: _Node = parent if parent is not None else root
        link = _Link(
            self._next_id(), root.domain, p, pnode, keys.token_bytes(start, p), key[2], nbytes,
            self._clock(), tag,
        )
        self._attach(link, root)
        self._tombs.discard(key)
        self._ghosts.discard(key)
        return Reservation(link.id, parent_id, start, p, None, None, nbytes)

    def _refuse(
        self, key: Key | None, parent_id: int | None, start: int, p: int, reason: SkipReason,
        nbytes: int,
    ) -> Reservation:
        self._rec.skip(reason.value)
        if key is not None:
            self._tombs.add(key)
        return Reservation(None, parent_id, start, p, reason.value, None, nbytes)

    def _attach(self, link: _Link, root: _Root) -> None:
        self._links[link.id] = link
        self._index.setdefault(link.key, []).append(link)
        parent = link.parent
        parent.add_kid(link)
        if isinstance(parent, _Link):
            self.policy.discard(parent)  # no longer a leaf
        else:
            tenant = tenant_of(link.domain)
            self._root_index.setdefault((tenant, link.p, link.digest), []).append(link)
            self._root_pos.setdefault(tenant, Counter())[link.p] += 1
        root.links += 1
        self._bytes_held += link.nbytes
        self._bytes_pending += link.nbytes
        self._n_pending += 1

    def commit(self, link_id: int, seconds: float = 0.0) -> bool:
        """Publish a pending link after its step succeeded and its copy is confirmed.

        Returns False (and changes nothing) for an unknown or already committed id, e.g. a link
        dropped by clear() or by an aborted ancestor while its step ran. A link whose parent is
        still pending becomes visible to lookups when the parent commits.
        """
        link = self._links.get(link_id)
        if link is None or link.state != PENDING:
            return False
        link.state = COMMITTED
        self._n_pending -= 1
        self._bytes_pending -= link.nbytes
        self.policy.accessed(link, self._clock())
        s = self._rec.s
        s.captures += 1
        s.capture_bytes += link.nbytes
        s.capture_seconds.observe(seconds)
        self._refresh(link)
        return True

    def adopt(self, tokens: Tokens, domain: bytes, chain: Sequence[LinkRef],
              tags: Sequence[object] | None = None) -> list[int]:
        """Take links whose payloads a worker already holds sealed (a disk hit staged into its
        store) as committed links; returns the ids adopted, root first.

        Why: a disk hit is promoted into RAM, so the next request on the same prefix does not
        read the files again. A link is adopted only where the tree would have put it: its
        rows must start where the deepest link already on its prefix ends (or at 0); a link
        the tree already holds at that cut is kept instead (not adopted), and the walk stops
        at the first link that cannot be adopted (rows from another parent, or no room within
        the budget and the memory guard), so adopted links always form a chain without holes.
        The caller must drop the payloads of the ids not returned. `tags`: each link's draft
        tag as its file carried it (a speculative route; what `reserve` would have kept).
        """
        keys = self._as_keys(tokens)
        adopted: list[int] = []
        if not self.config.enabled:
            return adopted
        cfg = self.config
        for i, ref in enumerate(chain):
            if ref.link_id in self._links or not 0 <= ref.start < ref.end <= len(keys):
                break
            root = self._roots.get(domain)
            parent: _Link | None = None
            if root is not None:
                parent, _, _ = self._deepest(keys, root, ref.end, committed_only=False)
            if parent is not None and parent.p == ref.end:
                continue  # held already: the next link's rows start at it
            if (parent.p if parent is not None else 0) != ref.start:
                break
            nbytes = self.config.shards * self.layout.link_bytes(
                self.layout.view_rows(ref.start, ref.end))
            if (nbytes > cfg.budget_bytes
                    or (cfg.max_link_bytes and nbytes > cfg.max_link_bytes)
                    or self._available() - nbytes < cfg.memory_floor_bytes
                    or (self._bytes_held + nbytes > cfg.budget_bytes
                        and not self._make_room(nbytes, parent))):
                break
            root = self._roots.get(domain)
            if root is None:
                root = self._roots[domain] = _Root(domain)
            pnode: _Node = parent if parent is not None else root
            link = _Link(ref.link_id, root.domain, ref.end, pnode,
                         keys.token_bytes(ref.start, ref.end), keys.digest(ref.end), nbytes,
                         self._clock(), tags[i] if tags is not None else None)
            self._attach(link, root)
            link.state = COMMITTED
            self._n_pending -= 1
            self._bytes_pending -= nbytes
            self.policy.accessed(link, self._clock())
            self._refresh(link)
            self._tombs.discard(link.key)
            self._ghosts.discard(link.key)
            self._rec.s.promoted += 1
            adopted.append(ref.link_id)
        return adopted

    def abort(self, link_id: int) -> int:
        """Drop a pending link and all its descendants (their step failed or was preempted).

        Their keys are remembered so that later cuts on the same prefix are refused
        (`parent_refused`). Returns the number of links dropped (0 for unknown/committed ids).
        """
        link = self._links.get(link_id)
        if link is None or link.state != PENDING:
            return 0
        dropped = self._drop_subtree(link, remember=self._tombs)
        self._rec.s.aborts += dropped
        return dropped

    def invalidate(self, link_ids: Sequence[int]) -> int:
        """Drop links (and descendants) whose payload the worker reported lost or corrupt."""
        n = 0
        for lid in link_ids:
            link = self._links.get(lid)
            if link is not None:
                n += self._drop_subtree(link, remember=None)
        self._rec.s.invalidated += n
        return n

    # ------------------------------------------------------------------ eviction
    def _refresh(self, link: _Link) -> None:
        """Keep the policy's candidate set = committed, unpinned leaves."""
        cand = link.state == COMMITTED and link.nkids == 0 and link.pins == 0 and not link.doomed
        if cand:
            if link.id not in self.policy:
                self.policy.add(link)
        else:
            self.policy.discard(link)

    def _make_room(self, nbytes: int, keep: _Link | None) -> bool:
        budget = self.config.budget_bytes
        while self._bytes_held + nbytes > budget:
            victim = self.policy.victim(exclude=keep)
            if victim is None:
                return False
            self._evict(victim)  # type: ignore[arg-type]
        return True

    def _evict(self, link: _Link) -> None:
        s = self._rec.s
        s.evictions += 1
        s.evicted_bytes += link.nbytes
        self._ghosts.add(link.key)
        self._detach(link)

    def evict(self, nbytes: int) -> int:
        """Evict leaves by policy until at least `nbytes` are freed (or no candidate is left)."""
        freed = 0
        while freed < nbytes:
            victim = self.policy.victim()
            if victim is None:
                break
            freed += victim.nbytes
            self._evict(victim)  # type: ignore[arg-type]
        return freed

    def set_budget(self, budget_bytes: int) -> int:
        """Change the budget at run time; evicts down to it. Returns the bytes evicted."""
        if budget_bytes < 0:
            raise ValueError("budget must be >= 0")
        self.config = msgspec.structs.replace(self.config, budget_bytes=budget_bytes)
        excess = self._bytes_held - budget_bytes
        return self.evict(excess) if budget_bytes and excess > 0 else 0

    def _detach(self, link: _Link) -> None:
        """Remove a leaf from every structure; its payload is dropped now or when unpinned."""
        assert link.nkids == 0
        self.policy.discard(link)
        bucket = self._index[link.key]
        bucket.remove(link)
        if not bucket:
            del self._index[link.key]
        parent = link.parent
        parent.remove_kid(link)
        if isinstance(parent, _Link):
            self._refresh(parent)
        else:
            tenant = tenant_of(link.domain)
            rk = (tenant, link.p, link.digest)
            rb = self._root_index[rk]
            rb.remove(link)
            if not rb:
                del self._root_index[rk]
            pos = self._root_pos[tenant]
            pos[link.p] -= 1
            if pos[link.p] == 0:
                del pos[link.p]
                if not pos:
                    del self._root_pos[tenant]
        root = self._roots[link.domain]
        root.links -= 1
        if root.links == 0:
            del self._roots[link.domain]
        del self._links[link.id]
        self._bytes_held -= link.nbytes
        if link.state == PENDING:
            self._n_pending -= 1
            self._bytes_pending -= link.nbytes
        if link.pins > 0:
            link.doomed = True
            self._doomed[link.id] = link
        else:
            self._dropped.append(link.id)

    def _drop_subtree(self, link: _Link, remember: _KeyMemory | None) -> int:
        order: list[_Link] = []
        stack = [link]
        while stack:
            node = stack.pop()
            order.append(node)
            stack.extend(node.iter_kids())
        for node in reversed(order):  # children before parents
            if remember is not None:
                remember.add(node.key)
            self._detach(node)
        return len(order)

    def clear(self) -> int:
        """Drop every link; links pinned by an active restore are dropped when released.

        Also forgets the evicted/refused key memories. Returns the number of links removed.
        """
        n = 0
        for root in list(self._roots.values()):
            for kid in list(root.iter_kids()):
                n += self._drop_subtree(kid, remember=None)
        self._ghosts.clear()
        self._tombs.clear()
        self._rec.s.cleared += n
        return n

    def clear_tenant(self, tag: bytes) -> int:
        """Drop every link of the tenant `tag` (core/keys.py `tenant_tag`), in all its domains,
        with the same guarantees as clear(): a whole domain goes, children before parents, so
        no link of another domain loses a parent; links pinned by an active restore leave
        lookups now and hand their payload out when released. The tenant's evicted/refused
        key memories are forgotten too. Returns the number of links removed."""
        ours = in_tenant(tag)
        n = 0
        for root in [r for d, r in self._roots.items() if ours(d)]:
            for kid in list(root.iter_kids()):
                n += self._drop_subtree(kid, remember=None)
        self._ghosts.discard_domains(ours)
        self._tombs.discard_domains(ours)
        self._rec.s.cleared += n
        return n

    def drain_dropped(self) -> list[int]:
        """Link ids whose payload the worker must now free (evicted, aborted, cleared, ...)."""
        out, self._dropped = self._dropped, []
        return out

    # ------------------------------------------------------------------ stats
    def stats(self) -> CacheStats:
        snap = self._rec.snapshot()
        snap.links = len(self._links) - self._n_pending
        snap.links_pending = self._n_pending
        snap.links_pinned = self._n_pinned
        snap.bytes_held = self._bytes_held
        snap.bytes_pending = self._bytes_pending
        snap.budget_bytes = self.config.budget_bytes
        snap.domains = len(self._roots)
        return snap

    # ------------------------------------------------------------------ introspection
    def link_info(self, link_id: int) -> LinkRef | None:
        """The rows [start, end) of a live link, or None."""
        link = self._links.get(link_id)
        return None if link is None else LinkRef(link.id, link.start, link.p)

    def link_record(self, link_id: int) -> LinkRecord | None:
        """What a copy of a committed link elsewhere (a link file) must name: its domain, rows,
        own tokens, digest and its parent's; None for an unknown or pending link."""
        link = self._links.get(link_id)
        if link is None or link.state != COMMITTED:
            return None
        parent = link.parent
        return LinkRecord(link.id, link.domain, link.start, link.p, link.digest,
                          parent.digest if isinstance(parent, _Link) else b"", link.tokens,
                          link.tag)

    def parent_of(self, link_id: int) -> int | None:
        link = self._links.get(link_id)
        if link is None:
            raise KeyError(link_id)
        return link.parent.id if isinstance(link.parent, _Link) else None

    def is_committed(self, link_id: int) -> bool:
        link = self._links.get(link_id)
        return link is not None and link.state == COMMITTED

    def link_ids(self) -> list[int]:
        return list(self._links)

    def sanity_check(self) -> None:
        """Recount every structure from scratch and compare (tests call it after each step).

        Checks the byte and count gauges, the budget, parent/child and index consistency,
        that the eviction candidates are exactly the committed unpinned leaves, that no
        committed link hangs under a pending one unseen by lookups' rules, and that every
        doomed link is still pinned (its payload must not have been handed out yet).
        """
        links = self._links
        held = sum(link.nbytes for link in links.values())
        pending = [link for link in links.values() if link.state == PENDING]
        assert held == self._bytes_held, (held, self._bytes_held)
        assert sum(link.nbytes for link in pending) == self._bytes_pending
        assert len(pending) == self._n_pending
        pinned = [link for link in (*links.values(), *self._doomed.values()) if link.pins > 0]
        assert len(pinned) == self._n_pinned, (len(pinned), self._n_pinned)
        assert sum(link.nbytes for link in pinned) == self._bytes_pinned
        assert self._bytes_held <= self.config.budget_bytes or not self.config.enabled
        for link in self._doomed.values():
            assert link.doomed and link.pins > 0 and link.id not in links
        per_root: Counter[bytes] = Counter()
        for link in links.values():
            assert not link.doomed
            per_root[link.domain] += 1
            parent = link.parent
            if isinstance(parent, _Link):
                assert parent.id in links, f"link {link.id} outlives its parent {parent.id}"
                assert parent.domain == link.domain and parent.p == link.start < link.p
            else:
                assert parent is self._roots.get(link.domain) and link.start == 0
            assert parent.kids is not None and parent.kids[link.p].get(link.id) is link
            assert link in self._index[link.key]
            assert len(link.tokens) == (link.p - link.start) * 8
            leaf = link.state == COMMITTED and link.nkids == 0 and link.pins == 0
            assert (link.id in self.policy) == leaf, f"link {link.id}: candidate != leaf"
        for node in (*self._roots.values(), *links.values()):
            assert node.nkids == sum(len(at) for at in (node.kids or {}).values())
        assert {d: r.links for d, r in self._roots.items()} == dict(per_root)
        assert sum(len(b) for b in self._index.values()) == len(links)
        assert sum(sum(c.values()) for c in self._root_pos.values()) == sum(
            len(b) for b in self._root_index.values())
        for (tenant, _, _), bucket in self._root_index.items():
            assert all(tenant_of(link.domain) == tenant and link.start == 0 for link in bucket)
        for ids in self._active:
            for lid in ids:
                link = links.get(lid) or self._doomed.get(lid)
                assert link is None or link.pins > 0, f"link {lid} of an active restore unpinned"
