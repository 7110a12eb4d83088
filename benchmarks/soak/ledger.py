"""Everything a soak run observed, appended by many threads: one record per request and per
fault, plus the recent prompts faults reuse (a restore failure needs a prompt that hits, a
restore corruption the token ids of one)."""

from __future__ import annotations

import collections
import threading
from typing import Any

import msgspec


class RequestRecord(msgspec.Struct):
    """One request and its check against a cold run."""

    t: float
    """Seconds since the run started, when the request was sent."""
    life: int
    arm: str
    """`cache` (shared domain), `tenant` (another salt, reused), `control` (a fresh salt on
    every request: the cache cannot serve it, the batching drift baseline), or `fault:<kind>`."""
    family: str = ""
    outcome: str = "ok"
    """`ok`, `expected_error` or `unexpected_error`."""
    cause: str = ""
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    hit_kind: str = "none"
    """`none`, `tree` (the hit ends at a cut) or `anchor` (it does not: an end anchor)."""
    ttft_s: float | None = None
    e2e_s: float | None = None
    check: str = ""
    """The greedy check: `same`, `tie`, `wrong`, `length`, or `` when not checked."""
    compared: int = 0
    margin: float | None = None
    max_drift: float | None = None
    detail: str = ""
    injected: str = ""
    """`restore_corruption` when the worker says it corrupted this request's restore (the
    checker does not know it: the summary compares its verdict with this afterwards)."""
    restore: str = ""
    """For an injected request, what the worker restored and corrupted (tier/kind, tokens,
    sections) and vLLM's id of the request (to find it in the server's log)."""


class FaultRecord(msgspec.Struct):
    t: float
    life: int
    kind: str
    expected: bool
    detail: str = ""


class Ledger:
    """Thread-safe store of records; `recent` keeps the last shared-domain request bodies."""

    def __init__(self, keep: int = 32) -> None:
        self._lock = threading.Lock()
        self.requests: list[RequestRecord] = []
        self.faults: list[FaultRecord] = []
        self._recent: collections.deque[dict[str, Any]] = collections.deque(maxlen=keep)
        self._prompts: collections.deque[list[int]] = collections.deque(maxlen=keep)

    def add(self, rec: RequestRecord) -> None:
        with self._lock:
            self.requests.append(rec)

    def fault(self, rec: FaultRecord) -> None:
        with self._lock:
            self.faults.append(rec)

    def remember(self, body: dict[str, Any], prompt_ids: list[int] | None = None) -> None:
        with self._lock:
            self._recent.append(body)
            if prompt_ids:
                self._prompts.append(prompt_ids)

    def recent(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._recent)

    def recent_prompts(self) -> list[list[int]]:
        """Token ids of the recent shared-domain prompts that `remember` was given, oldest
        first."""
        with self._lock:
            return list(self._prompts)

    def snapshot(self) -> tuple[list[RequestRecord], list[FaultRecord]]:
        with self._lock:
            return list(self.requests), list(self.faults)
