"""SnapshotCache: one facade over every tier, so a new tier plugs in as one CacheTier object.

The adapter talks to this facade only. A lookup asks every tier and, with a cost model
injected, serves the hit expected to reach the first token soonest (core/choice.py: bytes moved
at measured rates plus the prefill left, a cold-exact hit preferred within a stated margin);
without one, the deepest hit. Everything handed out (lookup results, reservations, dropped
ids) carries the tier and kind that own it, and every later call (begin/end restore, commit,
abort, invalidate, clear, stats) is routed by that pair, never by the value of a link id. The
tiers share one id source, so a worker store holding the payloads of several tiers never sees
two links with one id.

Write-behind: the tiers below RAM (disk, cluster) receive RAM links through the facade, never
from the adapter. Each is a `LowerTier` (core/tiers/lower.py): committing a RAM link offers it
to every one of them (each admits by its own policy), failures, drops, clears and new prompts
fan out to them, and `take_ops` collects each one's worker operations under its name for the
handler of that name (core/tiers/handler.py); `absorb` routes the handlers' reports back.

Single-threaded like the tiers: the scheduler thread of vLLM's EngineCore process.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import msgspec
import numpy as np

from .choice import COLD_EXACT_MARGIN, Candidate, CostModel, choose, legacy_pick
from .keys import TENANT_BYTES, PromptKeys
from .stats import CacheStats, MissReason
from .tiers.base import (
    CacheTier,
    Fits,
    LinkAddr,
    LinkKind,
    LookupResult,
    Reservation,
    Tier,
    Tokens,
)
from .tiers.lower import LowerTier

__all__ = ["Moved", "SnapshotCache"]

Route = tuple[str, str]  # (tier, kind)
# moved(res) -> bytes a hit moves before its prefill resumes (what its route's rate prices);
# the adapter knows what is served in place, the default is the whole plan
Moved = Callable[[LookupResult], int]


def _plan_bytes(res: LookupResult) -> int:
    return res.plan.total_bytes if res.plan is not None else 0


class SnapshotCache:
    """The cache as the adapter sees it: an ordered list of tiers behind one set of calls.

    Order matters: the first tier is the *primary* one (it names the miss reason when nothing
    hits, and records misses). Without a cost model, on a tie in depth a later tier's hit wins
    unless it is slow (end anchors come after the tree: an anchor as deep as a tree link is
    this conversation's own state, kept for it). With `cost` (core/choice.py) hits are chosen
    by expected seconds to first token; `margin` is the fraction by which a cold-exact hit may
    cost more than a session-exact one and still be served.
    """

    def __init__(self, tiers: Sequence[CacheTier], cost: CostModel | None = None,
                 margin: float = COLD_EXACT_MARGIN, lower: Sequence[LowerTier] = ()) -> None:
        if not tiers:
            raise ValueError("a cache needs at least one tier")
        self._tiers: dict[Route, CacheTier] = {}
        for t in tiers:
            route = (t.tier.value, t.kind.value)
            if route in self._tiers:
                raise ValueError(f"two tiers for {route}")
            self._tiers[route] = t
        self._primary = tiers[0]
        self.cost = cost
        if margin < 0:
            raise ValueError("margin must be >= 0")
        self.margin = margin
        self._lower: dict[str, LowerTier] = {}
        for lt in lower:
            if lt.name in self._lower:
                raise ValueError(f"two lower tiers named {lt.name!r}")
            self._lower[lt.name] = lt

    # ------------------------------------------------------------------ routing
    def tier(self, tier: str, kind: str) -> CacheTier | None:
        """The tier holding links of `kind` in `tier`, or None."""
        return self._tiers.get((str(tier), str(kind)))

    def _route(self, tier: str, kind: str) -> CacheTier:
        t = self._tiers.get((str(tier), str(kind)))
        if t is None:
            raise KeyError(f"no tier {tier!r} of kind {kind!r}")
        return t

    def lower(self, name: str) -> LowerTier | None:
        """The write-behind of the lower tier `name` (a Tier value), or None."""
        return self._lower.get(str(name))

    def origin(self, tier: str):
        """Where the hits of `tier` read their files from (SourceOrigin), or None."""
        lt = self._lower.get(str(tier))
        return None if lt is None else lt.origin

    def routes(self) -> list[Route]:
        """Every (tier, kind) pair this cache has, in order."""
        return list(self._tiers)

    def tier_names(self) -> list[str]:
        """Distinct tiers (where bytes live), in order: what a clear may name."""
        return list(dict.fromkeys(t for t, _ in self._tiers))

    def admits(self, kind: LinkKind | str) -> bool:
        """Whether some enabled tier takes new links of this kind."""
        return any(t.enabled for (_, k), t in self._tiers.items() if k == str(kind))

    def keys(self, tokens: Sequence[int] | np.ndarray) -> PromptKeys:
        """One digest cache per prompt, with the primary tier's hasher (reused by every tier)."""
        return self._primary.keys(tokens)

    # ------------------------------------------------------------------ lookups and restores
    def lookup(self, tokens: Tokens, domain: bytes, limit: int | None = None,
               fits: Fits | None = None, moved: Moved | None = None) -> LookupResult:
        """One hit of the tiers' (pending hits included: the caller asks again), else the
        primary tier's miss. Pure, like every tier's lookup.

        With a cost model every tier's hit is a candidate and `choose` (core/choice.py) serves
        the least expected seconds to first token: `moved(res)` bytes (default: the whole plan)
        over the route's rate plus the prompt tokens left over the prefill rate, a cold-exact
        hit preferred within `margin`; the result carries the reason (`choice`), counted when
        the lookup is recorded. Without one, the deepest hit; on a tie a later tier wins unless
        it is `slow` (a disk hit only counts when it is deeper than what RAM holds).

        `shortened` says whether any tier refused (by `fits`) a link deeper than the answer:
        an end anchor refused beyond a tree hit counts, a tree link refused below an anchor
        hit does not."""
        cands: list[Candidate] = []
        primary: LookupResult | None = None
        refused = 0
        for t in self._tiers.values():
            res = t.lookup(tokens, domain, limit, fits)
            refused = max(refused, res.refused)
            if t is self._primary:
                primary = res
            if res.hit:
                cands.append(Candidate(res, t.cold_exact, t.slow))
        assert primary is not None
        if not cands:
            out = primary
        elif self.cost is None:
            out = cands[legacy_pick(cands)].res
        else:
            cost, mv = self.cost, moved or _plan_bytes
            picked = choose(cands, lambda r: cost.seconds(r.tier, mv(r),
                                                          r.prompt_tokens - r.tokens),
                            self.margin)
            out = msgspec.structs.replace(picked.res, choice=picked.reason.value)
        shortened = refused > out.tokens
        if shortened != out.shortened or refused != out.refused:
            out = msgspec.structs.replace(out, shortened=shortened, refused=refused)
        return out

    def miss(self, reason: MissReason, prompt_tokens: int, limit: int) -> LookupResult:
        """A miss the adapter decides without looking (e.g. `unkeyed_input`), answered by the
        primary tier so that recording it counts it there."""
        p = self._primary
        return LookupResult(False, 0, None, reason.value, prompt_tokens, limit,
                            tier=p.tier.value, kind=p.kind.value)

    def record_lookup(self, res: LookupResult) -> None:
        self._route(res.tier, res.kind).record_lookup(res)

    def begin_restore(self, res: LookupResult) -> bool:
        return self._route(res.tier, res.kind).begin_restore(res)

    def end_restore(self, res: LookupResult, ok: bool, seconds: float = 0.0) -> None:
        """End a restore begun with begin_restore(res). KeyError if it is not active. (The
        cost model's restore rate is observed by the caller, which knows what was moved.)"""
        if res.plan is None:
            raise KeyError("a miss has no restore to end")
        if not ok:  # its links' bytes are suspect: no lower tier copies them
            self._fan("failed", [LinkAddr(res.tier, res.kind, ref.link_id)
                                 for ref in res.plan.chain])
        self._route(res.tier, res.kind).end_restore(res.plan, ok, seconds)

    def sources(self, res: LookupResult) -> tuple[str, ...]:
        """What the worker reads before restoring this hit (files of a disk tier), else ()."""
        if res.plan is None:
            return ()
        return self._route(res.tier, res.kind).sources(res.plan)

    def cold_exact(self, res: LookupResult) -> bool:
        """Whether a request resumed from this result may still publish tree links."""
        return self._route(res.tier, res.kind).cold_exact

    # ------------------------------------------------------------------ publication
    def reserve(self, kind: LinkKind | str, tokens: Tokens, p: int, domain: bytes,
                tag: Any = None, cold_rows: int = 0) -> Reservation:
        """A pending link of `kind` in the first tier that holds that kind (new links are
        admitted in the fastest tier; slower tiers receive them from it). `cold_rows`: see
        CacheTier.reserve."""
        for (_, k), t in self._tiers.items():
            if k == str(kind):
                return t.reserve(tokens, p, domain, tag, cold_rows)
        raise KeyError(f"no tier holds links of kind {kind!r}")

    def commit(self, addr: LinkAddr, seconds: float = 0.0) -> bool:
        """Publish a pending link; a RAM link committed is offered to every lower tier."""
        ok = self._route(addr.tier, addr.kind).commit(addr.link_id, seconds)
        if ok and addr.tier == Tier.RAM:
            self._offer(addr)
        return ok

    def _offer(self, addr: LinkAddr, to: Iterable[LowerTier] | None = None) -> None:
        record = None
        if addr.kind == LinkKind.TREE:
            link_record = getattr(self._route(addr.tier, addr.kind), "link_record", None)
            record = link_record(addr.link_id) if link_record is not None else None
            if record is None:
                return  # dropped meanwhile: nothing to copy
        for lt in self._lower.values() if to is None else to:
            lt.committed(addr, record)

    def abort(self, addr: LinkAddr) -> int:
        self._fan("failed", [addr])
        return self._route(addr.tier, addr.kind).abort(addr.link_id)

    def invalidate(self, addrs: Iterable[LinkAddr]) -> int:
        """Drop links a worker reported lost, each in its own tier."""
        addrs = list(addrs)
        self._fan("failed", addrs)
        by_route: dict[Route, list[int]] = {}
        for a in addrs:
            by_route.setdefault((a.tier, a.kind), []).append(a.link_id)
        return sum(self._route(*r).invalidate(sorted(ids)) for r, ids in by_route.items())

    # ------------------------------------------------------------------ housekeeping
    def _matching(self, tier: str | None, kind: str | None) -> list[CacheTier]:
        """The tiers matching `tier` and `kind` (None: any); ValueError for a name this cache
        does not have, so a caller never believes it cleared what does not exist."""
        if tier is not None and tier not in self.tier_names():
            raise ValueError(f"unknown tier {tier!r}; this cache has {self.tier_names()}")
        kinds = {k for _, k in self._tiers}
        if kind is not None and kind not in kinds:
            raise ValueError(f"unknown kind {kind!r}; this cache has {sorted(kinds)}")
        return [t for (ti, k), t in self._tiers.items()
                if (tier is None or ti == tier) and (kind is None or k == kind)]

    def clear(self, tier: str | None = None, kind: str | None = None) -> int:
        """Drop every link of the tiers matching `tier` and `kind` (None: any). Unknown names
        raise ValueError, so a caller never believes it cleared what does not exist."""
        n = sum(t.clear() for t in self._matching(tier, kind))
        self._fan("cleared", tier, kind)
        return n

    def clear_tenant(self, tag: bytes, tier: str | None = None, kind: str | None = None) -> int:
        """Drop one tenant's links (domains ending with `tag`, core/keys.py `tenant_tag`) in
        the tiers matching `tier` and `kind` (None: any); other tenants' links stay. Unknown
        names raise ValueError, as for clear()."""
        if len(tag) != TENANT_BYTES:
            raise ValueError(f"a tenant tag has {TENANT_BYTES} bytes, got {len(tag)}")
        n = sum(t.clear_tenant(tag) for t in self._matching(tier, kind))
        self._fan("cleared_tenant", tag, tier, kind)
        return n

    def drain_dropped(self) -> list[LinkAddr]:
        """Every tier's dropped ids, addressed, for the workers to free (the lower tiers hear
        of them first, so they can still copy what they keep)."""
        out = [LinkAddr(ti, k, lid) for (ti, k), t in self._tiers.items()
               for lid in t.drain_dropped()]
        self._fan("dropped", out)
        return out

    # ------------------------------------------------------------------ write-behind
    def _fan(self, event: str, *args: Any) -> None:
        for lt in self._lower.values():
            getattr(lt, event)(*args)

    def observe(self, keys: PromptKeys, domain: bytes, res: LookupResult) -> None:
        """A new prompt before its prefill (once per request), with the lookup that answered
        it: each lower tier counts it (admission) and may ask for RAM tree links again."""
        for lt in self._lower.values():
            for lid in lt.observe(keys, domain, res):
                self._offer(LinkAddr(Tier.RAM.value, LinkKind.TREE.value, lid), (lt,))

    def capture_planned(self, addr: LinkAddr, keys: PromptKeys, domain: bytes, start: int,
                        end: int, tag: Any) -> None:
        """A tree link [start, end) is captured in the plan being built."""
        self._fan("capture_planned", addr, keys, domain, start, end, tag)

    def anchor_reserved(self, addr: LinkAddr, keys: PromptKeys, domain: bytes, end: int,
                        tag: Any) -> None:
        """An end anchor of keys[:end] was reserved; its capture is in the next plan."""
        self._fan("anchor_reserved", addr, keys, domain, end, tag)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """A measured prefill step: the hit choice's rate and the lower tiers' cost checks."""
        if self.cost is not None:
            self.cost.observe_prefill(tokens, seconds)
        self._fan("observe_prefill", tokens, seconds)

    def take_ops(self) -> dict[str, Any]:
        """This step's worker operations of every lower tier, by its name."""
        out = {}
        for name, lt in self._lower.items():
            ops = lt.take_ops()
            if ops is not None:
                out[name] = ops
        return out

    def absorb(self, reports: dict[str, Any]) -> None:
        """The worker handlers' reports, each to the lower tier of its name."""
        for name, rep in reports.items():
            lt = self._lower.get(name)
            if lt is not None:
                lt.absorb(rep)

    def absorb_shards(self, reports: dict[str, dict[int, Any]]) -> None:
        """The handler reports of the workers of tensor-parallel rank > 0, by tier and rank."""
        for name, by_rank in reports.items():
            lt = self._lower.get(name)
            if lt is not None:
                for rank, rep in sorted(by_rank.items()):
                    lt.absorb_shard(rank, rep)

    def stats(self) -> dict[Route, CacheStats]:
        return {route: t.stats() for route, t in self._tiers.items()}

    @property
    def bytes_held(self) -> int:
        return sum(t.bytes_held for t in self._tiers.values())

    def __len__(self) -> int:
        return sum(len(t) for t in self._tiers.values())

    def sanity_check(self) -> None:
        """Every tier's own invariants, plus the facade's: no link id is held by two tiers of
        one place (a worker store keys payloads by id alone)."""
        seen: dict[str, set[int]] = {}
        for (ti, _), t in self._tiers.items():
            t.sanity_check()
            ids = set(t.link_ids())
            held = seen.setdefault(ti, set())
            assert not ids & held, f"link ids held twice in tier {ti}: {sorted(ids & held)}"
            held |= ids
