"""Which CPUs a background thread of this process may run on.

Why: vLLM's CPU worker binds its OpenMP threads one per core (`VLLM_CPU_OMP_THREADS_BIND`),
its main thread among them, and a thread inherits the affinity of the thread that starts it.
So a background thread the worker's main thread starts is bound to the main thread's core and
takes its time from the forward's first thread, even while the forward leaves another core
idle. `widen_thread_affinity` gives the calling thread every CPU that some thread of this
process may use (the union of their affinities: the cores vLLM gave the worker), never one
outside them.

Where it is used: the disk tier's read-buffer warm-up at start (adapter/worker_side.py), a
background job that should not take its time from one OpenMP thread only. Not for the disk
reads' helper threads: they run while the forward waits for the load, on the core its first
thread leaves idle then, and in a probe on the 2-core VM they staged a chain in about twice
the time when given every core.

Linux only (per-thread affinity in /proc/self/task); elsewhere, or if any call fails, the
thread keeps what it had.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["process_cpus", "widen_thread_affinity"]


def process_cpus() -> set[int]:
    """The CPUs any thread of this process may run on (empty where that cannot be read)."""
    if not hasattr(os, "sched_getaffinity"):
        return set()
    try:
        tids = [int(p.name) for p in Path("/proc/self/task").iterdir()]
    except OSError:
        return set()
    cpus: set[int] = set()
    for tid in tids:
        try:
            cpus |= os.sched_getaffinity(tid)
        except OSError:  # the thread ended meanwhile
            continue
    return cpus


def widen_thread_affinity() -> set[int]:
    """Let the calling thread run on every CPU of `process_cpus()`; returns its affinity
    afterwards (unchanged, possibly empty, where that is not possible)."""
    if not hasattr(os, "sched_setaffinity"):
        return set()
    cpus = process_cpus()
    try:
        if cpus and cpus != os.sched_getaffinity(0):
            os.sched_setaffinity(0, cpus)
        return os.sched_getaffinity(0)
    except OSError:
        return set()
