"""Images are keyed by what the model reads, never by a client's uuid.

vLLM's `MultiModalFeatureSpec.identifier` is the client's `multi_modal_uuids` value when one is
given; the old keys were made of it, so a client could plant a state under another client's
image uuid, and the disk and cluster tiers kept it. Now: key ids carry a digest of the item's
processed tensors (`mm_keys.item_digest`), and since vLLM's encoder cache serves embeddings by
identifier (possibly another content's), a request is only served and captured while its
items' identifiers are bound to encodings of their own content (`EncoderBindings`).

Real scheduler side (and worker side for the disk tier), vLLM's own `Request` objects; no
engine. Each test that shows a refusal has a negative control with the old keying or without
the bindings, where the planted state is served.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from tests.adapter.test_unkeyed_inputs import TOKENS, _commit_cuts, _request, _scheduler_side
from tests.unit.test_disk_tier_adapter import _side as _disk_side
from tests.unit.test_disk_tier_adapter import _worker
from tests.unit.test_tiered_cache_adapter import _no_steps, _report
from vllm_hybridcache.adapter import mm_keys
from vllm_hybridcache.core import LinkKind

PROMPT = [*TOKENS, 1, 2]  # the image on rows [10, 110), a cut at 200 before the tail


def _hits(side, req) -> int:
    n, _ = side.get_num_new_matched_tokens(req, 0)
    return n or 0


def _step(side, reqs, encoded: dict[str, list[int]], freed=()) -> int:
    """One step prefilling every request of `reqs` whole (new requests), with vLLM's encoder
    running on `encoded`; commits what was captured. Returns the captures."""
    so = SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r.request_id, block_ids=([0], [1, 2]),
                                            num_computed_tokens=0) for r in reqs],
        num_scheduled_tokens={r.request_id: len(TOKENS) for r in reqs},
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[],
                                              resumed_req_ids=set(), num_computed_tokens=[]),
        scheduled_encoder_inputs=encoded, free_encoder_mm_hashes=list(freed))
    for r in reqs:
        entry = side._track(r)
        entry.cuts, entry.cut_set = [len(TOKENS)], frozenset([len(TOKENS)])
    plan = side.build_plan(so)
    side.apply_report(_report(saved={c.addr: 0.0 for c in plan.captures},
                              saved_count={c.addr: 1 for c in plan.captures}))
    return len(plan.captures)


def _write_to_disk(side, worker, req) -> None:
    """Commit `req`'s link at 128 (its item encoded) and let the worker write the file."""
    entry = side._track(req)
    side._encoded.observe([], [(i.identifier, i.digest) for i in entry.items])
    r = side.cache.reserve(LinkKind.TREE, entry.keys, 128, entry.domain)
    bufs = worker.store.allocate(r.link_id, side.parts.layout.view_rows(r.start, r.end))
    for t in (*bufs.sections.values(), *bufs.views.values()):
        t.fill_(1)
    worker.store.seal(r.link_id)
    side.apply_report(_report(saved={r.addr: 0.0}, saved_count={r.addr: 1}))
    worker.save(side.build_plan(_no_steps()))
    assert worker.handlers["disk"].writer.close(30)


def _restart_hits(tmp_path) -> dict[str, int]:
    """Client 1 sends picture A under uuid "shared-uuid"; its link is written to disk. After a
    restart: what each later request restores."""
    side, worker = _disk_side(tmp_path), _worker()
    _write_to_disk(side, worker, _request("w", TOKENS, "pixels-A", uuid="shared-uuid"))
    out = {}
    for name, content, uuid in (("same_uuid_other_pixels", "pixels-B", "shared-uuid"),
                                ("same_pixels_other_uuid", "pixels-A", "another-uuid"),
                                ("same_pixels_no_uuid", "pixels-A", None)):
        restarted = _disk_side(tmp_path)  # a fresh engine: empty RAM, no bindings
        out[name] = _hits(restarted, _request(name, PROMPT, content, uuid=uuid))
    return out


def test_after_a_restart_a_uuid_never_brings_another_pictures_state(tmp_path):
    assert _restart_hits(tmp_path) == {"same_uuid_other_pixels": 0,
                                       "same_pixels_other_uuid": 128,
                                       "same_pixels_no_uuid": 128}


def test_negative_control_keys_by_identifier_plant_state_under_a_uuid(tmp_path, monkeypatch):
    """The old keying (the identifier as the item's name): the other picture under the same
    uuid restores picture A's state from disk, and the same picture without it misses."""
    monkeypatch.setattr(mm_keys, "item_digest", lambda feature: feature.identifier)
    hits = _restart_hits(tmp_path)
    assert hits["same_uuid_other_pixels"] == 128
    assert hits["same_pixels_other_uuid"] == 0


def _planting(side) -> dict[str, int]:
    """In one engine: client 1 sends A under uuid U (encoded, captured). Client 2 sends B
    under U: vLLM's encoder cache has U, so its prefill reads A's embeddings. Then a third
    request sends B under its own uuid: it must not get client 2's state."""
    assert _commit_cuts(side, _request("c1", TOKENS, "pixels-A", uuid="U"), TOKENS) == 1
    c2 = _request("c2", PROMPT, "pixels-B", uuid="U")
    out = {"c2_hit": _hits(side, c2)}
    out["c2_captures"] = _step(side, [c2], encoded={})  # vLLM read U from its encoder cache
    out["c3_hit"] = _hits(side, _request("c3", PROMPT, "pixels-B", uuid="V"))
    return out


def test_a_prefill_that_read_another_pictures_embeddings_is_not_captured():
    side = _scheduler_side()
    assert _planting(side) == {"c2_hit": 0, "c2_captures": 0, "c3_hit": 0}
    assert side._live["c2"].unkeyed  # its uuid's embeddings are A's: miss `unkeyed_input`


def test_negative_control_without_the_bindings_the_state_is_planted(monkeypatch):
    """Content keys alone are not enough: without the encoder bindings client 2's prefill
    (A's embeddings, B's key) is captured and served to a request that really sends B."""
    monkeypatch.setattr(mm_keys.EncoderBindings, "conflicts", lambda self, item: False)
    monkeypatch.setattr(mm_keys.EncoderBindings, "bound", lambda self, item: True)
    out = _planting(_scheduler_side())
    assert out["c2_captures"] == 1 and out["c3_hit"] == len(TOKENS)


def test_two_requests_in_one_step_share_an_encoding_only_of_one_content():
    """Both new in one step with uuid U, pixels B and A: vLLM encodes U once, from the first
    (its scheduler finds U allocated for the second). The second read B's embeddings: it
    captures nothing; the first captures its link."""
    side = _scheduler_side()
    first = _request("first", TOKENS, "pixels-B", uuid="U")
    second = _request("second", TOKENS, "pixels-A", uuid="U")
    assert _hits(side, first) == 0 and _hits(side, second) == 0
    assert _step(side, [first, second], encoded={"first": [0]}) == 1
    assert side._live["second"].unbound and not side._live["first"].unbound
    assert _hits(side, _request("third", PROMPT, "pixels-B", uuid="W")) == len(TOKENS)
    assert _hits(side, _request("fourth", PROMPT, "pixels-A", uuid="X")) == 0


def test_once_vllm_evicts_the_entry_the_uuid_is_free_again():
    side = _scheduler_side()
    assert _commit_cuts(side, _request("c1", TOKENS, "pixels-A", uuid="U"), TOKENS) == 1
    assert _step(side, [], encoded={}, freed=["U"]) == 0
    c2 = _request("c2", TOKENS, "pixels-B", uuid="U")
    assert _hits(side, c2) == 0 and not side._live["c2"].unkeyed
    assert _step(side, [c2], encoded={"c2": [0]}) == 1  # encoded from its own pixels


def test_an_encoding_of_an_unknown_request_turns_the_image_cache_off(caplog):
    caplog.set_level(logging.WARNING, logger="vllm_hybridcache")
    side = _scheduler_side()
    _step(side, [], encoded={"not-tracked": [0]})
    assert side._encoded.lost
    req = _request("a", TOKENS, "pixels-A")
    assert _hits(side, req) == 0 and side._live["a"].unkeyed
    assert len([r for r in caplog.records if "does not know" in r.getMessage()]) == 1
    assert _commit_cuts(side, _request("text", TOKENS), TOKENS) == 1  # text goes on


def test_a_shared_memory_handle_is_unkeyed():
    """vLLM's `shm` processor cache leaves the scheduler an address, not the content."""
    from vllm.multimodal.inputs import (
        MultiModalFieldElem,
        MultiModalKwargsItem,
        MultiModalSharedField,
    )

    side = _scheduler_side()
    req = _request("a", TOKENS, "pixels-A")
    shared = MultiModalSharedField(batch_size=1)
    req.mm_features[0].data = MultiModalKwargsItem({
        k: MultiModalFieldElem(data=v, field=shared)
        for k, v in {"address": 0, "monotonic_id": 1, "signature": [3]}.items()})
    assert side.cuts_for(req) is None
    assert _commit_cuts(side, req, TOKENS) == 0
    assert side.tree.stats().misses.get("unkeyed_input") == 1


@pytest.mark.parametrize("kind,cap", [("text", 192), ("image", 0)])
def test_vllms_prefix_cache_serves_no_block_from_an_item_on(kind, cap):
    """vLLM's block hashes name an item by its identifier: beside a content-keyed link, the
    attention blocks vLLM's prefix cache may serve end before the first item."""
    side = _scheduler_side()
    side.in_place_block = 16
    image = "pixels-A" if kind == "image" else None
    assert _commit_cuts(side, _request("a", TOKENS, image, uuid="U" if image else None),
                        TOKENS) == 1
    req = _request("b", PROMPT, image, uuid="V" if image else None)
    assert side.in_place_cap(req) == cap
