"""Attention K/V in place: the two compat bends on vLLM's real KV cache manager (no model).

`compat.attention_in_place_manager` builds vLLM's `KVCacheManager` with prefix caching for the
attention groups only (the Mamba-like group keeps one fresh state block per request), hits
aligned to the attention block and capped per request; `compat.provenance_block_hasher` gives
blocks written off the segmentation hashes no cold prompt computes. These tests allocate and
free blocks the way vLLM's scheduler does (`get_computed_blocks`, `allocate_slots`, `free`) on
the harness's two-group layout (a Mamba group of 1,024-token blocks, attention of 16).
"""

from __future__ import annotations

import math

import pytest

from tests.harness.engine import BLOCK, MAX_LEN, kv_cache_config
from vllm_hybridcache import compat

MAMBA, ATTN = 0, 1  # group order in the harness layout


@pytest.fixture(scope="module")
def hash_fn():
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import init_none_hash

    fn = get_hash_fn_by_name("sha256")
    init_none_hash(fn)
    return fn


def _manager(cap):
    return compat.attention_in_place_manager(
        kv_cache_config(64), max_model_len=MAX_LEN, scheduler_block_size=math.lcm(MAX_LEN, BLOCK),
        cap=cap)


def _request(rid, tokens, hasher):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    return Request(rid, list(tokens), SamplingParams(max_tokens=1), None, block_hasher=hasher)


def _admit(manager, req):
    """What `Scheduler.schedule` does for a new request with no external tokens."""
    blocks, hit, _ = manager.get_computed_blocks(req)
    got = manager.allocate_slots(req, req.num_tokens - hit, hit, blocks)
    assert got is not None
    req.num_computed_tokens = req.num_tokens
    manager.cache_blocks(req, req.num_computed_tokens)  # the step ran: its blocks register
    return hit, manager.get_block_ids(req.request_id)


def _prompt(n, seed):
    return [(seed * 7919 + i * 31) % 3000 + 1 for i in range(n)]


def test_hash_granularity_is_the_groups_gcd_and_the_mamba_group_never_caches(hash_fn):
    manager = _manager(lambda r: r.num_tokens)
    coord = manager.coordinator
    assert coord.hash_block_size == math.gcd(MAX_LEN, BLOCK) == BLOCK
    assert [g.group_ids for g in coord.attention_groups] == [[ATTN]]
    assert not coord.single_type_managers[MAMBA].enable_caching
    assert coord.single_type_managers[ATTN].enable_caching


def test_attention_blocks_are_shared_and_ref_counted_the_state_block_is_not(hash_fn):
    hasher = compat.provenance_block_hasher(BLOCK, hash_fn, lambda r: r.num_prompt_tokens)
    manager = _manager(lambda r: r.num_tokens)
    head = _prompt(100, 1)
    a = _request("a", [*head, 5, 6, 7], hasher)
    b = _request("b", [*head, 8, 9], hasher)
    hit_a, ids_a = _admit(manager, a)
    hit_b, ids_b = _admit(manager, b)
    assert hit_a == 0
    assert hit_b == 96  # 6 whole attention blocks of the 100-token head (not the LCM, 1,024)
    assert ids_b[ATTN][:6] == ids_a[ATTN][:6] and ids_b[ATTN][6] != ids_a[ATTN][6]
    assert ids_a[MAMBA] != ids_b[MAMBA] and len(ids_b[MAMBA]) == 1
    pool = manager.block_pool.blocks
    assert all(pool[i].ref_cnt == 2 for i in ids_a[ATTN][:6])
    manager.free(a)
    assert all(pool[i].ref_cnt == 1 for i in ids_b[ATTN][:6])


@pytest.mark.parametrize("cap,expected", [(0, 0), (40, 32), (48, 48), (1000, 96)])
def test_the_cap_bounds_the_hit_to_whole_attention_blocks(hash_fn, cap, expected):
    hasher = compat.provenance_block_hasher(BLOCK, hash_fn, lambda r: r.num_prompt_tokens)
    caps = {"a": 0, "b": cap}
    manager = _manager(lambda r: caps[r.request_id])
    head = _prompt(100, 2)
    _admit(manager, _request("a", [*head, 1], hasher))
    hit, _ = _admit(manager, _request("b", [*head, 2], hasher))
    assert hit == expected


def test_blocks_written_off_the_segmentation_are_never_a_cold_prompts_hit(hash_fn):
    """Request a writes its rows from position 48 on off the segmentation (a resume from an
    anchor, a step cut short): a cold prompt with the same tokens shares its first 3 blocks
    only. The negative control, the same run without the provenance key, shares all 6."""
    head = _prompt(100, 3)
    for off_a, expected in ((48, 48), (None, 96)):
        marked = {"a": off_a}

        def off_from(r, marked=marked):
            off = marked.get(r.request_id)
            return r.num_prompt_tokens if off is None else off

        hasher = compat.provenance_block_hasher(BLOCK, hash_fn, off_from)
        manager = _manager(lambda r: r.num_tokens)
        _admit(manager, _request("a", [*head, 1], hasher))
        hit, _ = _admit(manager, _request("b", [*head, 2], hasher))
        assert hit == expected, off_a


def test_decoded_rows_carry_the_provenance_key(hash_fn):
    """A block filled by decoded tokens is hashed apart from the same tokens in a prompt."""
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher

    hasher = compat.provenance_block_hasher(BLOCK, hash_fn, lambda r: r.num_prompt_tokens)
    plain = get_request_block_hasher(BLOCK, hash_fn)
    tokens = _prompt(40, 4)
    decoding = _request("d", tokens[:20], hasher)
    for t in tokens[20:]:
        decoding.append_output_token_ids(t)
    cold = _request("c", tokens, plain)
    assert decoding.block_hashes[0] == cold.block_hashes[0]   # rows [0, 16): the prompt's
    assert decoding.block_hashes[1] != cold.block_hashes[1]   # rows [16, 32): 4 decoded
    assert len(decoding.block_hashes) == len(cold.block_hashes) == 2


def test_refuses_a_model_without_recurrent_groups():
    from vllm.v1.kv_cache_interface import KVCacheConfig

    cfg = kv_cache_config(8)
    only_attention = KVCacheConfig(num_blocks=8, kv_cache_tensors=[],
                                   kv_cache_groups=[cfg.kv_cache_groups[ATTN]])
    with pytest.raises(RuntimeError, match="beside Mamba-like groups"):
        compat.attention_in_place_manager(only_attention, max_model_len=MAX_LEN,
                                          scheduler_block_size=BLOCK, cap=lambda r: 0)


def test_mark_off_segmentation_marks_only_the_blocks_ending_in_the_new_range(hash_fn):
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher

    plain = get_request_block_hasher(BLOCK, hash_fn)
    tokens = _prompt(80, 5)                                  # 5 blocks
    req = _request("m", tokens, plain)
    before = list(req.block_hashes)
    assert compat.mark_off_segmentation(req, 80, 40, BLOCK, hash_fn) == 3   # end 48, 64, 80
    assert req.block_hashes[:2] == before[:2]
    assert all(a != b for a, b in zip(req.block_hashes[2:], before[2:], strict=True))
    # moving the position earlier marks only the blocks not marked yet
    marked = list(req.block_hashes)
    assert compat.mark_off_segmentation(req, 40, 0, BLOCK, hash_fn) == 2
    assert req.block_hashes[2:] == marked[2:] and req.block_hashes[1] != before[1]


def test_install_replaces_the_schedulers_manager_before_any_request():
    from tests.harness.engine import HarnessEngine

    e = HarnessEngine({"attention_in_place": False})  # off: vLLM's manager, caching off
    sched = e.scheduler
    assert not sched.kv_cache_manager.enable_caching and sched.block_size == MAX_LEN
    got = compat.install_attention_in_place(sched, lambda r: 0)
    assert (got.block_size, got.hash_block_size) == (BLOCK, BLOCK)
    assert sched.block_size == BLOCK and sched.hash_block_size == BLOCK
    assert sched.kv_cache_manager.enable_caching
    assert sched.kv_cache_manager.coordinator.hc_alignment == BLOCK


def test_in_place_counters_reach_prometheus_with_tier_and_kind():
    from tests.prom_registry import private_prom
    from vllm_hybridcache.adapter.stats import encode

    prom, reg = private_prom()
    labels = {"engine": "0", "tier": "ram", "kind": "tree"}
    for seq, (shared, copied) in enumerate(((384, 128), (768, 512)), start=1):
        data = encode({}, seq, "e")
        data["in_place"] = {"ram": {"tree": {"tokens_in_place": shared,
                                             "tokens_copied": copied,
                                             "bytes_saved": shared * 10}}}
        prom.observe(data)
    assert reg.get_sample_value("vllm:hybridcache_in_place_tokens_total", labels) == 768
    assert reg.get_sample_value("vllm:hybridcache_copied_tokens_total", labels) == 512
    assert reg.get_sample_value("vllm:hybridcache_in_place_bytes_saved_total", labels) == 7680
