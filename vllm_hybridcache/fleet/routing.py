"""Which replica serves a request: the owner of its conversation, bounded by load.

Pure policy (no Ray, no HTTP), so it is unit-tested on its own; the front (front.py) calls it.

Why route at all with a cluster tier: a turn that lands on the replica holding its
conversation's deepest link is a local RAM hit; elsewhere it costs a transfer (and, before the
owner published its newest links, part of a re-prefill). So the front remembers, per
conversation, which replica served its last turn:

- a **session** (the client's `x-session-id` header) is owned by the replica that served it
  last;
- without a session, **prefix affinity**: a request's leading content is hashed at growing
  depths (`prefix_keys`: each chat message, or chunks of a plain prompt), and the replica that
  served the deepest known depth owns the request. The next turn of a chat repeats the previous
  turn's messages, so its deepest known key is that turn's full message list.

**Load bound**: the owner is passed over when it has `max_imbalance` or more requests in flight
beyond the least loaded live replica, so one hot conversation cannot starve a replica; the
request then goes to the least loaded one (ties in turn). A replica marked down is never chosen
and its conversations move (counted as `owner_down`).
"""

from __future__ import annotations

import enum
import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

PROMPT_CHARS = 1024
"""Characters of a text prompt per prefix key (plain completions)."""
PROMPT_IDS = 256
"""Token ids of a token-id prompt per prefix key."""


class Policy(enum.StrEnum):
    AFFINITY = "affinity"
    ROUND_ROBIN = "round_robin"


class Outcome(enum.StrEnum):
    """How one routing decision went (counted; `owner` over the ones with an owner is the
    share of turns routed to their owner)."""

    OWNER = "owner"            # the conversation's owner served it
    PASSED_OVER = "passed_over"  # owner too loaded: the least loaded replica served it
    OWNER_DOWN = "owner_down"    # owner marked down: the least loaded replica served it
    NO_OWNER = "no_owner"        # a first turn (nothing known): least loaded
    FORCED = "forced"            # the client named a live replica (x-hybridcache-replica)
    ROUND_ROBIN = "round_robin"  # policy round_robin


def _seed(body: dict[str, Any]) -> Any:
    """What must be equal for two requests to share a prefix: model, tenant, tools."""
    return hashlib.sha256(json.dumps(
        [body.get("model"), body.get("cache_salt"), body.get("tools")],
        sort_keys=True, default=str).encode())


def prefix_keys(body: Any) -> list[bytes]:
    """Hashes of a request's leading content at growing depths (empty when it has none that
    can be named, e.g. a batch of prompts): one per chat message, else one per
    PROMPT_CHARS characters / PROMPT_IDS token ids of the prompt."""
    if not isinstance(body, dict):
        return []
    h = _seed(body)
    keys: list[bytes] = []
    messages = body.get("messages")
    if isinstance(messages, list):
        for m in messages:
            h.update(json.dumps(m, sort_keys=True, default=str).encode())
            h.update(b"\x00")
            keys.append(h.copy().digest()[:16])
        return keys
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if isinstance(prompt, str):
        for i in range(0, len(prompt), PROMPT_CHARS):
            h.update(prompt[i:i + PROMPT_CHARS].encode())
            keys.append(h.copy().digest()[:16])
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        for i in range(0, len(prompt), PROMPT_IDS):
            h.update(json.dumps(prompt[i:i + PROMPT_IDS]).encode())
            keys.append(h.copy().digest()[:16])
    return keys


@dataclass(frozen=True)
class Decision:
    replica: str
    outcome: Outcome
    owner: str | None


@dataclass
class RoutingStats:
    """Cumulative counts of the front's decisions."""

    requests: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)
    retries: int = 0
    unavailable: int = 0  # requests no live replica could take

    def as_dict(self) -> dict[str, Any]:
        with_owner = sum(self.outcomes.get(o.value, 0) for o in
                         (Outcome.OWNER, Outcome.PASSED_OVER, Outcome.OWNER_DOWN))
        return {"requests": self.requests, "outcomes": dict(self.outcomes),
                "retries": self.retries, "unavailable": self.unavailable,
                "with_owner": with_owner,
                "owner_share": (self.outcomes.get(Outcome.OWNER.value, 0) / with_owner
                                if with_owner else None)}


class Router:
    """Replica choice with owners remembered (bounded LRU maps) and in-flight counts.

    Thread-safe: the front calls it from its event loop and tests from anywhere.
    """

    def __init__(self, replicas: Sequence[str], policy: Policy = Policy.AFFINITY,
                 max_imbalance: int = 4, max_keys: int = 200_000,
                 on_owner: Callable[[str | None, Sequence[bytes], str], None] | None = None
                 ) -> None:
        if max_imbalance < 1:
            raise ValueError(f"max_imbalance must be >= 1, got {max_imbalance}")
        if not replicas:
            raise ValueError("a router needs at least one replica")
        self.replicas = list(replicas)
        self.policy = Policy(policy)
        self.max_imbalance = max_imbalance
        self.max_keys = max_keys
        self.inflight = {r: 0 for r in self.replicas}
        self.served = {r: 0 for r in self.replicas}
        self.up = {r: True for r in self.replicas}
        self._sessions: OrderedDict[str, str] = OrderedDict()
        self._prefixes: OrderedDict[bytes, str] = OrderedDict()
        self._turn = 0
        self._lock = threading.Lock()
        self.stats = RoutingStats()
        self.on_owner = on_owner  # told of every new owner (the launcher's OwnerBook)

    # ------------------------------------------------------------------ owners
    def owner(self, session: str | None, keys: Sequence[bytes]) -> str | None:
        """The replica that served this conversation last (session first, else the deepest
        known prefix), or None."""
        with self._lock:
            return self._owner(session, keys)

    def _owner(self, session: str | None, keys: Sequence[bytes]) -> str | None:
        if session is not None and session in self._sessions:
            return self._sessions[session]
        for k in reversed(keys):
            r = self._prefixes.get(k)
            if r is not None:
                return r
        return None

    def _remember(self, m: OrderedDict, key: Any, replica: str) -> None:
        m[key] = replica
        m.move_to_end(key)
        while len(m) > self.max_keys:
            m.popitem(last=False)

    # ------------------------------------------------------------------ decisions
    def choose(self, session: str | None = None, keys: Sequence[bytes] = (),
               exclude: Iterable[str] = (), forced: str | None = None) -> Decision | None:
        """The replica for one attempt of a request (None: no live replica left). Counts the
        decision and one request in flight on the replica; `finished` must follow."""
        excluded = set(exclude)
        with self._lock:
            live = [r for r in self.replicas if self.up[r] and r not in excluded]
            if not live:
                self.stats.unavailable += 1
                return None
            least = min(self.inflight[r] for r in live)
            owner = self._owner(session, keys) if self.policy is Policy.AFFINITY else None
            if forced is not None and forced in live:
                d = Decision(forced, Outcome.FORCED, owner)
            elif self.policy is Policy.ROUND_ROBIN:
                d = Decision(live[self._turn % len(live)], Outcome.ROUND_ROBIN, None)
                self._turn += 1
            elif owner is not None and owner in live \
                    and self.inflight[owner] - least < self.max_imbalance:
                d = Decision(owner, Outcome.OWNER, owner)
            else:
                idle = [r for r in live if self.inflight[r] == least]
                pick = idle[self._turn % len(idle)]
                self._turn += 1
                if owner is None:
                    outcome = Outcome.NO_OWNER
                elif owner in live:
                    outcome = Outcome.PASSED_OVER
                else:
                    outcome = Outcome.OWNER_DOWN
                d = Decision(pick, outcome, owner)
            if not excluded:  # a retry is not another request
                self.stats.requests += 1
                self.stats.outcomes[d.outcome.value] = \
                    self.stats.outcomes.get(d.outcome.value, 0) + 1
            else:
                self.stats.retries += 1
            self.inflight[d.replica] += 1
            return d

    def finished(self, replica: str, ok: bool, session: str | None = None,
                 keys: Sequence[bytes] = ()) -> None:
        """One attempt ended; a successful one makes `replica` the conversation's owner."""
        with self._lock:
            self.inflight[replica] -= 1
            if not ok:
                return
            self.served[replica] += 1
            if session is not None:
                self._remember(self._sessions, session, replica)
            for k in keys:
                self._remember(self._prefixes, k, replica)
        if self.on_owner is not None and (session is not None or keys):
            self.on_owner(session, keys, replica)

    def load(self, sessions: Iterable[tuple[str, str]],
             prefixes: Iterable[tuple[bytes, str]]) -> int:
        """Take owners kept elsewhere (a front that restarted reads them from the OwnerBook),
        oldest first; owners that are not replicas of this router are skipped. Returns how
        many were taken."""
        n = 0
        with self._lock:
            for m, items in ((self._sessions, sessions), (self._prefixes, prefixes)):
                for key, replica in items:
                    if replica in self.up:
                        self._remember(m, key, replica)
                        n += 1
        return n

    def set_up(self, replica: str, up: bool) -> bool:
        """Mark a replica live or down; True when that changed its state."""
        with self._lock:
            changed = self.up[replica] != up
            self.up[replica] = up
            return changed

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {"policy": self.policy.value, "max_imbalance": self.max_imbalance,
                    **self.stats.as_dict(),
                    "replicas": {r: {"up": self.up[r], "inflight": self.inflight[r],
                                     "served": self.served[r]} for r in self.replicas}}
