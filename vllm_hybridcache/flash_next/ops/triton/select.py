"""Which Flash-Next ops backend a platform uses by default.

* ROCm (RDNA3.5 gfx1151, RDNA4 gfx1201, and CDNA): ``triton``. vLLM 0.32's in-tree
  Flash-Next targets datacenter parts only; our Triton kernels are the GPU path everywhere.
* CUDA: ``triton`` as well. This function is consulted only by our Flash-Next model, i.e. when
  the plugin's implementation is the one selected for ``qwen4_exp``; vLLM's own in-tree model
  keeps its own kernels.
* CPU: ``cpu`` (torch plus vLLM's CPU ops); Triton has no CPU backend here.
* Anything else (XPU, TPU, ...): ``reference`` (pure torch), since these kernels are untested
  there.

The environment variable ``VLLM_HYBRIDCACHE_FLASH_NEXT_OPS`` overrides the choice (e.g.
``reference`` on a GPU to bisect a numerics problem, or ``triton`` on the CPU together with
``TRITON_INTERPRET=1`` to run the kernels through the interpreter).

This module imports neither triton nor any kernel, so it is safe to call anywhere.
"""

from __future__ import annotations

import os
from typing import Protocol

from vllm_hybridcache.config import FLASH_NEXT_OPS_ENV

ENV_VAR = FLASH_NEXT_OPS_ENV


class PlatformLike(Protocol):
    """The part of ``vllm.platforms.current_platform`` the choice depends on."""

    def is_cpu(self) -> bool: ...
    def is_rocm(self) -> bool: ...
    def is_cuda(self) -> bool: ...


def backend_for_platform(platform: PlatformLike) -> str:
    """The default backend name for ``platform`` (no environment override)."""
    if platform.is_cpu():
        return "cpu"
    if platform.is_rocm() or platform.is_cuda():
        return "triton"
    return "reference"


def default_backend_name(platform: PlatformLike | None = None) -> str:
    """The backend ``ops.get_backend()`` should use when no name is given.

    The environment variable wins; otherwise the platform decides (``vllm``'s current platform
    when ``platform`` is None; without vLLM, ``reference``).
    """
    env = os.environ.get(ENV_VAR)
    if env:
        return env
    if platform is None:
        try:
            from vllm.platforms import current_platform
        except ImportError:
            return "reference"
        platform = current_platform
    return backend_for_platform(platform)
