"""vLLM's scheduler: the prefill-chunk hook the segmentation scheduler cuts steps with, the
recurrent-layer probe, and re-hashing a request's blocks (adapter/scheduler.py uses them).
"""

from __future__ import annotations

import logging
import time
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


@checked("0.32.0", "0.33.0")
def withdraw_failed_sync_load(scheduler: Any, req_id: str, in_place_tokens: int) -> list[str]:
    """Undo a step whose synchronous KV load (`load_kv_async=False`) failed for `req_id`:
    call before `Scheduler.update_from_output` applies that step's output. Returns the ids
    withdrawn (`req_id` and every running request that shares a block it wrote).

    Why this is ours to do: vLLM 0.32 recovers a failed synchronous load only through
    `invalid_block_ids`, which it refuses for models with more than one KV-cache group (every
    hybrid model), and `failed_recving` covers only requests still waiting for an
    asynchronous load. The forward of the failed step already read the request's state, so
    its output must not be delivered and its blocks must not be found by anyone.

    What it does, with vLLM's own means: the blocks the load wrote (the request's blocks from
    `in_place_tokens` on, in every group; those below are vLLM's, written by others and
    valid) leave the prefix cache (`KVCacheManager.evict_blocks`); every running request
    holding one of them (one that took them as a local prefix hit in the same `schedule()`,
    since a synchronous load's blocks are cached when they are allocated) is withdrawn with
    it. Withdrawing is vLLM's preemption outside `schedule()`, as `reset_prefix_cache` does
    it: out of `running`, `_preempt_request(..., drop_stale_output=True)` (blocks freed,
    `num_computed_tokens` = 0, back to the front of the waiting queue, this step's output
    dropped as stale in `update_from_output`), forgotten in `prev_step_scheduled_req_ids` so
    the model runner gets its tokens again, and its prefill statistics reset so the cached
    tokens it reports are the ones of the run that counts.
    """
    failed = scheduler.requests.get(req_id)
    if failed is None or failed not in scheduler.running:
        return []
    manager = scheduler.kv_cache_manager
    null = manager.block_pool.null_block.block_id
    written: set[int] = set()
    for group, ids in zip(scheduler.kv_cache_config.kv_cache_groups,
                          manager.get_block_ids(req_id), strict=True):
        first = in_place_tokens // group.kv_cache_spec.block_size
        written.update(b for b in ids[first:] if b != null)
    victims = [failed] + [
        r for r in scheduler.running
        if r is not failed and any(b in written for ids in manager.get_block_ids(r.request_id)
                                   for b in ids)]
    manager.evict_blocks(written)
    timestamp = time.monotonic()
    for request in victims:
        scheduler.running.remove(request)
        scheduler._preempt_request(request, timestamp, drop_stale_output=True)
        scheduler.prev_step_scheduled_req_ids.discard(request.request_id)
        if request.prefill_stats is not None:
            request.prefill_stats.set(num_prompt_tokens=request.num_prompt_tokens,
                                      num_local_cached_tokens=0,
                                      num_external_cached_tokens=0)
    return [r.request_id for r in victims]
