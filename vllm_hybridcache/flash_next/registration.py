"""Registers Flash-Next with vLLM's model registry (lazy strings: nothing heavy is imported).

On the CPU platform our implementation always replaces vLLM's in-tree Qwen4Exp (which runs on
datacenter CUDA/ROCm only). On GPUs the switch `VLLM_HYBRIDCACHE_FLASH_NEXT_IMPL` picks:
"hybridcache" (ours, the default everywhere so the snapshot cache sees our state layout) or
"vllm" (keep vLLM's in-tree implementation).

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
from typing import Any

IMPL_ENV = "VLLM_HYBRIDCACHE_FLASH_NEXT_IMPL"

logger = logging.getLogger("vllm_hybridcache")

ARCHITECTURES = {
    "Qwen4ExpForCausalLM": "vllm_hybridcache.flash_next.model:FlashNextForCausalLM",
    "Qwen4ExpForConditionalGeneration":
        "vllm_hybridcache.flash_next.vision_model:FlashNextForConditionalGeneration",
    "Qwen4ExpMTP": "vllm_hybridcache.flash_next.mtp:FlashNextMTP",
}


def use_ours() -> bool:
    """True when our implementation should serve Qwen4Exp architectures."""
    choice = os.environ.get(IMPL_ENV, "hybridcache").strip().lower()
    if choice not in ("hybridcache", "vllm"):
        raise ValueError(f"{IMPL_ENV} must be 'hybridcache' or 'vllm', got {choice!r}")
    if choice == "hybridcache":
        return True
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


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


def register() -> list[str]:
    """Register the architectures; returns what was registered (for the plugin's log)."""
    if not use_ours():
        return []
    from vllm import ModelRegistry

    from vllm_hybridcache.compat import extend_config_hook

    for arch, target in ARCHITECTURES.items():
        ModelRegistry.register_model(arch, target)
    for arch in SERVING_ARCHITECTURES:
        extend_config_hook(arch, block_prefix_caching_off)
    return list(ARCHITECTURES)
