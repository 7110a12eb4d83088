"""Which copy backend moves a link's KV blocks and state slots, by platform.

Order of preference (the first that loads wins):

* ROCm: ``csrc`` (csrc/'s HIP kernel: one launch per table, no DMA-engine job per block, which is
  what costs most on integrated GPUs such as Strix Halo) -> ``triton`` -> ``torch``.
* CUDA: ``triton`` -> ``torch``. The CUDA build of csrc compiles (``csrc_build``) but has not
  been timed against copy engines that are cheap on discrete NVIDIA parts; force it to try.
* CPU: ``torch`` (one ``copy_`` per block) by default; ``csrc`` runs the CPU twin. The default
  follows the side-by-side benchmark (``benchmarks/copy_bench.py``, figures in docs/kernels.md).
* anything else: ``torch``.

``VLLM_HYBRIDCACHE_COPY_BACKEND=csrc|triton|torch`` forces one (``auto`` or unset: the list
above); a forced backend that cannot load is an error, not a silent fallback, so a benchmark
or a bisection never measures something else than it asked for.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from functools import cache

import torch

from vllm_hybridcache.config import COPY_BACKEND_ENV
from vllm_hybridcache.ops.segments import SegmentTable

ENV_VAR = COPY_BACKEND_ENV
BACKENDS = ("csrc", "triton", "torch")
# Work per tile: a GPU workgroup of 256 lanes moving 4 x 16 B each; a CPU task of 256 KiB (big
# enough that ATen's thread pool overhead is amortised, small enough to split a link's blocks).
GPU_TILE_BYTES = 16 * 1024
CPU_TILE_BYTES = 256 * 1024
# CPU default, from benchmarks/copy_bench.py (see docs/kernels.md, "Snapshot copy kernel").
CPU_DEFAULT = "csrc"

logger = logging.getLogger("vllm_hybridcache")

Runner = Callable[[SegmentTable], None]


def platform_of(device: torch.device) -> str:
    """``rocm``, ``cuda``, ``cpu`` or the device type."""
    if device.type == "cuda":
        return "rocm" if torch.version.hip else "cuda"
    return device.type


def preference(platform: str) -> tuple[str, ...]:
    """Backends to try for ``platform``, best first (no environment override)."""
    if platform == "rocm":
        return ("csrc", "triton", "torch")
    if platform == "cuda":
        return ("triton", "torch")
    if platform == "cpu":
        return (CPU_DEFAULT, "torch") if CPU_DEFAULT != "torch" else ("torch",)
    return ("torch",)


def tile_bytes(device: torch.device) -> int:
    return CPU_TILE_BYTES if device.type == "cpu" else GPU_TILE_BYTES


def _synchronized(fn: Runner, device: torch.device) -> Runner:
    """Wait for the launch: the per-block ``copy_`` calls it replaces are synchronous between a
    device and pinned host memory, and callers seal or release the host buffer right after."""

    def run(table: SegmentTable) -> None:
        fn(table)
        torch.cuda.current_stream(device).synchronize()

    return run


def _runner(name: str, device: torch.device) -> Runner | None:
    """A callable executing a segment table on ``device``; None for ``torch`` (the caller keeps
    its per-block copies). Raises if the backend cannot load here."""
    if name == "torch":
        return None
    if name == "csrc":
        from vllm_hybridcache.ops import csrc_build

        if device.type == "cpu":
            ext = csrc_build.load_cpu_twin()
            return lambda t: ext.snapshot_copy(t.table, t.tiles, t.tile_words, t.word_bytes)
        if device.type == "cuda":
            ext = csrc_build.load_device_extension()
            index = device.index if device.index is not None else torch.cuda.current_device()
            return _synchronized(lambda t: ext.snapshot_copy(
                t.table, t.tiles, t.tile_words, t.word_bytes, index), device)
        raise RuntimeError(f"no csrc build for {device.type}")
    if name == "triton":
        if device.type != "cuda":
            raise RuntimeError("the Triton copy kernel runs on GPUs only")
        from vllm_hybridcache.ops import triton_copy

        return _synchronized(lambda t: triton_copy.run(t, device), device)
    raise ValueError(f"{ENV_VAR} must be one of {', '.join(BACKENDS)} or auto, got {name!r}")


@cache
def _select(device: torch.device, forced: str) -> tuple[str, Runner | None]:
    if forced not in ("", "auto"):
        runner = _runner(forced, device)
        logger.info("hybridcache: snapshot copies on %s use %s (%s)", device, forced, ENV_VAR)
        return forced, runner
    for name in preference(platform_of(device)):
        try:
            runner = _runner(name, device)
            logger.info("hybridcache: snapshot copies on %s use %s", device, name)
            return name, runner
        except Exception as e:
            logger.warning("hybridcache: %s copy backend unavailable on %s (%s); trying the next",
                           name, device, e)
    return "torch", None


def select(device: torch.device) -> tuple[str, Runner | None]:
    """(backend name, runner) for copies on ``device``; runner None means per-block torch."""
    return _select(torch.device(device), os.environ.get(ENV_VAR, "").strip().lower())
