"""The worker half of a lower tier: executes the operations its scheduler half sends.

Each worker holds one handler per lower tier, created the first time a plan carries that
tier's operations (the handler's name is its tier's `LowerTier.name`). The worker side calls
every handler at the same points of a step and never looks inside the operations: a handler
moves its own bytes (files, object-store payloads) out of the worker's LinkStore, and returns
its own report. Runs on the model runner's thread; a handler may own background threads.
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["TierHandler"]


class TierHandler:
    """One lower tier's byte mover in one worker.

    `store` is the worker's LinkStore (every tier's payloads, by link id); `between_steps` is
    set while no step runs (background work that must not share the cores with a forward
    waits on it). `rank`: the worker's tensor-parallel rank (whose shard of every link its
    store holds), set by the worker side right after it builds the handler.
    """

    # a load of this tier's hit may read its other links' states lazily (when first needed)
    defers_reads: bool = False

    def __init__(self, store: Any, between_steps: threading.Event) -> None:
        self.store = store
        self.between_steps = between_steps
        self.rank = 0

    def start(self, ops: Any) -> None:
        """Before the step's loads (every plan carrying this tier's operations)."""

    def after_captures(self, ops: Any) -> None:
        """After the step's captures, before its drops: copy out what the operations name."""

    def holds(self, link_ids: list[int]) -> set[int]:
        """Of the links to drop, those whose buffers this handler still reads: the worker
        drops them when the handler lets go (the handler drops them itself)."""
        return set()

    def dropped(self, link_ids: list[int]) -> None:
        """Links that left the worker's store with this step."""

    def direct_reads(self) -> bool:
        """Whether a load of this tier's hit reads its files with direct I/O."""
        return False

    def read_failed(self, problem: str) -> bool:
        """A staged file of this tier's hit was refused (`problem`, a LinkFileProblem value);
        True when the handler counts it itself (else the worker's report counts it)."""
        return False

    def report(self) -> Any | None:
        """What changed since the last report, or None."""
        return None

    def shutdown(self) -> None:
        """vLLM's graceful shutdown: finish or drop what is queued, within the tier's limit."""
