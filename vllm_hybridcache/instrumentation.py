"""Hooks into the connector for tests and benchmarks, in one object production never builds.

The connector's two halves each have a single `instrumentation` slot, `None` in production:
every hook call is behind an `is not None` check, so a serving engine runs no test code and
carries no test state. A test or benchmark builds one `Instrumentation` and puts it into the
slots:

- fault injection: `before_load(job)` / `before_capture(job)` run first in the worker's copy of
  a load or capture; raising there is a failed copy (the worker's own error handling runs);
- state probes: with `probe_states`, the scheduler side asks, in each step's plan, for the state
  of every request whose prefill ends in that step, and the worker calls `on_prefill_end` with
  the sha256 of every state part (exactness tests compare warm runs with cold runs on these);
- copy totals: `after_load(job, seconds)` / `after_capture(job, seconds)` sum the copies a
  worker made (benchmarks read them).

How it gets in:
- an in-process engine (`VLLM_ENABLE_V1_MULTIPROCESSING=0`): `instrument(llm)` sets both slots
  (scheduler side and worker side live in the caller's process);
- a multiprocess engine: `llm.collective_rpc(install_on_worker)` sets the worker slot in each
  worker process, and `llm.collective_rpc(worker_totals)` reads the totals back (vLLM ships the
  functions to the workers, which needs `VLLM_ALLOW_INSECURE_SERIALIZATION=1`); state probes
  need the scheduler side too, so they are for in-process engines only;
- no engine at all: the test harness (tests/harness) builds the connector halves itself and
  passes the object in directly;
- a server (`vllm serve`): started with `--worker-extension-cls
  vllm_hybridcache.instrumentation.FaultInjection` and `VLLM_SERVER_DEV_MODE=1`, its workers
  fail restores on demand through vLLM's `POST /collective_rpc` (the soak runner,
  benchmarks/soak). Without that flag no worker has the methods.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from vllm_hybridcache.adapter.plans import CaptureJob, LoadJob
    from vllm_hybridcache.adapter.worker_side import WorkerSide

# kind ("load" or "capture"), job -> None; raises to make that copy fail
Fault = Callable[[str, Any], None]


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def state_digests(worker: WorkerSide, tokens: int, block_ids: list[list[int]]) -> dict[str, str]:
    """sha256 of every section and of every complete KV block of one request's state.

    The block holding the last tokens is left out when partial: its tail holds whatever the
    block held before, which is not state (a cold and a warm run may leave different bytes
    there without either being wrong).
    """
    out: dict[str, str] = {}
    for name, (gid, t) in worker._sections.items():
        out[name] = _sha(t[block_ids[gid][0]])
    full = tokens // worker.parts.layout.view_block_tokens
    for name, (gid, acc) in worker._rows.items():
        h = hashlib.sha256()
        for b in block_ids[gid][:full]:
            h.update(_sha(acc.block(b)).encode())
        out[name] = h.hexdigest()
    return out


class Instrumentation:
    """Test and benchmark hooks of both connector halves (see the module docstring).

    One object may sit in both halves of an in-process engine, or one per worker; every hook is
    cheap when its feature is unused.
    """

    def __init__(self, *, probe_states: bool = False, fault: Fault | None = None) -> None:
        self.probe_states = probe_states
        self.fault = fault
        self.digests: dict[str, dict[str, str]] = {}
        self.totals: dict[str, float] = {"captures": 0, "capture_s": 0.0,
                                         "loads": 0, "load_s": 0.0}

    # ------------------------------------------------------------ worker hooks
    def before_load(self, job: LoadJob) -> None:
        if self.fault is not None:
            self.fault("load", job)

    def before_capture(self, job: CaptureJob) -> None:
        if self.fault is not None:
            self.fault("capture", job)

    def after_load(self, job: LoadJob, seconds: float) -> None:
        self.totals["loads"] += 1
        self.totals["load_s"] += seconds

    def after_capture(self, job: CaptureJob, seconds: float) -> None:
        self.totals["captures"] += 1
        self.totals["capture_s"] += seconds

    def on_prefill_end(self, worker: WorkerSide, req_id: str, tokens: int,
                       block_ids: list[list[int]]) -> None:
        """A request's prefill ended this step (planned because `probe_states` is on)."""
        self.digests[req_id] = state_digests(worker, tokens, block_ids)

    # ----------------------------------------------------------------- readers
    def take_digests(self, request_id: str) -> dict[str, str] | None:
        """The state digests of one request, removed; None if it had no probe.

        vLLM suffixes the ids of requests it builds itself (`LLM.generate`), so a
        caller's id matches `id` or `id-<suffix>`.
        """
        keys = [k for k in self.digests if k == request_id or k.startswith(request_id + "-")]
        if len(keys) > 1:
            raise KeyError(f"several probed requests match {request_id!r}: {keys}")
        return self.digests.pop(keys[0]) if keys else None


def instrument(llm, instrumentation: Instrumentation | None = None) -> Instrumentation:
    """Put one `Instrumentation` (state probes on by default) into both halves of an in-process
    engine's connector; returns it."""
    from vllm_hybridcache.serving.python_api import engine_parts

    inst = instrumentation if instrumentation is not None else Instrumentation(probe_states=True)
    sched, worker = engine_parts(llm)
    sched.instrumentation = inst
    worker.instrumentation = inst
    return inst


def instrumentation_of(llm) -> Instrumentation:
    """The worker-side instrumentation of an in-process engine (it must have one)."""
    from vllm_hybridcache.serving.python_api import engine_parts

    inst = engine_parts(llm)[1].instrumentation
    if inst is None:
        raise RuntimeError("this engine is not instrumented; call instrument(llm) first")
    return inst


def _worker_connector(worker_self):
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group()._worker


def install_on_worker(worker_self) -> bool:
    """Runs inside a worker process (`llm.collective_rpc(install_on_worker)`): gives its
    connector an `Instrumentation` for copy totals. True when the worker has a connector."""
    side = _worker_connector(worker_self)
    if side is None:
        return False
    if side.instrumentation is None:
        side.instrumentation = Instrumentation()
    return True


def worker_totals(worker_self) -> dict[str, float]:
    """Runs inside a worker process (`llm.collective_rpc(worker_totals)`): its copy totals."""
    side = _worker_connector(worker_self)
    return dict(side.instrumentation.totals)


class InjectedFault(RuntimeError):
    """A copy failed on purpose (fault injection); the worker treats it like any copy error."""


class LoadFailures:
    """A `Fault` that fails the next `pending` loads (restores) and counts the ones it failed."""

    def __init__(self) -> None:
        self.pending = 0
        self.fired = 0

    def __call__(self, kind: str, job: Any) -> None:
        if kind == "load" and self.pending > 0:
            self.pending -= 1
            self.fired += 1
            raise InjectedFault(f"injected restore failure ({self.fired})")

    def counts(self) -> dict[str, int]:
        return {"pending": self.pending, "fired": self.fired}


class FaultInjection:
    """vLLM worker extension (`--worker-extension-cls vllm_hybridcache.instrumentation.
    FaultInjection`): restore failures on demand in a running server.

    Why: a server's workers live in other processes, so a soak run cannot put an
    `Instrumentation` into them by hand; vLLM's dev-mode `POST /collective_rpc` calls these
    methods (string arguments only) in every worker. Production never passes the flag.
    """

    def _hybridcache_faults(self) -> LoadFailures | None:
        side = _worker_connector(self)
        if side is None:
            return None
        if side.instrumentation is None:
            side.instrumentation = Instrumentation()
        inst = side.instrumentation
        if not isinstance(inst.fault, LoadFailures):
            inst.fault = LoadFailures()
        return inst.fault

    def hybridcache_fail_loads(self, count: str) -> dict[str, int]:
        """Fail the next `count` restores of this worker; returns the fault's counts."""
        faults = self._hybridcache_faults()
        if faults is None:
            return {"pending": 0, "fired": 0}
        faults.pending += int(count)
        return faults.counts()

    def hybridcache_fault_counts(self) -> dict[str, int]:
        """Restores failed on purpose so far, and those still to fail."""
        faults = self._hybridcache_faults()
        return {"pending": 0, "fired": 0} if faults is None else faults.counts()
