"""Counts and times the vision tower's runs inside a served engine (images benchmark, tests).

Why a worker extension: the tower runs in the engine's worker process, so neither a client nor
the API server sees how often it ran. A server started with

    PYTHONPATH=<repo> vllm serve MODEL --worker-extension-cls benchmarks.vision_probe.VisionProbe

(and `VLLM_SERVER_DEV_MODE=1`, which `benchmarks.servers` always sets) gives every worker the
two methods below, called through vLLM's development route `POST /collective_rpc`:

- `vision_probe_read`: installs the probe on first use (wrapping the model's `visual.forward`,
  so start-up's profiling runs are not counted) and returns the totals so far: tower calls,
  images encoded and seconds spent in the tower.

Production servers never pass the flag; the model class carries no test code.
"""

from __future__ import annotations

import time
from typing import Any

import requests


class _Totals:
    def __init__(self) -> None:
        self.calls = 0
        self.images = 0
        self.seconds = 0.0

    def as_dict(self) -> dict[str, float]:
        return {"calls": self.calls, "images": self.images, "seconds": self.seconds}


def _install(tower) -> _Totals:
    totals = getattr(tower, "_vision_probe", None)
    if totals is not None:
        return totals
    totals = _Totals()
    forward = tower.forward

    def counted(pixels, grids, *args, **kwargs):
        start = time.perf_counter()
        try:
            return forward(pixels, grids, *args, **kwargs)
        finally:
            totals.seconds += time.perf_counter() - start
            totals.calls += 1
            totals.images += int(grids.shape[0])

    tower.forward = counted
    tower._vision_probe = totals
    return totals


class VisionProbe:
    """vLLM worker extension: the vision tower's run totals (module docstring)."""

    def vision_probe_read(self) -> dict[str, float]:
        model = self.model_runner.get_model()
        tower = getattr(model, "visual", None)
        if tower is None:
            raise RuntimeError(f"{type(model).__name__} has no vision tower")
        return _install(tower).as_dict()


EXTENSION_ARGS = ["--worker-extension-cls", "benchmarks.vision_probe.VisionProbe"]


def read(base_url: str, headers: dict[str, str] | None = None) -> dict[str, float]:
    """The tower's totals summed over the server's workers (one on CPU)."""
    r = requests.post(base_url.rstrip("/") + "/collective_rpc",
                      json={"method": "vision_probe_read"}, headers=headers or {}, timeout=60)
    r.raise_for_status()
    out: dict[str, Any] = {"calls": 0, "images": 0, "seconds": 0.0}
    for worker in r.json()["results"]:
        for k in out:
            out[k] += worker[k]
    return out
