"""Kernel backends of the Flash-Next model, behind one interface (`ops.interface.FlashNextOps`).

`get_backend(name)` picks one: "reference" (pure torch, the semantics oracle), "cpu" (reference
plus vLLM's CPU ops where they fit), "triton" (GPU kernels). Without a name the environment
variable VLLM_HYBRIDCACHE_FLASH_NEXT_OPS decides, else the platform: CPU -> "cpu", ROCm and
CUDA -> "triton", anything else -> "reference" (ops/triton/select.py).

The split-invariant forward (`split_invariant.plan`: `VLLM_HYBRIDCACHE_FLASH_NEXT_SPLIT_INVARIANT`,
auto by default) wraps the chosen backend in `split_invariant.SplitInvariantOps` (a token's
arithmetic no longer depends on where its 64-aligned forward step starts or how long it is;
docs/split-invariance.md).
"""

from __future__ import annotations

import os
from functools import cache
from typing import Any

from vllm_hybridcache.config import FLASH_NEXT_OPS_ENV
from vllm_hybridcache.flash_next.ops.interface import FlashNextOps

ENV_VAR = FLASH_NEXT_OPS_ENV
BACKENDS = ("reference", "cpu", "triton")


def _default_name() -> str:
    """The environment override, else the platform's default (see ops/triton/select.py)."""
    from vllm_hybridcache.flash_next.ops.triton.select import default_backend_name

    return default_backend_name()


def get_backend(name: str | None = None, split_invariant: bool | None = None,
                vllm_config: Any = None) -> FlashNextOps:
    """Return the (shared, stateless) backend object called `name`; `split_invariant` None
    asks `split_invariant.plan` for the engine of `vllm_config`."""
    from vllm_hybridcache.flash_next.ops import split_invariant as si

    name = name or _default_name()
    wrap = si.enabled(vllm_config) if split_invariant is None else split_invariant
    return _wrapped(name) if wrap else _backend(name)


@cache
def _wrapped(name: str) -> FlashNextOps:
    """The split-invariant form of backend `name`: Triton pins its two step-dependent launch
    choices itself; the torch backends get the op replacements of `SplitInvariantOps`."""
    inner = _backend(name)
    if inner.name == "triton":
        from vllm_hybridcache.flash_next.ops.triton import TritonOps

        return TritonOps(split_invariant=True)
    from vllm_hybridcache.flash_next.ops.split_invariant import SplitInvariantOps

    return SplitInvariantOps(inner)


@cache
def _backend(name: str) -> FlashNextOps:
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
