"""core/cpus.py: a thread started from a thread bound to one core (as vLLM's CPU worker binds
its main thread) widens to the CPUs the process's threads may use, and to no other."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from vllm_hybridcache.core.cpus import process_cpus, widen_thread_affinity

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="per-thread affinity is read from /proc (Linux)")


def test_a_thread_bound_to_one_core_widens_to_the_process_cpus():
    allowed = os.sched_getaffinity(0)
    seen: dict[str, set[int]] = {}

    def bound() -> None:
        os.sched_setaffinity(0, {min(allowed)})
        seen["bound"] = os.sched_getaffinity(0)
        seen["widened"] = widen_thread_affinity()

    t = threading.Thread(target=bound)
    t.start()
    t.join()
    assert seen["bound"] == {min(allowed)}
    # the main thread may still use all of `allowed`: the union holds it (and the cores of
    # any other thread of this process, e.g. OpenMP threads an in-process engine bound)
    assert seen["widened"] == process_cpus() and allowed <= seen["widened"]
    assert seen["widened"] <= set(range(os.cpu_count() or 1))
