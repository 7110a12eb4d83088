"""Requests whose inputs the token ids do not name (images, prompt embeddings) bypass the cache.

An image's prompt rows are placeholder tokens, the same ids for every picture. Until keys carry
each item's content hash, such a request must neither look up nor capture nor leave an end
anchor: otherwise a second request with the same text and another image restores the state of
the first image. Driven on the real scheduler side with vLLM's own `Request` objects and a
KV-cache config of one GDN-like group and one attention group; no model, no engine.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_hybridcache.config import CacheSettings

BLOCK = 16


def _kv_cache_config():
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
    )

    mamba = MambaSpec(block_size=BLOCK, shapes=((4, 8),), dtypes=(torch.float32,))
    attn = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=8, dtype=torch.float32)
    return KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(layer_names=["gdn.0"], kv_cache_spec=mamba),
        KVCacheGroupSpec(layer_names=["attn.1"], kv_cache_spec=attn),
    ])


def _vllm_config():
    return SimpleNamespace(
        model_config=SimpleNamespace(model="tiny", revision=None, dtype="float32"),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        cache_config=SimpleNamespace(cache_dtype="auto", mamba_ssm_cache_dtype="auto"),
        speculative_config=None,
    )


def _scheduler_side():
    from vllm_hybridcache.adapter.scheduler_side import SchedulerSide

    settings = CacheSettings(grid=64, message_end_ids=(-1,), memory_floor_bytes=0)
    side = SchedulerSide(_vllm_config(), _kv_cache_config(), settings)
    assert side.active
    return side


def _request(req_id: str, tokens: list[int], image_hash: str | None = None,
             embeds: bool = False):
    from vllm import SamplingParams
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.v1.request import Request

    mm = None
    if image_hash is not None:
        mm = [MultiModalFeatureSpec(data=None, modality="image", identifier=image_hash,
                                    mm_position=PlaceholderRange(offset=10, length=100),
                                    mm_hash=image_hash)]
    return Request(req_id, tokens, SamplingParams(max_tokens=4), None, mm_features=mm,
                   prompt_embeds=torch.zeros(len(tokens), 8) if embeds else None)


def _commit_cuts(side, req, tokens: list[int]) -> int:
    """Plan one full cold prefill of `req` through the scheduler side, commit what it reserved."""
    side.get_num_new_matched_tokens(req, 0)
    side.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: ([0], [1, 2])), 0)
    so = SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=req.request_id, block_ids=([0], [1, 2]),
                                            num_computed_tokens=0)],
        num_scheduled_tokens={req.request_id: len(tokens)},
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[],
                                              resumed_req_ids=set(), num_computed_tokens=[]))
    side._track(req).cuts = [len(tokens)]  # one step that ends on a cut
    side._track(req).cut_set = frozenset([len(tokens)])
    plan = side.build_plan(so)
    from vllm_hybridcache.adapter.plans import StepReport

    side.apply_report(StepReport(saved={c.addr: 0.0 for c in plan.captures},
                                 saved_count={c.addr: 1 for c in plan.captures}))
    return len(plan.captures)


TOKENS = [5 + (i * 7) % 900 for i in range(200)]


def test_text_request_is_cached_then_hit():
    """The control: the same flow with a text-only request captures and then hits."""
    side = _scheduler_side()
    assert _commit_cuts(side, _request("a", TOKENS), TOKENS) == 1
    n, _ = side.get_num_new_matched_tokens(_request("b", [*TOKENS, 1, 2, 3]), 0)
    assert n == len(TOKENS)


@pytest.mark.parametrize("kind", ["image", "embeds"])
def test_unkeyed_request_never_captures(kind):
    side = _scheduler_side()
    req = _request("a", TOKENS, image_hash="x" if kind == "image" else None,
                   embeds=kind == "embeds")
    assert side.cuts_for(req) is None  # stock vLLM steps
    assert _commit_cuts(side, req, TOKENS) == 0
    assert len(side.tree) == 0
    # and nothing for a text request with the same tokens to hit
    n, _ = side.get_num_new_matched_tokens(_request("b", [*TOKENS, 1]), 0)
    assert n == 0


def test_image_request_never_hits_a_text_link():
    """Same placeholder tokens, a stored link on them: an image request must still miss."""
    side = _scheduler_side()
    assert _commit_cuts(side, _request("a", TOKENS), TOKENS) == 1
    req = _request("b", [*TOKENS, 1, 2], image_hash="y")
    n, _ = side.get_num_new_matched_tokens(req, 0)
    assert n == 0
    side.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: ([0], [1])), 0)
    stats = side.tree.stats()
    assert stats.misses.get("unkeyed_input") == 1
    assert stats.hits == 0


def test_image_request_leaves_no_end_anchor():
    from vllm.v1.request import RequestStatus

    side = _scheduler_side()
    req = _request("a", TOKENS, image_hash="x")
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    req.num_computed_tokens = len(TOKENS)
    assert side.request_finished(req, ([0], [1, 2])) is False
    assert len(side.anchors) == 0
