"""vLLM's scheduler: the prefill-chunk hook the segmentation scheduler cuts steps with, the
recurrent-layer probe, and re-hashing a request's blocks (adapter/scheduler.py uses them).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from vllm_hybridcache.compat.registry import BENDS, checked

logger = logging.getLogger("vllm_hybridcache")


# --------------------------------------------------------------------- scheduler

SplitFn = Callable[[Any, int, int, int], "int | None"]


@checked("0.32.0", "0.33.0")
def install_prefill_split(scheduler: Any, split: SplitFn) -> None:
    """Make `scheduler` clip every prefill chunk with `split`.

    vLLM 0.32's `Scheduler.schedule()` clips a chunk, in both its running and waiting paths,
    through the private `Scheduler._mamba_block_aligned_split(request, num_new_tokens,
    num_new_local_computed_tokens=0, num_external_computed_tokens=0)` when the attribute
    `need_mamba_block_aligned_split` is true. We set the flag and wrap that method on this
    instance: `split(request, num_new_tokens, local, external)` returns the clipped count, or
    None to keep vLLM's own clipping. Raises RuntimeError when the hook is gone.
    """
    original = getattr(scheduler, "_mamba_block_aligned_split", None)
    if original is None or not hasattr(scheduler, "need_mamba_block_aligned_split"):
        raise RuntimeError(
            "this vLLM's Scheduler has no _mamba_block_aligned_split / "
            "need_mamba_block_aligned_split hook; the segmentation scheduler cannot cut "
            f"prefills (checked on vLLM {', '.join(BENDS['install_prefill_split'])})")

    def clip(request: Any, num_new_tokens: int, num_new_local_computed_tokens: int = 0,
             num_external_computed_tokens: int = 0) -> int:
        out = split(request, num_new_tokens, num_new_local_computed_tokens,
                    num_external_computed_tokens)
        if out is None:
            return original(request, num_new_tokens, num_new_local_computed_tokens,
                            num_external_computed_tokens)
        return out

    scheduler._mamba_block_aligned_split = clip
    scheduler.need_mamba_block_aligned_split = True


@checked("0.32.0", "0.33.0")
def prefill_step_limit(scheduler: Any) -> int:
    """The most prompt tokens one request can get in a step while other requests run:
    `Scheduler.max_num_scheduled_tokens` (the step's token budget, from the scheduler config),
    within `scheduler_config.long_prefill_token_threshold` when that is set (vLLM lifts the
    threshold only for a request alone in the engine)."""
    limit = int(getattr(scheduler, "max_num_scheduled_tokens", 0)
                or scheduler.scheduler_config.max_num_batched_tokens)
    threshold = int(getattr(scheduler.scheduler_config, "long_prefill_token_threshold", 0) or 0)
    return min(limit, threshold) if threshold > 0 else limit


@checked("0.32.0", "0.33.0")
def decode_rows(scheduler: Any, exclude: Any) -> int:
    """Tokens the running requests past their prompt (other than `exclude`) take in a step:
    one each, plus its draft tokens (`Request.spec_token_ids`)."""
    rows = 0
    for r in scheduler.running:
        if r is not exclude and r.num_computed_tokens >= r.num_prompt_tokens:
            rows += 1 + len(getattr(r, "spec_token_ids", None) or ())
    return rows


@checked("0.32.0", "0.33.0")
def scheduler_has_recurrent_layers(scheduler: Any) -> bool:
    """Whether the scheduler's KV-cache config has Mamba-like (recurrent state) groups.

    `Scheduler.has_mamba_layers` is an undocumented attribute set in `__init__`.
    """
    return bool(getattr(scheduler, "has_mamba_layers", False))


@checked("0.32.0", "0.33.0")
def rehash_request(request: Any, hasher: Callable[[Any], list]) -> None:
    """Hash `request` again with `hasher` (its block hashes, and every later one).

    vLLM 0.32.0's `Request` keeps its hasher in `_block_hasher` (EngineCore's, at the least
    common multiple of the group block sizes here) and extends `block_hashes` with it as
    tokens arrive (`update_block_hashes`).
    """
    request._block_hasher = hasher
    request.block_hashes = []
    request.update_block_hashes()
