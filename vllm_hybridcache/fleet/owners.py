"""The front's owner maps (session -> replica, prefix key -> replica) kept outside the front.

Why: the front is one Ray Serve replica, and Serve restarts it when it dies; its routing state
would start empty, sending every conversation's next turn by load, i.e. mostly away from the
replica holding its links. The maps are written behind each answered turn into this book, a Ray
actor the launcher creates (it lives as long as the launcher's Ray job), and a front that starts
reads them back. The writes are fire-and-forget, so routing never waits on the book; a front
that dies loses at most the owners of the turns answered in its last moments.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import ray

MAX_KEYS = 200_000  # per map, as the Router's own bound


class OwnerBook:
    """Bounded LRU maps of owners (plain Python: unit-testable without Ray)."""

    def __init__(self, max_keys: int = MAX_KEYS) -> None:
        self.max_keys = max_keys
        self.sessions: OrderedDict[str, str] = OrderedDict()
        self.prefixes: OrderedDict[bytes, str] = OrderedDict()

    def _put(self, m: OrderedDict, key: Any, replica: str) -> None:
        m[key] = replica
        m.move_to_end(key)
        while len(m) > self.max_keys:
            m.popitem(last=False)

    def remember(self, session: str | None, keys: Sequence[bytes], replica: str) -> None:
        """`replica` answered a turn of this conversation: it owns the session and the keys."""
        if session is not None:
            self._put(self.sessions, session, replica)
        for k in keys:
            self._put(self.prefixes, k, replica)

    def dump(self) -> tuple[list[tuple[str, str]], list[tuple[bytes, str]]]:
        """Both maps, oldest first (what Router.load takes)."""
        return list(self.sessions.items()), list(self.prefixes.items())

    def size(self) -> dict[str, int]:
        return {"sessions": len(self.sessions), "prefixes": len(self.prefixes)}


OwnerBookActor = ray.remote(num_cpus=0, max_restarts=0)(OwnerBook)
