"""Which hit serves a request: the one expected to reach the first token soonest.

Several tiers may hold a verified hit for one prompt: a tree link whose attention K/V vLLM's
block pool serves in place, a tree link whose rows are copied, an end anchor (every row
copied), a file on disk, a chain on another replica. Depth alone is a poor rule between them.
Forks of one conversation showed why: N requests extending a finished head each resumed from
the head's end anchor, one token deeper than the tree link at the head's last cut, and each
copied the whole prefix's K/V into blocks of its own (peak K/V 2.67x vLLM's own prefix caching)
for one token of prefill saved, and from a session-exact state where a cold-exact one was at
hand.

So each candidate is priced as an expected time to first token:

    seconds = bytes it moves / its route's rate  +  (prompt tokens - depth) * prefill s/token

(`CostModel`: rates measured at run time, EWMA over priors), and the cheapest wins, except that
a cold-exact hit is preferred to a session-exact one when it costs at most `COLD_EXACT_MARGIN`
more: a cold-exact state is the one a cold prefill computes, it lets the request publish tree
links of its own, and near the boundary the two are equally good by the estimate anyway.

The choice only ever picks among verified hits: it never changes what a hit restores. Pure: no
clock, no I/O (rates are observed by the caller, or pinned by tests).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from enum import StrEnum
from typing import NamedTuple

from .tiers.base import LookupResult, Tier

__all__ = [
    "COLD_EXACT_MARGIN",
    "Candidate",
    "Choice",
    "ChoiceReason",
    "CostModel",
    "choose",
]

COLD_EXACT_MARGIN = 0.10
"""A cold-exact hit wins over a cheaper session-exact one when its expected seconds to first
token are at most this fraction above the session-exact hit's. 10%: the estimate is made of
EWMA rates that move by more than that between steps on a loaded machine, so inside it the
two are equally good by what can be measured, and the cold-exact one is the better state
(bit-equal to a cold prefill, and its request keeps publishing tree links)."""


class ChoiceReason(StrEnum):
    """Why the facade served the hit it did (counted under the route it chose)."""

    ONLY = "only"  # one tier had a hit
    DEEPEST = "deepest"  # the cheapest hit is also the one depth alone picks
    # a hit depth alone would not pick (shallower, or on a slower tier) is expected to reach
    # the first token sooner
    CHEAPER = "cheaper"
    # a cold-exact hit within COLD_EXACT_MARGIN of a cheaper session-exact one
    COLD_EXACT = "cold_exact"


# Rates until the first measurement of a route (bytes per second): deliberately modest, so a
# big copy is not mistaken for free before anything was measured. RAM: a host-to-device copy
# (CPU memcpy or PCIe) is several GB/s; disk: ReadCost's prior (core/disk/cost.py); cluster: a
# fetch over a 1 Gbit/s network.
DEFAULT_RATES: dict[str, float] = {Tier.RAM.value: 2e9, Tier.DISK.value: 1e9,
                                   Tier.CLUSTER.value: 1.25e8}
DEFAULT_PREFILL_TOKENS_PER_S = 2000.0  # ReadCost's prior: a large model at long contexts


class CostModel:
    """Measured rates behind a hit's expected seconds to first token (EWMA over priors).

    `observe_restore(tier, nbytes, seconds)`: a restore of that route moved `nbytes` in
    `seconds`; `observe_prefill(tokens, seconds)`: a prefill step forwarded `tokens`. The first
    measurement replaces a prior outright (a prior is a guess, not a sample). `pinned`: the
    rates never move (tests pin them so a choice cannot depend on timing noise).
    """

    def __init__(self, rates: Mapping[str, float] | None = None,
                 prefill_tokens_per_s: float = DEFAULT_PREFILL_TOKENS_PER_S,
                 alpha: float = 0.2, pinned: bool = False) -> None:
        merged = {**DEFAULT_RATES, **(rates or {})}
        if any(r <= 0 for r in merged.values()) or prefill_tokens_per_s <= 0:
            raise ValueError("rates must be > 0")
        if not 0 < alpha <= 1:
            raise ValueError("0 < alpha <= 1")
        self.rates: dict[str, float] = {k: float(v) for k, v in merged.items()}
        self.prefill_tokens_per_s = float(prefill_tokens_per_s)
        self.alpha = alpha
        self.pinned = pinned
        self._seen: dict[str, int] = {}

    def _mix(self, key: str, old: float, new: float) -> float:
        seen = self._seen.get(key, 0)
        self._seen[key] = seen + 1
        return new if seen == 0 else (1 - self.alpha) * old + self.alpha * new

    def observe_restore(self, tier: str, nbytes: int, seconds: float) -> None:
        """A restore from `tier` moved `nbytes` in `seconds` (ignored when empty or pinned)."""
        if self.pinned or nbytes <= 0 or seconds <= 0:
            return
        tier = str(tier)
        old = self.rates.get(tier, DEFAULT_RATES[Tier.RAM.value])
        self.rates[tier] = self._mix(tier, old, nbytes / seconds)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """A prefill step forwarded `tokens` of one prompt in `seconds`."""
        if self.pinned or tokens <= 0 or seconds <= 0:
            return
        self.prefill_tokens_per_s = self._mix("prefill", self.prefill_tokens_per_s,
                                              tokens / seconds)

    def move_seconds(self, tier: str, nbytes: int) -> float:
        rate = self.rates.get(str(tier), DEFAULT_RATES[Tier.RAM.value])
        return max(0, nbytes) / rate

    def prefill_seconds(self, tokens: int) -> float:
        return max(0, tokens) / self.prefill_tokens_per_s

    def seconds(self, tier: str, moved_bytes: int, tokens_left: int) -> float:
        """Expected seconds to first token of a hit that moves `moved_bytes` over `tier`'s
        route and leaves `tokens_left` prompt tokens to prefill."""
        return self.move_seconds(tier, moved_bytes) + self.prefill_seconds(tokens_left)

    def snapshot(self) -> dict[str, float]:
        """The current rates (for stats and logs)."""
        out = {f"{k}_bytes_per_s": v for k, v in self.rates.items()}
        out["prefill_tokens_per_s"] = self.prefill_tokens_per_s
        return out


class Candidate(NamedTuple):
    """One tier's verified hit, with what the choice needs to know about its tier."""

    res: LookupResult
    cold_exact: bool
    slow: bool  # a slower tier (disk, cluster): loses ties to a faster one


class Choice(NamedTuple):
    res: LookupResult
    reason: ChoiceReason
    seconds: float  # the chosen hit's expected seconds to first token


def legacy_pick(cands: Sequence[Candidate]) -> int:
    """The index depth alone picks: the deepest, a later tier on a tie unless it is slow (the
    facade's rule before costs)."""
    best = 0
    for i in range(1, len(cands)):
        c, b = cands[i], cands[best]
        if c.res.tokens > b.res.tokens or (c.res.tokens == b.res.tokens and not c.slow):
            best = i
    return best


def choose(cands: Sequence[Candidate], cost: Callable[[LookupResult], float],
           margin: float = COLD_EXACT_MARGIN) -> Choice:
    """The candidate with the least expected seconds to first token (`cost`), a cold-exact one
    preferred within `margin` (a fraction) of a cheaper session-exact one; ties go to the
    cold-exact, then the deeper, then the faster tier, then the earlier one. Deterministic for
    given costs. ValueError on no candidates."""
    if not cands:
        raise ValueError("no candidates")
    costs = [float(cost(c.res)) for c in cands]
    legacy = legacy_pick(cands)
    if len(cands) == 1:
        return Choice(cands[0].res, ChoiceReason.ONLY, costs[0])

    def rank(i: int) -> tuple[float, bool, int, bool, int]:
        c = cands[i]
        return (costs[i], not c.cold_exact, -c.res.tokens, c.slow, i)

    best = min(range(len(cands)), key=rank)
    reason = ChoiceReason.DEEPEST if best == legacy else ChoiceReason.CHEAPER
    if not cands[best].cold_exact:
        cold = [i for i, c in enumerate(cands) if c.cold_exact]
        if cold:
            alt = min(cold, key=rank)
            if costs[alt] <= costs[best] * (1 + margin):
                best, reason = alt, ChoiceReason.COLD_EXACT
    return Choice(cands[best].res, reason, costs[best])
