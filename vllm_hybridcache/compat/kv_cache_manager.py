"""vLLM's KV-cache manager: attention K/V in place (an attention-only prefix cache under the
snapshot cache, capped below the restored link; blocks written off the segmentation hashed
with their provenance so they are never shared as if cold: docs/how-it-works.md).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vllm_hybridcache.compat.registry import checked

logger = logging.getLogger("vllm_hybridcache")


# --------------------------------------------------------------------- attention K/V in place

CapFn = Callable[[Any], int]
"""`cap(request) -> tokens`: the deepest local prefix-cache hit allowed for a request."""

OFF_SEGMENTATION_KEY = "vllm_hybridcache.off_segmentation"
"""Mixed into the hash of every block a request writes off the segmentation (its provenance)."""


@checked("0.32.0", "0.33.0")
def attention_in_place_manager(kv_cache_config: Any, *, max_model_len: int,
                               scheduler_block_size: int, cap: CapFn,
                               **manager_kwargs: Any) -> Any:
    """A `KVCacheManager` whose prefix cache covers the attention groups only, capped by `cap`.

    Why: on a hybrid model the recurrent state slot stays ours (vLLM's `mamba_cache_mode`
    `none`), and vLLM's prefix cache can then serve only the attention K/V. vLLM 0.32.0 would
    not do that by itself: with a `none`-mode Mamba group, `resolve_kv_cache_block_sizes` hashes
    at the least common multiple of the groups' block sizes, `HybridKVCacheCoordinator` aligns
    every hit to it and asks the Mamba group too (whose manager holds no cached state, so every
    hit would be 0), and `KVCacheCoordinator.cache_blocks` would register a Mamba state block
    once a request passes its block size. Here:

    - the manager is built with caching on, hashing at the greatest common divisor of the
      groups' block sizes (the LCM stays the scheduler block; requests must carry hashes of that
      granularity, see `provenance_block_hasher`);
    - its coordinator (vLLM's `HybridKVCacheCoordinator`, checked to be that class) becomes
      `_AttentionInPlaceCoordinator`: the lookup runs over the attention groups only, hits and
      registered blocks align to the attention block, and the Mamba managers never cache;
    - `get_computed_blocks(request)` limits the lookup to `min(num_tokens - 1, cap(request))`,
      so no hit ever goes deeper than what the caller can complete (a recurrent state at the
      hit's end); a cap of 0 gives no hit. vLLM 0.33's `get_computed_blocks(request,
      max_cache_hit_length)` bound is passed on, the lower of the two applies. (vLLM's other
      lookup, `get_computed_blocks_for_connector`, runs only for connectors that declare
      `supports_divergent_local_hybrid_hits`, which ours does not.)

    `manager_kwargs` are passed on to `KVCacheManager` (as `Scheduler.__init__` passes them).
    Raises RuntimeError when the groups are not one or more full-attention groups beside
    Mamba-like groups, or vLLM builds another coordinator.
    """
    import math

    from vllm.v1.core.kv_cache_coordinator import HybridKVCacheCoordinator
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    groups = kv_cache_config.kv_cache_groups
    specs = [g.kv_cache_spec for g in groups]
    if not any(isinstance(s, MambaSpec) for s in specs) or not all(
            isinstance(s, (MambaSpec, FullAttentionSpec)) for s in specs):
        raise RuntimeError("attention K/V in place needs full-attention groups beside "
                           f"Mamba-like groups; got {[type(s).__name__ for s in specs]}")
    if any(isinstance(s, MambaSpec) and s.mamba_cache_mode != "none" for s in specs):
        raise RuntimeError("attention K/V in place keeps the recurrent state slot: "
                           "mamba_cache_mode must be 'none'")
    hash_block_size = math.gcd(*(s.block_size for s in specs))
    manager = KVCacheManager(kv_cache_config=kv_cache_config, max_model_len=max_model_len,
                             scheduler_block_size=scheduler_block_size,
                             hash_block_size=hash_block_size, enable_caching=True,
                             **manager_kwargs)
    coordinator = manager.coordinator
    if type(coordinator) is not HybridKVCacheCoordinator:
        raise RuntimeError(f"vLLM built a {type(coordinator).__name__}, not the "
                           "HybridKVCacheCoordinator this bend was checked on")
    coordinator.__class__ = _attention_in_place_coordinator()
    coordinator.hc_attention_only()
    original = manager.get_computed_blocks

    def get_computed_blocks(request: Any, *args: Any, **kwargs: Any) -> Any:
        # vLLM 0.33 passes an upper bound of its own (`max_cache_hit_length`, None = the
        # request's tokens - 1); the coordinator takes the lower of it and the cap.
        coordinator.hc_limit = max(0, int(cap(request)))
        try:
            return original(request, *args, **kwargs)
        finally:
            coordinator.hc_limit = None

    manager.get_computed_blocks = get_computed_blocks
    return manager


@functools.cache
def _attention_in_place_coordinator() -> type:
    """`HybridKVCacheCoordinator` restricted to the attention groups (see
    `attention_in_place_manager`); built on first use so importing compat imports no vLLM."""
    from vllm.utils.math_utils import round_down
    from vllm.v1.core.kv_cache_coordinator import HybridKVCacheCoordinator
    from vllm.v1.kv_cache_interface import MambaSpec

    class _AttentionInPlaceCoordinator(HybridKVCacheCoordinator):
        hc_alignment: int = 0
        hc_limit: int | None = None

        def hc_attention_only(self) -> None:
            import math

            self.attention_groups = [g for g in self.attention_groups
                                     if not isinstance(g.spec, MambaSpec)]
            attention = [self.single_type_managers[i].block_size
                         for g in self.attention_groups for i in g.group_ids]
            self.hc_alignment = math.lcm(*attention)
            for manager in self.single_type_managers:
                manager.cache_hit_alignment_tokens = self.hc_alignment
                if isinstance(manager.kv_cache_spec, MambaSpec):
                    manager.enable_caching = False

        @property
        def _cache_hit_alignment_tokens(self) -> int:
            return self.hc_alignment or super()._cache_hit_alignment_tokens

        def _align_cacheable(self, num_tokens: int) -> int:
            return round_down(num_tokens, self.hc_alignment)

        def find_longest_cache_hit(self, block_hashes: Any, max_cache_hit_length: int) -> Any:
            if self.hc_limit is not None:
                max_cache_hit_length = min(max_cache_hit_length, self.hc_limit)
            return super().find_longest_cache_hit(block_hashes, max_cache_hit_length)

        def cache_blocks(self, request: Any, num_computed_tokens: int) -> None:
            # Register only rows of finished steps (vLLM registers a step's blocks when it
            # schedules the step): a step found off the segmentation after it was scheduled
            # has its blocks' hashes marked before they are registered (see
            # `mark_off_segmentation`). A loaded hit sets num_computed_tokens first.
            super().cache_blocks(request, min(num_computed_tokens,
                                              int(request.num_computed_tokens)))

    return _AttentionInPlaceCoordinator


@checked("0.32.0", "0.33.0")
def provenance_block_hasher(hash_block_size: int, hash_fn: Callable[[Any], Any],
                            off_from: Callable[[Any], int]) -> Callable[[Any], list]:
    """vLLM's request block hasher, with a provenance key on blocks written off the segmentation.

    Why: a block is only as exact as the forward that wrote it, and vLLM's block hash names the
    tokens, not the forward. `off_from(request)` is the first position whose row the request
    writes off the segmentation (its prompt length for decoded rows; earlier after a step cut
    short by the token budget, 0 for a resume from an end anchor). Every block ending after it
    gets `hash_fn((vllm_hash, OFF_SEGMENTATION_KEY))`: a hash no cold prompt's lookup computes,
    so such a block is never taken as a hit beside a cold-exact link. vLLM 0.32.0's
    `get_request_block_hasher` chains each hash on `request.block_hashes[-1]`; a provenance hash
    there only makes the next ones differ more.
    """
    from vllm.v1.core.kv_cache_utils import BlockHash, get_request_block_hasher

    inner = get_request_block_hasher(hash_block_size, hash_fn)

    def hasher(request: Any) -> list:
        first = len(request.block_hashes)
        hashes = inner(request)
        off = off_from(request)
        return [BlockHash(hash_fn((h, OFF_SEGMENTATION_KEY)))
                if (first + i + 1) * hash_block_size > off else h
                for i, h in enumerate(hashes)]

    return hasher


def _off_hash(hash_fn: Callable[[Any], Any], block_hash: Any) -> Any:
    from vllm.v1.core.kv_cache_utils import BlockHash

    return BlockHash(hash_fn((block_hash, OFF_SEGMENTATION_KEY)))


@checked("0.32.0", "0.33.0")
def mark_off_segmentation(request: Any, old: int, new: int, hash_block_size: int,
                          hash_fn: Callable[[Any], Any]) -> int:
    """Give the provenance key to the request's hashed blocks that end in (new, old].

    Why: the request learned that it writes its rows off the segmentation from position `new`
    on, where it had assumed `old` (blocks ending after `old` already carry the key, see
    `provenance_block_hasher`). vLLM 0.32.0's `Request.block_hashes` is a plain list the block
    pool reads when it registers a request's blocks; the caller marks before registration
    (the in-place coordinator registers only finished steps). Returns the blocks marked.
    """
    hashes = request.block_hashes
    marked = 0
    for j in range(len(hashes)):
        end = (j + 1) * hash_block_size
        if new < end <= old:
            hashes[j] = _off_hash(hash_fn, hashes[j])
            marked += 1
    return marked


@checked("0.32.0", "0.33.0")
def share_cached_blocks(manager: Any, request: Any, start: int, end: int) -> int:
    """Serve a just-admitted request's attention blocks for tokens [start, end) from vLLM's
    prefix cache instead of the fresh blocks vLLM allocated there for a connector load.

    Why: the local hit stops strictly below the link the connector restores (so that the
    connector loads at least one token and with it the recurrent state, asynchronously), and
    vLLM then allocates blocks of the request's own for the loaded tokens. Where the link ends
    on a block boundary, those rows are cold rows vLLM may still hold in a cached block (the
    head's), and each of N forks would otherwise hold a copy of that block. This runs between
    `allocate_slots` and the connector's `update_state_after_alloc`, before anything is written
    to the fresh blocks: for every attention group, vLLM's own lookup
    (`coordinator.find_longest_cache_hit`, the hash chain of the request's blocks, provenance
    marks included) must reach `end`; each fresh block (ref count 1, no hash) is replaced by the
    cached one (touched, so ref-counted like a local hit), freed, dropped from the blocks to
    zero, and counted as cached for the request (`num_cached_block`), so vLLM never registers
    it again. Either every block of the range is shared or nothing changes.

    `start` and `end` are multiples of the attention block; `start` is the request's local hit
    (its blocks below are already vLLM's). Returns the new end of the shared prefix: `end`, or
    `start` when vLLM's cache does not hold the range (evicted, never written on the
    segmentation) or a block is not a fresh one.
    """
    coordinator = manager.coordinator
    step = coordinator.hc_alignment
    if not step or start % step or end % step or end <= start:
        return start
    found = coordinator.find_longest_cache_hit(request.block_hashes, end)
    hit_blocks, hit_length = found[0], found[1]
    if hit_length < end:
        return start
    req_id = request.request_id
    swaps = []
    for group in coordinator.attention_groups:
        for gid in group.group_ids:
            mgr = coordinator.single_type_managers[gid]
            size = mgr.block_size
            blocks = mgr.req_to_blocks.get(req_id)
            cached = hit_blocks[gid]
            if (blocks is None or len(blocks) < end // size or len(cached) < end // size
                    or mgr.num_cached_block.get(req_id, 0) != start // size):
                return start
            for i in range(start // size, end // size):
                fresh = blocks[i]
                if fresh is cached[i]:
                    continue
                if fresh.is_null or fresh.ref_cnt != 1 or fresh.block_hash is not None:
                    return start
                swaps.append((mgr, blocks, i, fresh, cached[i]))
    for mgr, blocks, i, fresh, shared in swaps:
        mgr.block_pool.touch([shared])
        blocks[i] = shared
        mgr.block_pool.free_blocks([fresh])
        if fresh.block_id in mgr.new_block_ids:
            mgr.new_block_ids.remove(fresh.block_id)
    for group in coordinator.attention_groups:
        for gid in group.group_ids:
            mgr = coordinator.single_type_managers[gid]
            mgr.num_cached_block[req_id] = end // mgr.block_size
    return end


@dataclass
class AttentionInPlace:
    """What `install_attention_in_place` set up on a scheduler: the granularity of block
    hashes, the attention block (hits and registration align to it) and the hash function."""

    hash_block_size: int
    block_size: int
    hash_fn: Callable[[Any], Any]
    manager: Any = None

    def hasher(self, off_from: Callable[[Any], int]) -> Callable[[Any], list]:
        return provenance_block_hasher(self.hash_block_size, self.hash_fn, off_from)

    def mark(self, request: Any, old: int, new: int) -> int:
        return mark_off_segmentation(request, old, new, self.hash_block_size, self.hash_fn)

    def share(self, request: Any, start: int, end: int) -> int:
        return share_cached_blocks(self.manager, request, start, end)


def scheduler_manager_kwargs(scheduler: Any) -> dict[str, Any]:
    """The keywords `Scheduler.__init__` passes to `KVCacheManager` besides the config, the
    lengths, the block sizes and `enable_caching` (which `attention_in_place_manager` sets),
    read from the scheduler as vLLM computed them. `num_hash_lookahead_tokens` exists from
    vLLM 0.33 on (0 with a KV connector); `compat_check` checks this set against vLLM's call."""
    kwargs = dict(
        max_in_flight_tokens=scheduler.vllm_config.max_in_flight_tokens,
        use_eagle=scheduler.use_eagle_block_drop,
        num_prefill_lookahead=scheduler.num_prefill_lookahead, log_stats=scheduler.log_stats,
        enable_kv_cache_events=scheduler.enable_kv_cache_events,
        dcp_world_size=scheduler.dcp_world_size, pcp_world_size=1,
        metrics_collector=scheduler.kv_metrics_collector,
        watermark=scheduler.scheduler_config.watermark,
        enable_mamba_shared_prefix_checkpoint=bool(getattr(
            scheduler.cache_config, "enable_mamba_shared_prefix_checkpoint", False)))
    if hasattr(scheduler, "num_hash_lookahead_tokens"):
        kwargs["num_hash_lookahead_tokens"] = scheduler.num_hash_lookahead_tokens
    return kwargs


MANAGER_KWARGS_SET_BY_US = ("kv_cache_config", "max_model_len", "scheduler_block_size",
                            "hash_block_size", "enable_caching")
"""What `attention_in_place_manager` gives `KVCacheManager` itself."""


@checked("0.32.0", "0.33.0")
def install_attention_in_place(scheduler: Any, cap: CapFn) -> AttentionInPlace:
    """Give `scheduler` (vLLM 0.32.0's `Scheduler`, just built) an attention-only prefix cache.

    The manager vLLM built (caching off) is replaced, before any request exists, by
    `attention_in_place_manager` with the arguments `Scheduler.__init__` passes, and the
    connector is bound to it again (`bind_kv_cache_manager`). The scheduler's `block_size`
    becomes the attention block: `Scheduler.schedule` treats a local hit that is not a
    multiple of it as a partial tail that a connector hit replaces whole, and with the least
    common multiple there (a Mamba group's block is `max_model_len` in `none` mode) every
    local hit would be one. Its other uses in 0.32.0 do not apply here (sliding-window replay;
    block-level load failures, refused with several groups; the `align`-mode checkpoint split,
    which our cut hook replaces). `hash_block_size` follows the manager's. Requests must then
    be hashed at that granularity: `rehash_request`.
    """
    import math

    from vllm.utils.hashing import get_hash_fn_by_name

    cfg = scheduler.kv_cache_config
    manager = attention_in_place_manager(
        cfg, max_model_len=scheduler.max_model_len, scheduler_block_size=scheduler.block_size,
        cap=cap, **scheduler_manager_kwargs(scheduler))
    coordinator = manager.coordinator
    scheduler.kv_cache_manager = manager
    if scheduler.connector is not None:
        scheduler.connector.bind_kv_cache_manager(manager)
    scheduler.block_size = coordinator.hc_alignment
    scheduler.hash_block_size = coordinator.hash_block_size
    hash_fn = get_hash_fn_by_name(scheduler.cache_config.prefix_caching_hash_algo)
    assert scheduler.block_size % coordinator.hash_block_size == 0
    assert math.lcm(scheduler.block_size, coordinator.hash_block_size) == scheduler.block_size
    return AttentionInPlace(coordinator.hash_block_size, coordinator.hc_alignment, hash_fn,
                            manager)
