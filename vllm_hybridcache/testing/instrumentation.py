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
  worker made (benchmarks read them);
- the in-place check (`in_place_check`, an `in_place_check.InPlaceCheck`): `after_load` compares
  the blocks a restore took from vLLM's block pool with the rows its links stored (the soak
  run's servers have it);
- restore corruption (`corruption`, a `RestoreCorruption`): `after_load` runs once the restore
  has copied the state into the request's slot, after every check of the bytes passed (headers,
  CRCs, any MAC), so a corruption there is a wrong state that every checksum calls valid; it
  proves that a comparison with a cold run catches one (the soak run's `restore_corruption`
  fault, the disk and image tests' negative controls).

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
  vllm_hybridcache.testing.instrumentation.FaultInjection` and `VLLM_SERVER_DEV_MODE=1`, its workers
  fail or corrupt restores on demand through vLLM's `POST /collective_rpc` (the soak runner,
  benchmarks/soak; the disk and image tests). Without that flag no worker has the methods.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from vllm_hybridcache.testing.in_place_check import InPlaceCheck

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

    def __init__(self, *, probe_states: bool = False, fault: Fault | None = None,
                 corruption: RestoreCorruption | None = None,
                 in_place_check: InPlaceCheck | None = None) -> None:
        self.probe_states = probe_states
        self.fault = fault
        self.corruption = corruption
        self.in_place_check = in_place_check
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
        """A restore succeeded: its state is in the request's slot and KV blocks, and the
        forward that reads it has not run yet (the corruption's moment)."""
        self.totals["loads"] += 1
        self.totals["load_s"] += seconds
        if self.in_place_check is not None:  # before a corruption: it reads shared blocks only
            self.in_place_check(job)
        if self.corruption is not None:
            self.corruption(job)

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


def probe_states_on_worker(worker_self) -> bool:
    """Runs inside a worker process (`llm.collective_rpc(probe_states_on_worker)`): its
    connector records state digests at each probed prefill end (the scheduler side plans the
    probes when its own instrumentation has `probe_states`). True when it has a connector."""
    if not install_on_worker(worker_self):
        return False
    _worker_connector(worker_self).instrumentation.probe_states = True
    return True


def take_worker_digests(worker_self, request_id: str) -> dict[str, str] | None:
    """Runs inside a worker process: this rank's state digests of one request (its shard of
    every section and block), removed; None when it has none."""
    side = _worker_connector(worker_self)
    return None if side is None or side.instrumentation is None else \
        side.instrumentation.take_digests(request_id)


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


def corrupt_state(worker: WorkerSide, job: LoadJob) -> int:
    """Overwrite every floating-point state section (each recurrent layer's convolution and
    recurrent state) of the slot `job` was just restored into with 1 - x; the number of
    sections changed.

    Why this perturbation: it is decisive where a nudge is not. The tiny models have random
    weights, so their next-token distributions are flat (top-5 logprobs within a nat) and a
    recurrent state's influence decays within some tens of tokens; measured on prompts one
    token past the restored link, 1 - x (like zeroing) changed the first token of every one on
    qwen3-next-tiny (bf16) and flash-next-tiny (float32) alike. Every value
    changes, and a zero state does not stay zero (as a zeroed one would equal a fresh
    request's). Integer sections (positions, counters some layers keep) are left alone: a
    wrong index could crash the kernel instead of giving a wrong answer. Attention K/V rows are
    not touched: below `in_place` they are vLLM's blocks, shared with other requests.
    """
    changed = 0
    for gid, t in worker._sections.values():
        if t.is_floating_point():
            slot = t[job.block_ids[gid][0]]
            slot.neg_().add_(1.0)
            changed += 1
    return changed


class RestoreCorruption:
    """Corrupts the restores of armed requests (`corrupt_state`), and remembers what it did.

    `arm(tag, tokens)`: the next restore of a request whose id contains `tag` is corrupted if it
    restores exactly `tokens` tokens (None: whatever it restores); the arm is used up by that
    restore either way. Another depth is left alone on purpose: the soak run builds a prompt
    that diverges from every other prompt right after the link it expects (so the corrupted
    state reaches no other request, see benchmarks/soak/faults.py), and a shallower hit would
    compute shared positions from a corrupted state. `take(tag)` returns what happened (and
    forgets the tag): the worker, not the client, knows whether a restore ran and was changed.
    """

    def __init__(self, worker: WorkerSide) -> None:
        self.worker = worker
        self.armed: dict[str, int | None] = {}
        self.results: dict[str, dict[str, Any]] = {}
        self.corrupted = 0
        """Restores corrupted so far (the soak's monitor samples it)."""

    def arm(self, tag: str, tokens: int | None = None) -> None:
        if not tag:
            raise ValueError("an empty tag would match every request")
        self.armed[tag] = tokens

    def __call__(self, job: LoadJob) -> None:
        tag = next((t for t in self.armed if t in job.req_id), None)
        if tag is None:
            return
        want = self.armed.pop(tag)
        restored = job.chain[-1].end if job.chain else 0
        result: dict[str, Any] = {"req_id": job.req_id, "tier": job.tier, "kind": job.kind,
                                  "tokens": restored, "corrupted": False, "sections": 0}
        if want is None or want == restored:
            result["sections"] = corrupt_state(self.worker, job)
            result["corrupted"] = result["sections"] > 0
            self.corrupted += int(result["corrupted"])
        self.results[tag] = result

    def take(self, tag: str) -> dict[str, Any] | None:
        """What the tagged request's restore was and whether it was corrupted; None when it
        had none (a miss, or a failed restore) and then the arm is dropped too."""
        self.armed.pop(tag, None)
        return self.results.pop(tag, None)


class FaultInjection:
    """vLLM worker extension (`--worker-extension-cls vllm_hybridcache.testing.instrumentation.
    FaultInjection`): restore failures and restore corruptions on demand in a running server.

    Why: a server's workers live in other processes, so a soak run cannot put an
    `Instrumentation` into them by hand; vLLM's dev-mode `POST /collective_rpc` calls these
    methods (string arguments only) in every worker. Production never passes the flag.
    """

    def _hybridcache_instrumentation(self) -> Instrumentation | None:
        side = _worker_connector(self)
        if side is None:
            return None
        if side.instrumentation is None:
            side.instrumentation = Instrumentation(in_place_check=InPlaceCheck(side))
        return side.instrumentation

    def _hybridcache_faults(self) -> LoadFailures | None:
        inst = self._hybridcache_instrumentation()
        if inst is None:
            return None
        if not isinstance(inst.fault, LoadFailures):
            inst.fault = LoadFailures()
        return inst.fault

    def _hybridcache_corruption(self) -> RestoreCorruption | None:
        inst = self._hybridcache_instrumentation()
        if inst is None:
            return None
        if inst.corruption is None:
            inst.corruption = RestoreCorruption(_worker_connector(self))
        return inst.corruption

    def hybridcache_fail_loads(self, count: str) -> dict[str, int]:
        """Fail the next `count` restores of this worker; returns the fault's counts."""
        faults = self._hybridcache_faults()
        if faults is None:
            return {"pending": 0, "fired": 0}
        faults.pending += int(count)
        return faults.counts()

    def hybridcache_fault_counts(self) -> dict[str, float]:
        """Restores failed on purpose so far, those still to fail, restores corrupted, and the
        in-place check's counts (`in_place_*`)."""
        faults = self._hybridcache_faults()
        corruption = self._hybridcache_corruption()
        counts: dict[str, float] = {"pending": 0, "fired": 0}
        if faults is not None:
            counts.update(faults.counts())
        counts["corrupted"] = 0 if corruption is None else corruption.corrupted
        inst = self._hybridcache_instrumentation()
        if inst is not None and inst.in_place_check is not None:
            counts.update(inst.in_place_check.report())
        return counts

    def hybridcache_corrupt_restore(self, tag: str, tokens: str = "") -> dict[str, bool]:
        """Corrupt the next restore of the request whose id contains `tag`, if it restores
        `tokens` tokens (empty: any depth); `armed` is False when this worker has no
        connector. Ask a request id with `X-Request-Id` or the body's `request_id`: vLLM's own
        id contains it. (A dict: the route sends any other result back as its str().)"""
        corruption = self._hybridcache_corruption()
        if corruption is None:
            return {"armed": False}
        corruption.arm(tag, int(tokens) if tokens else None)
        return {"armed": True}

    def hybridcache_corruption_result(self, tag: str) -> dict[str, Any] | None:
        """What the tagged request's restore was (`tier`, `kind`, `tokens`) and whether it was
        corrupted; None when it had no successful restore. The tag is forgotten."""
        corruption = self._hybridcache_corruption()
        return None if corruption is None else corruption.take(tag)
