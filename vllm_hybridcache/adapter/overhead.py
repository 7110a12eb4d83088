"""The plugin's own cost inside vLLM's engine steps, as seconds beside the steps' own.

Why: a cache that saves prefill tokens but spends as much in its own bookkeeping and copies is
no cache. Each engine counts, cumulatively:
- scheduler side: the seconds inside the connector's scheduler hooks, by phase (`lookup`:
  `get_num_new_matched_tokens`, the tree walk and token verification; `alloc`: the restore's
  block accounting after vLLM allocated; `plan`: the step's plan; `report`: the workers'
  results applied, commits and the lower tiers' hand-offs; `finish`: a finished request's end
  anchor and releases);
- worker side: the seconds of the connector's work in the model runner, by phase (`restore`:
  the loads before the forward; `save`: captures, lower-tier hand-offs and drops after it),
  as the slowest worker saw them (at TP > 1 the ranks copy their shards side by side);
- `busy_s`: the engine's busy wall time as the connector sees it, from a step's plan to its
  report (the forward, the worker's connector work and vLLM's output handling), overlapping
  steps (async scheduling) counted once;
- `steps`: the steps planned.

The plugin's share of the step time is then (scheduler + worker seconds) / (busy_s +
scheduler seconds): the scheduler hooks run outside the plan-to-report window, the worker's
inside it. vLLM's own scheduling is in neither, so the share is an upper bound of the
plugin's part of a whole step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from enum import StrEnum
from typing import Any


class Phase(StrEnum):
    """Where the scheduler side spends its time (module docstring)."""

    LOOKUP = "lookup"
    ALLOC = "alloc"
    PLAN = "plan"
    REPORT = "report"
    FINISH = "finish"


class WorkerPhase(StrEnum):
    """Where a worker spends its connector time (module docstring)."""

    RESTORE = "restore"
    SAVE = "save"


class Overhead:
    """Cumulative seconds of one engine's plugin work and of its busy steps.

    Invariant: `_inflight` counts steps planned and not yet reported; `_busy_from` is the
    time the oldest of them was planned (meaningful only while `_inflight > 0`).
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self.scheduler: dict[str, float] = {p.value: 0.0 for p in Phase}
        self.worker: dict[str, float] = {p.value: 0.0 for p in WorkerPhase}
        self.busy_s = 0.0
        self.steps = 0
        self._inflight = 0
        self._busy_from = 0.0

    @contextmanager
    def timed(self, phase: Phase) -> Iterator[None]:
        """Count the block's seconds under a scheduler-side `phase`."""
        t0 = self._clock()
        try:
            yield
        finally:
            self.scheduler[phase.value] += self._clock() - t0

    def step_planned(self) -> None:
        """A step's plan is out: the engine is busy until its report."""
        if self._inflight == 0:
            self._busy_from = self._clock()
        self._inflight += 1
        self.steps += 1

    def step_reported(self) -> None:
        """A step's report came back (a report without a planned step is ignored)."""
        if self._inflight == 0:
            return
        self._inflight -= 1
        if self._inflight == 0:
            self.busy_s += self._clock() - self._busy_from

    def add_worker(self, seconds: dict[str, float]) -> None:
        """The workers' seconds of one report (`StepReport.seconds`). A phase this side does
        not know is kept under its own name (counted, never dropped; and a metrics mismatch
        must not fail the engine's step)."""
        for phase, s in seconds.items():
            self.worker[phase] = self.worker.get(phase, 0.0) + s

    def payload(self) -> dict[str, Any]:
        """The stats payload's `overhead` entry."""
        return {"scheduler_s": dict(self.scheduler), "worker_s": dict(self.worker),
                "busy_s": self.busy_s, "steps": self.steps}


def share(payload: dict[str, Any]) -> float | None:
    """The plugin's share of the step time from an `overhead` payload (module docstring);
    None before any busy time."""
    sched = sum(payload.get("scheduler_s", {}).values())
    work = sum(payload.get("worker_s", {}).values())
    total = payload.get("busy_s", 0.0) + sched
    return (sched + work) / total if total > 0 else None
