"""Which segmentation this engine runs: `fine` (links also inside a step) or `step`.

Decided once per engine from the model class and the platform, and read by two places that
must agree: the scheduler side (where it plans captures) and the cluster tier's start-up
(which refuses to mix replicas of different modes). It lives in its own module, below both,
so neither imports the other for it.
"""

from __future__ import annotations

from vllm_hybridcache.compat import (
    CPU_GDN_INNER_MODELS,
    cpu_gdn_inner_states_installed,
    split_attention_plan,
)
from vllm_hybridcache.config import CPU_ATTN_SPLIT_INVARIANT_ENV, cpu_attention_pinned
from vllm_hybridcache.segmentation import FINE, STEP

__all__ = ["MIN_INNER_RESUME", "inner_resume_floor", "segmentation_mode"]


def segmentation_mode(vllm_config, inner_captures: bool = True) -> tuple[str, str]:
    """(mode, why) of this engine's segmentation: `fine` (links also at 64-aligned positions
    inside a step) only where the model says its forward is split-invariant there
    (`inner_capture_align()` of the model class: Flash-Next with its split-invariant forward,
    on by default where it is the cheaper one, `inner_capture_plan`;
    Qwen3-Next on vLLM's CPU backend with the split-invariant attention kernel or the attention
    pin, and the GDN inner-state bend, `_cpu_gdn_mode`), and not on a speculative route (the
    draft rows' tags are step-shaped) nor with the `inner_captures` setting off; `step` otherwise.
    """
    if not inner_captures:
        return STEP, "inner_captures off"
    if getattr(vllm_config, "speculative_config", None) is not None:
        return STEP, "speculative decoding"
    try:
        from vllm.model_executor.models import ModelRegistry

        mc = vllm_config.model_config
        cls, _ = ModelRegistry.resolve_model_cls(mc.architectures, mc)
    except Exception as e:  # an unknown architecture: no claim about its forward
        return STEP, f"model class not resolved ({type(e).__name__})"
    align = getattr(cls, "inner_capture_align", None)
    if align is None and cls.__name__ in CPU_GDN_INNER_MODELS:
        return _cpu_gdn_mode(cls.__name__, vllm_config)
    if align is None:
        return STEP, f"{cls.__name__} is not known to be split-invariant"
    # a class that explains its alignment answers once, with its reason
    explain = getattr(cls, "inner_capture_plan", None)
    if explain is not None:
        value, reason = explain(vllm_config)
        why = f" ({reason})"
    else:
        value, why = align(vllm_config), ""
    if value != 64:
        return STEP, f"{cls.__name__} runs a forward that is not split-invariant{why}"
    return FINE, f"{cls.__name__}: split-invariant at 64-aligned positions{why}"


def _cpu_gdn_mode(name: str, vllm_config) -> tuple[str, str]:
    """A vLLM GDN model on vLLM's CPU backend: `fine` only where its attention is
    split-invariant (our kernel, `split_attention_plan`, by default; or the pin of vLLM's) and
    the CPU GDN op hands over inner states in this process (docs/split-invariance.md)."""
    if cpu_attention_pinned():
        how = "the CPU attention pin"
    else:
        use, why = split_attention_plan(vllm_config)
        if not use:
            return STEP, (f"{name}: vLLM's CPU attention is not split-invariant here ({why}; "
                          f"{CPU_ATTN_SPLIT_INVARIANT_ENV})")
        how = "the split-invariant CPU attention kernel"
    if not cpu_gdn_inner_states_installed():
        return STEP, (f"{name}: vLLM's GDN op does not hand over states inside a step here "
                      "(not the CPU platform, or this vLLM is not the checked one)")
    return FINE, f"{name} with {how}: split-invariant at 64-aligned positions"


MIN_INNER_RESUME = 64
"""On vLLM's Qwen3-Next in fine mode (CPU): the fewest tokens the step resuming from a tree
link that is not a cut may hold. vLLM's GEMMs pick their kernels by the step's row count, so
rows computed in a very short step can differ in bits from the same rows inside a longer one:
a resume 4 tokens before the prompt's end left layer 0's conv state unlike the cold run's
(tests/connector/test_attention_in_place.py). Steps of 64 tokens were measured equal to steps
of 256 and 2048 (docs/split-invariance.md); a cut needs no floor (the cold run's step starts
there too)."""


def inner_resume_floor(vllm_config, mode: str) -> int:
    """MIN_INNER_RESUME for a vLLM GDN model in fine mode (its forward is vLLM's, pinned), else
    0: Flash-Next's split-invariant forward computes fixed row tiles whatever the step's
    length."""
    if mode != FINE:
        return 0
    try:
        from vllm.model_executor.models import ModelRegistry

        mc = vllm_config.model_config
        cls, _ = ModelRegistry.resolve_model_cls(mc.architectures, mc)
    except Exception:
        return MIN_INNER_RESUME
    return MIN_INNER_RESUME if cls.__name__ in CPU_GDN_INNER_MODELS else 0
