"""Session spill on the MTP route, at the scheduler side (no model): on by default with
speculative decoding where end anchors are on (synchronous scheduling), with the anchor tag
types in the disk anchor tier's codec; off with async scheduling, where end anchors are off
with drafts. The engine test is tests/connector/test_mtp_disk.py."""

from __future__ import annotations

from types import SimpleNamespace

from tests.adapter.test_unkeyed_inputs import _vllm_config
from tests.unit.test_disk_tier_adapter import _side


def _mtp_config(async_scheduling: bool):
    """vLLM's config with MTP drafts of a head the boundary rows are not rebuilt for (tags of
    the draft path: NextToken for anchors)."""
    cfg = _vllm_config()
    cfg.speculative_config = SimpleNamespace(
        method="mtp", num_speculative_tokens=1, disable_padded_drafter_batch=False,
        parallel_drafting=False,
        draft_model_config=SimpleNamespace(hf_config=SimpleNamespace(architectures=["Other"])))
    cfg.scheduler_config = SimpleNamespace(async_scheduling=async_scheduling)
    return cfg


def test_session_spill_is_on_with_drafts_and_carries_the_anchor_tags(tmp_path):
    from vllm_hybridcache.adapter.draft_tags import NextToken, RebuiltAnchor

    side = _side(tmp_path, _mtp_config(async_scheduling=False))
    assert side.base_domain["route"] == "mtp" and side.anchors.enabled
    disk = side.cache.lower("disk")
    assert disk.spill is not None and disk.anchors is not None
    assert disk.target.spill
    codec = disk.anchors.tags
    for tag in (NextToken(5), RebuiltAnchor()):
        assert codec.decode(codec.encode(tag)) == tag
    # the tree tier's codec does not take anchor tags, nor the anchor tier's tree tags
    assert disk.disk.tags.decode(codec.encode(RebuiltAnchor())) != RebuiltAnchor()


def test_no_session_spill_where_anchors_are_off_with_drafts(tmp_path):
    side = _side(tmp_path, _mtp_config(async_scheduling=True))
    assert not side.anchors.enabled
    disk = side.cache.lower("disk")
    assert disk.spill is None and disk.anchors is None and not disk.target.spill
