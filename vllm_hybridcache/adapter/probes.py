"""What the adapter calls on an attached probe: the slots test instrumentation fills.

The adapter never imports the instrumentation (vllm_hybridcache/testing/instrumentation.py,
test tooling that sits above it and reads its state); it declares here the calls it makes on
one, and a test attaches an object that has them. In production nothing is attached (None), and
every slot costs one `is None` check.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from vllm_hybridcache.adapter.plans import CaptureJob, LoadJob


class StepProbes(Protocol):
    """Hooks around the worker's copies and the scheduler's plans (tests only)."""

    probe_states: bool
    """The scheduler side asks, in each step's plan, for the state digests of every request
    whose prefill ends in that step."""

    def before_load(self, job: LoadJob) -> None: ...

    def after_load(self, job: LoadJob, seconds: float) -> None: ...

    def before_capture(self, job: CaptureJob) -> None: ...

    def after_capture(self, job: CaptureJob, seconds: float) -> None: ...

    def on_prefill_end(self, worker: Any, req_id: str, tokens: int,
                       block_ids: list[list[int]]) -> None:
        """`worker` is the WorkerSide that ran the step (typed Any: this module sits below
        it)."""
