"""Multimodal requests are keyed by their items' processed content; inputs that cannot be
named (prompt embeddings, items whose content is not at the scheduler) bypass the cache.

An image's prompt rows are placeholder tokens, the same ids for every picture, so keys carry
a digest of each item's processed tensors on its rows (`adapter/mm_keys.py`): the same picture
hits, another picture misses from its first placeholder on. A request whose inputs cannot be
named must neither look up nor capture nor leave an end anchor. Driven on the real scheduler
side with vLLM's own `Request` objects and a KV-cache config of one GDN-like group and one
attention group; no model, no engine.
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import shutil
import tempfile
from pathlib import Path
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


@functools.cache
def _checkpoint() -> str:
    """A local checkpoint folder for the fake config: the engine fingerprint hashes the weights
    where vLLM loads them, and a model it cannot find has none (no disk or cluster tier)."""
    folder = Path(tempfile.mkdtemp(prefix="hybridcache-tiny-checkpoint-"))
    atexit.register(shutil.rmtree, folder, True)
    (folder / "config.json").write_text('{"hidden_size": 8}')
    (folder / "model.safetensors").write_bytes(b"tiny weights")
    return str(folder)


def _vllm_config():
    return SimpleNamespace(
        model_config=SimpleNamespace(model=_checkpoint(), revision=None, dtype="float32"),
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


def pixels(content: str):
    """The processed tensors of a picture (a `MultiModalKwargsItem` as vLLM's processor makes
    it: pixel patches and the grid), a function of `content` alone."""
    from vllm.multimodal.inputs import (
        MultiModalBatchedField,
        MultiModalFieldElem,
        MultiModalKwargsItem,
    )

    seed = int(hashlib.sha256(content.encode()).hexdigest()[:8], 16)
    patches = torch.rand(16, 12, generator=torch.Generator().manual_seed(seed))
    return MultiModalKwargsItem({
        "pixel_values": MultiModalFieldElem(data=patches, field=MultiModalBatchedField()),
        "image_grid_thw": MultiModalFieldElem(data=torch.tensor([1, 4, 4]),
                                              field=MultiModalBatchedField()),
    })


def _request(req_id: str, tokens: list[int], image_hash: str | None = None,
             embeds: bool = False, uuid: str | None = None):
    """`image_hash`: one image on rows [10, 110) whose pixels are a function of that string
    ("" = its content is not at the scheduler); its identifier is the client's `uuid` when
    given, else vLLM's own hash of the picture."""
    from vllm import SamplingParams
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.v1.request import Request

    mm = None
    if image_hash is not None:
        identifier = uuid or f"vllm-hash-of-{image_hash}"
        mm = [MultiModalFeatureSpec(data=pixels(image_hash) if image_hash else None,
                                    modality="image", identifier=identifier,
                                    mm_position=PlaceholderRange(offset=10, length=100),
                                    mm_hash=identifier)]
    return Request(req_id, tokens, SamplingParams(max_tokens=4), None, mm_features=mm,
                   prompt_embeds=torch.zeros(len(tokens), 8) if embeds else None)


def _commit_cuts(side, req, tokens: list[int], encode: bool = True) -> int:
    """Plan one full cold prefill of `req` through the scheduler side, commit what it reserved.
    `encode`: vLLM runs the encoder on the request's items in that step (as its scheduler does
    for items not in its encoder cache)."""
    side.get_num_new_matched_tokens(req, 0)
    side.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: ([0], [1, 2])), 0)
    so = SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=req.request_id, block_ids=([0], [1, 2]),
                                            num_computed_tokens=0)],
        num_scheduled_tokens={req.request_id: len(tokens)},
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[],
                                              resumed_req_ids=set(), num_computed_tokens=[]),
        scheduled_encoder_inputs=({req.request_id: list(range(len(req.mm_features)))}
                                  if encode and req.mm_features else {}),
        free_encoder_mm_hashes=[])
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


@pytest.mark.parametrize("kind", ["unhashed_image", "embeds"])
def test_unkeyed_request_never_captures(kind):
    side = _scheduler_side()
    req = _request("a", TOKENS, image_hash="" if kind == "unhashed_image" else None,
                   embeds=kind == "embeds")
    assert side.cuts_for(req) is None  # stock vLLM steps
    assert _commit_cuts(side, req, TOKENS) == 0
    assert len(side.tree) == 0
    # and nothing for a text request with the same tokens to hit
    n, _ = side.get_num_new_matched_tokens(_request("b", [*TOKENS, 1]), 0)
    assert n == 0
    n, _ = side.get_num_new_matched_tokens(_request("c", [*TOKENS, 1], image_hash=""), 0)
    assert n == 0
    assert side.tree.stats().misses.get("unkeyed_input") == 1


def _image_hits(side) -> dict[str, int]:
    """Commit the state of TOKENS with image "x"; tokens each later request restores."""
    assert _commit_cuts(side, _request("a", TOKENS, image_hash="x"), TOKENS) == 1
    out = {}
    for name, img in (("same_image", "x"), ("other_image", "y"), ("text_only", None)):
        n, _ = side.get_num_new_matched_tokens(_request(name, [*TOKENS, 1, 2], image_hash=img),
                                               0)
        out[name] = n
    return out


def test_image_request_is_keyed_by_content():
    """Same picture (any URL: the hash is of the content): hit. Another picture, or the same
    placeholder tokens without the picture: no link past the image's first row."""
    assert _image_hits(_scheduler_side()) == {"same_image": len(TOKENS), "other_image": 0,
                                              "text_only": 0}


def test_negative_control_keys_without_the_digest_restore_another_image(monkeypatch):
    """With content ids that ignore the hash, the other image would restore the first one's
    state: what test_image_request_is_keyed_by_content rules out."""
    from vllm_hybridcache.adapter import mm_keys

    monkeypatch.setattr(mm_keys, "content_ids", lambda identifier: (-1, -2, -3, -4))
    hits = _image_hits(_scheduler_side())
    assert hits["other_image"] == len(TOKENS)


def test_image_request_never_hits_a_text_link():
    """Same placeholder tokens, a stored text link on them: an image request must miss."""
    side = _scheduler_side()
    assert _commit_cuts(side, _request("a", TOKENS), TOKENS) == 1
    req = _request("b", [*TOKENS, 1, 2], image_hash="y")
    n, _ = side.get_num_new_matched_tokens(req, 0)
    assert n == 0
    side.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: ([0], [1])), 0)
    assert side.tree.stats().hits == 0


@pytest.mark.parametrize("image_hash,anchored", [("x", True), ("", False)])
def test_end_anchor_only_for_keyed_images(image_hash, anchored):
    from vllm.v1.request import RequestStatus

    side = _scheduler_side()
    req = _request("a", TOKENS, image_hash=image_hash)
    _commit_cuts(side, req, TOKENS)  # its prefill, the encoder run on its picture
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    req.num_computed_tokens = len(TOKENS)
    assert side.request_finished(req, ([0], [1, 2])) is anchored
    assert side._finishing == [] if not anchored else len(side._finishing) == 1
