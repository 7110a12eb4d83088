"""Start-up decisions of the scheduler side that read the engine, not requests.

The segmentation's message-end ids (from the model's tokenizer when not set, with a warning
that says how to fix it when they cannot be found) and the warning that the memory guard will
skip most captures. Here so that the scheduler side stays a request lifecycle.
"""

from __future__ import annotations

import logging

from vllm_hybridcache.config import CacheSettings, setting_env
from vllm_hybridcache.segmentation import Segmentation

__all__ = ["default_message_end_ids", "grid_for_step", "memory_headroom_warning",
           "resolve_segmentation"]

logger = logging.getLogger("vllm_hybridcache")


def default_message_end_ids(vllm_config) -> tuple[int, ...]:
    """`<|im_end|>`'s id when the model's tokenizer has it (Qwen-style chat templates).

    Without it only grid cuts remain, and agent prompts, which diverge at message boundaries,
    lose most of their reuse. So when the ids cannot be found (the tokenizer fails to load, or
    has no `<|im_end|>`) we warn that message-end cuts are off, why, and how to set them.
    """
    model = getattr(getattr(vllm_config, "model_config", None), "tokenizer", None)
    fix = ("set message_end_ids (VLLM_HYBRIDCACHE_MESSAGE_END_IDS) to the token ids that end a "
           "chat message, or to -1 for grid cuts only")
    try:
        from transformers import AutoTokenizer

        mc = vllm_config.model_config
        tok = AutoTokenizer.from_pretrained(mc.tokenizer, revision=mc.tokenizer_revision,
                                            trust_remote_code=mc.trust_remote_code)
        tid = tok.convert_tokens_to_ids("<|im_end|>")
    except Exception as e:
        logger.warning("hybridcache: message-end cuts are off: the tokenizer of %s could not be "
                       "loaded to look up <|im_end|> (%s: %s); prefills are cut on the grid "
                       "only. To fix it, %s.", model, type(e).__name__, e, fix)
        return ()
    if isinstance(tid, int) and tid != tok.unk_token_id and tid >= 0:
        return (tid,)
    logger.warning("hybridcache: message-end cuts are off: the tokenizer of %s has no <|im_end|> "
                   "token; prefills are cut on the grid only. To fix it, %s.", model, fix)
    return ()


def grid_for_step(grid: int, step_tokens: int | None) -> int:
    """The grid one prefill step can cover: `grid`, or the largest multiple of 64 within
    `step_tokens` (vLLM's `max_num_batched_tokens`) when that is smaller.

    Why: a link is captured only where one prefill step covers a whole segment, from the cut
    before it (a step the token budget cut short runs off the segmentation, and its rows are
    never cached: the state at a cut depends on where the steps before it ended). With steps
    smaller than the grid every step is cut short, so no prompt would ever be cached. Below 64
    tokens a step holds no grid segment at all; the grid is kept (and nothing is cached)."""
    if not step_tokens or step_tokens >= grid:
        return grid
    fitted = (int(step_tokens) // 64) * 64
    return fitted if fitted >= 64 else grid


def resolve_segmentation(settings: CacheSettings, vllm_config) -> Segmentation:
    ids = settings.message_end_ids
    if ids == (-1,):
        ids = ()
    elif not ids:
        ids = default_message_end_ids(vllm_config)
    step = getattr(getattr(vllm_config, "scheduler_config", None), "max_num_batched_tokens",
                   None)
    grid = grid_for_step(settings.grid, step)
    if grid != settings.grid:
        logger.warning("hybridcache: grid %d is larger than one prefill step "
                       "(max_num_batched_tokens %d): a link is captured only where one step "
                       "covers a whole segment, so nothing would ever be cached; cutting every "
                       "%d tokens instead. Set grid (%s) to at most max_num_batched_tokens, or "
                       "raise --max-num-batched-tokens.", settings.grid, step, grid,
                       setting_env("grid"))
    elif step and step < settings.grid:
        logger.warning("hybridcache: max_num_batched_tokens %d holds no grid segment (grid "
                       "%d, at least 64): nothing will be cached", step, settings.grid)
    return Segmentation(grid=grid, message_end_ids=tuple(ids),
                        message_end_min=settings.message_end_min)


def memory_headroom_warning(available: int, settings: CacheSettings) -> str | None:
    """A start-up warning when the memory guard will skip most captures, else None.

    Captures are skipped while host memory would fall below `memory_floor_bytes` (design rule
    6). On CPU, vLLM sizes its KV cache from the host memory unless told otherwise, which can
    leave nothing above the floor: the cache then silently stores nothing. Called once the KV
    cache is allocated (the scheduler is built after it).
    """
    GiB = 1 << 30
    headroom = available - settings.memory_floor_bytes
    if headroom >= min(settings.budget_bytes, GiB):
        return None
    return (f"hybridcache: only {max(headroom, 0) / GiB:.1f} GiB of host memory is available "
            f"above the memory floor ({settings.memory_floor_bytes / GiB:.1f} GiB), so most "
            "captures will be skipped (metric reason memory_guard). On CPU, give vLLM's KV cache "
            "an explicit size (VLLM_CPU_KVCACHE_SPACE in GiB, or --kv-cache-memory-bytes), or "
            "lower memory_floor_bytes.")
