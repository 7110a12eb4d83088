"""Registers Flash-Next with vLLM's model registry (lazy strings: nothing heavy is imported).

Which implementation serves the `Qwen4Exp*` architectures is a choice made once per process
and logged (`implementation()`), by `VLLM_HYBRIDCACHE_FLASH_NEXT_IMPL`:

- `auto` (the default, also when unset): ours on the CPU platform and on ROCm RDNA GPUs
  (gfx11xx, gfx12xx: Strix Halo, R9700, the boxes this project is for), where vLLM's in-tree
  Qwen4Exp does not run (it targets datacenter CUDA and ROCm CDNA); vLLM's own everywhere else,
  so installing the package never replaces a vLLM implementation that works;
- `hybridcache`: ours on every platform;
- `vllm`: vLLM's, except on the CPU platform, where vLLM's cannot run (ours then serves, and
  the log line says why).

The snapshot cache serves either: it learns the state layout from vLLM's KV-cache groups.

vLLM 0.32 turns its own block prefix caching on for every generative hybrid model
(`mamba_cache_mode="align"`: one recurrent state block per cached KV block). Our Flash-Next
keeps one state block per request, so where ours serves, the registration also turns vLLM's
block prefix caching off at config time (with a warning) instead of letting the engine fail at
model construction: a plain `vllm serve` of a Flash-Next checkpoint starts, and the snapshot
cache (`--plugin hybridcache`) is its prefix cache.
"""

from __future__ import annotations

import logging
import os
from functools import cache
from typing import Any, NamedTuple

from vllm_hybridcache.config import FLASH_NEXT_IMPL_ENV

IMPL_ENV = FLASH_NEXT_IMPL_ENV
CHOICES = ("auto", "hybridcache", "vllm")

logger = logging.getLogger("vllm_hybridcache")

ARCHITECTURES = {
    "Qwen4ExpForCausalLM": "vllm_hybridcache.flash_next.model:FlashNextForCausalLM",
    "Qwen4ExpForConditionalGeneration":
        "vllm_hybridcache.flash_next.vision_model:FlashNextForConditionalGeneration",
    "Qwen4ExpMTP": "vllm_hybridcache.flash_next.mtp:FlashNextMTP",
}


class Implementation(NamedTuple):
    """Who serves Qwen4Exp architectures in this process, and why (for the log line)."""

    ours: bool
    reason: str


def is_rdna(arch: str) -> bool:
    """gfx11xx / gfx12xx: AMD's RDNA 3, 3.5 and 4 (gfx1250 is a CDNA part despite its name)."""
    return arch.startswith(("gfx11", "gfx12")) and not arch.startswith("gfx125")


def choose(choice: str, platform: str, arch: str) -> Implementation:
    """The implementation for `choice` (an IMPL_ENV value) on `platform` ("cpu", "rocm",
    "cuda", ...) with GPU architecture `arch` (a gfx name on ROCm, "" when unknown)."""
    choice = (choice or "auto").strip().lower()
    if choice not in CHOICES:
        raise ValueError(f"{IMPL_ENV} must be one of {', '.join(CHOICES)}, got {choice!r}")
    if platform == "cpu":
        why = "vLLM's own Qwen4Exp does not run on the CPU platform"
        return Implementation(True, why + (f" ({IMPL_ENV}=vllm cannot apply)"
                                           if choice == "vllm" else ""))
    if choice == "hybridcache":
        return Implementation(True, f"{IMPL_ENV}=hybridcache")
    if choice == "vllm":
        return Implementation(False, f"{IMPL_ENV}=vllm")
    if platform == "rocm" and is_rdna(arch):
        return Implementation(True, f"ROCm {arch} (RDNA), where vLLM's Qwen4Exp does not run")
    return Implementation(False, f"{platform} {arch}".strip() + ": vLLM's own implementation "
                          f"serves (set {IMPL_ENV}=hybridcache for ours)")


@cache
def implementation() -> Implementation:
    """This process's choice (see the module docstring), logged once."""
    from vllm.platforms import current_platform

    from vllm_hybridcache.compat import rocm_gcn_arch

    platform = ("cpu" if current_platform.is_cpu() else "rocm" if current_platform.is_rocm()
                else "cuda" if current_platform.is_cuda() else str(current_platform.device_type))
    impl = choose(os.environ.get(IMPL_ENV, ""), platform, rocm_gcn_arch())
    logger.info("hybridcache: Flash-Next (Qwen4Exp*) served by %s: %s",
                "vllm-hybridcache's implementation" if impl.ours else "vLLM's in-tree model",
                impl.reason)
    return impl


def use_ours() -> bool:
    """True when our implementation should serve Qwen4Exp architectures."""
    return implementation().ours


SERVING_ARCHITECTURES = ("Qwen4ExpForCausalLM", "Qwen4ExpForConditionalGeneration")
"""The architectures a server is started with (the MTP head rides on the target's config)."""


def block_prefix_caching_off(vllm_config: Any) -> None:
    """Turn vLLM's block prefix caching off for a Flash-Next engine (see the module docstring)."""
    cache_config = vllm_config.cache_config
    if cache_config.enable_prefix_caching:
        logger.warning(
            "Flash-Next (vllm-hybridcache) keeps one recurrent state block per request and "
            "does not support vLLM's block prefix caching (mamba_cache_mode='align'); "
            "prefix caching is turned off. Serve with --plugin hybridcache for the snapshot "
            "cache.")
        cache_config.enable_prefix_caching = False


def no_cpu_expert_parallel(vllm_config: Any) -> None:
    """No expert parallelism on the CPU platform (flash_next/parallel.py says why): an error
    at config time, in the front process, instead of a crashed worker at the first request."""
    from vllm_hybridcache.flash_next.parallel import refuse_cpu_expert_parallel

    refuse_cpu_expert_parallel(vllm_config)


def register() -> list[str]:
    """Register the architectures; returns what was registered (for the plugin's log)."""
    if not use_ours():
        return []
    from vllm import ModelRegistry

    from vllm_hybridcache.compat import extend_config_hook

    for arch, target in ARCHITECTURES.items():
        ModelRegistry.register_model(arch, target)
    for arch in SERVING_ARCHITECTURES:
        extend_config_hook(arch, no_cpu_expert_parallel)
        extend_config_hook(arch, block_prefix_caching_off)
    return list(ARCHITECTURES)
