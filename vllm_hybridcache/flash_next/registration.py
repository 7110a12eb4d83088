"""Registers Flash-Next with vLLM's model registry (lazy strings: nothing heavy is imported).

On the CPU platform our implementation always replaces vLLM's in-tree Qwen4Exp (which runs on
datacenter CUDA/ROCm only). On GPUs the switch `VLLM_HYBRIDCACHE_FLASH_NEXT_IMPL` picks:
"hybridcache" (ours, the default everywhere so the snapshot cache sees our state layout) or
"vllm" (keep vLLM's in-tree implementation).
"""

from __future__ import annotations

import os

IMPL_ENV = "VLLM_HYBRIDCACHE_FLASH_NEXT_IMPL"

ARCHITECTURES = {
    "Qwen4ExpForCausalLM": "vllm_hybridcache.flash_next.model:FlashNextForCausalLM",
    "Qwen4ExpForConditionalGeneration":
        "vllm_hybridcache.flash_next.model:FlashNextForConditionalGeneration",
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


def register() -> list[str]:
    """Register the architectures; returns what was registered (for the plugin's log)."""
    if not use_ours():
        return []
    from vllm import ModelRegistry

    for arch, target in ARCHITECTURES.items():
        ModelRegistry.register_model(arch, target)
    return list(ARCHITECTURES)
