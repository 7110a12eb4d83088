"""Kernel backends of the Flash-Next model, behind one interface (`ops.interface.FlashNextOps`).

`get_backend(name)` picks one: "reference" (pure torch, the semantics oracle), "cpu" (reference
plus vLLM's CPU ops where they fit), "triton" (GPU kernels). Without a name the environment
variable VLLM_HYBRIDCACHE_FLASH_NEXT_OPS decides, else the platform: CPU -> "cpu", ROCm and
CUDA -> "triton", anything else -> "reference" (ops/triton/select.py).
"""

from __future__ import annotations

import os
from functools import cache

from vllm_hybridcache.flash_next.ops.interface import FlashNextOps

ENV_VAR = "VLLM_HYBRIDCACHE_FLASH_NEXT_OPS"
BACKENDS = ("reference", "cpu", "triton")


def _default_name() -> str:
    """The environment override, else the platform's default (see ops/triton/select.py)."""
    from vllm_hybridcache.flash_next.ops.triton.select import default_backend_name

    return default_backend_name()


@cache
def get_backend(name: str | None = None) -> FlashNextOps:
    """Return the (shared, stateless) backend object called `name`."""
    name = name or _default_name()
    if name == "reference":
        from vllm_hybridcache.flash_next.ops.reference import ReferenceOps

        return ReferenceOps()
    if name == "cpu":
        from vllm_hybridcache.flash_next.ops.cpu import CpuOps

        return CpuOps()
    if name == "triton":
        try:
            from vllm_hybridcache.flash_next.ops.triton import TritonOps
        except ImportError as exc:
            if os.environ.get(ENV_VAR) == "triton":
                raise
            import logging

            from vllm_hybridcache.flash_next.ops.reference import ReferenceOps

            logging.getLogger("vllm_hybridcache").warning(
                "Flash-Next triton ops unavailable (%s); using the torch reference", exc)
            return ReferenceOps()
        return TritonOps()
    raise ValueError(f"unknown Flash-Next ops backend {name!r}; known: {', '.join(BACKENDS)}")


__all__ = ["BACKENDS", "ENV_VAR", "FlashNextOps", "get_backend"]
