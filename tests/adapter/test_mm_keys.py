"""Key ids of multimodal prompts: processed content decides; URLs, client uuids and
placeholders do not."""

from __future__ import annotations

import pytest
import torch

from tests.adapter.test_unkeyed_inputs import pixels
from vllm_hybridcache.adapter.mm_keys import (
    EncoderBindings,
    MMItem,
    UnkeyableInput,
    content_ids,
    item_digest,
    key_token_ids,
    request_items,
)

PAD = 151655  # one placeholder id for every image, as in Qwen-VL prompts


def _item(content: str | None, offset: int, length: int, is_embed=None,
          identifier: str | None = "auto", data=None):
    """An image item whose processed tensors are a function of `content` (None: no data at
    the scheduler); `identifier`: vLLM's encoder-cache key (a client's uuid, or its hash;
    "auto": one derived from the content, as vLLM's own hash would be)."""
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    if identifier == "auto":
        identifier = f"vllm-hash-{content}"
    if data is None and content is not None:
        data = pixels(content)
    return MultiModalFeatureSpec(data=data, modality="image", identifier=identifier,
                                 mm_position=PlaceholderRange(offset=offset, length=length,
                                                              is_embed=is_embed))


def _prompt(n_text: int = 10, n_img: int = 8, tail: int = 5) -> list[int]:
    return list(range(100, 100 + n_text)) + [PAD] * n_img + list(range(500, 500 + tail))


def _shared(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_text_only_prompt_is_its_own_key():
    p = _prompt()
    assert key_token_ids(p, None) == p
    assert key_token_ids(p, []) == p


def test_same_content_same_key_other_content_diverges_at_the_item():
    p = _prompt()
    x1 = key_token_ids(p, [_item("pixels-x", 10, 8)])
    # same pixels, another URL or encoding (vLLM hashes the raw bytes: another identifier)
    x2 = key_token_ids(p, [_item("pixels-x", 10, 8, identifier="vllm-hash-of-the-jpeg")])
    y = key_token_ids(p, [_item("pixels-y", 10, 8)])
    assert x1 == x2
    assert _shared(x1, y) == 10  # text before the item is shared, nothing from the item on
    assert _shared(x1, p) == 10  # and with a text-only prompt of the same prefix
    assert all(t < 0 for t in x1[10:18]) and x1[18:] == p[18:]


def test_content_ids_are_negative_and_distinct():
    ids = content_ids("a")
    assert all(i < 0 for i in ids) and len(set(ids)) == 4
    assert set(ids).isdisjoint(content_ids("b"))


def test_positions_without_embeddings_keep_their_token():
    p = _prompt()
    p[12] = 777  # a text token inside the range (e.g. a timestamp between frames)
    mask = torch.ones(8, dtype=torch.bool)
    mask[2] = False
    k = key_token_ids(p, [_item("x", 10, 8, is_embed=mask)])
    assert k[12] == 777
    assert all(t < 0 for i, t in enumerate(k[10:18]) if i != 2)


def test_two_items_each_keyed_by_its_own_content():
    p = _prompt(n_text=4, n_img=4, tail=0) + [9, 9] + [PAD] * 4
    k_xy = key_token_ids(p, [_item("x", 4, 4), _item("y", 10, 4)])
    k_xz = key_token_ids(p, [_item("x", 4, 4), _item("z", 10, 4)])
    assert _shared(k_xy, k_xz) == 10


@pytest.mark.parametrize("content,identifier,offset,length", [
    (None, "u", 10, 8), ("x", None, 10, 8), ("x", "", 10, 8), ("x", "u", 20, 8),
    ("x", "u", -1, 4), ("x", "u", 3, 0)])
def test_items_without_content_or_outside_the_prompt_are_refused(content, identifier, offset,
                                                                  length):
    with pytest.raises(UnkeyableInput):
        key_token_ids(_prompt(), [_item(content, offset, length, identifier=identifier)])


def test_a_client_uuid_never_replaces_the_content():
    """Two clients send one uuid with different pictures: no shared key id from the item on.
    (vLLM's identifier is the uuid for both: a key made of it planted one client's state under
    the other's picture.)"""
    p = _prompt()
    a = key_token_ids(p, [_item("pixels-a", 10, 8, identifier="client-uuid-1")])
    b = key_token_ids(p, [_item("pixels-b", 10, 8, identifier="client-uuid-1")])
    assert _shared(a, b) == 10
    assert set(a[10:18]).isdisjoint(b[10:18])


def test_the_same_content_under_two_uuids_is_one_key():
    """Chosen: the identifier is not mixed in. The state of a prefill depends on the content
    its encoder read, not on its name, and `EncoderBindings` makes sure the content read is
    the one the key names."""
    p = _prompt()
    assert (key_token_ids(p, [_item("pixels-a", 10, 8, identifier="uuid-1")])
            == key_token_ids(p, [_item("pixels-a", 10, 8, identifier="uuid-2")]))


def test_the_digest_covers_names_dtypes_shapes_and_bytes():
    import torch
    from vllm.multimodal.inputs import (
        MultiModalBatchedField,
        MultiModalFieldElem,
        MultiModalKwargsItem,
    )

    def item(**fields):
        data = MultiModalKwargsItem({k: MultiModalFieldElem(data=v,
                                                            field=MultiModalBatchedField())
                                     for k, v in fields.items()})
        return _item("unused", 0, 4, data=data)

    base = torch.arange(12, dtype=torch.float32)
    digests = {
        item_digest(item(pixel_values=base)),
        item_digest(item(pixel_values=base.reshape(3, 4))),                 # shape
        item_digest(item(pixel_values=base.view(torch.int32))),             # dtype, same bytes
        item_digest(item(pixel_values_videos=base)),                        # field name
        item_digest(item(pixel_values=base + 1)),                           # bytes
        item_digest(item(pixel_values=base, image_grid_thw=torch.tensor([1, 2, 6]))),
        item_digest(item(pixel_values=[base[:6], base[6:]])),               # nesting
        item_digest(item(pixel_values=base.to(torch.bfloat16))),
    }
    assert len(digests) == 8
    assert item_digest(item(pixel_values=base.clone())) == item_digest(item(pixel_values=base))


def test_a_shared_memory_handle_or_an_empty_field_is_no_content():
    import torch
    from vllm.multimodal.inputs import (
        MultiModalFieldElem,
        MultiModalKwargsItem,
        MultiModalSharedField,
    )

    shared = MultiModalSharedField(batch_size=1)
    handle = MultiModalKwargsItem({k: MultiModalFieldElem(data=v, field=shared) for k, v in
                                   {"address": 4096, "monotonic_id": 7,
                                    "signature": [1, 2]}.items()})
    empty = MultiModalKwargsItem({"pixel_values": MultiModalFieldElem(data=None,
                                                                      field=shared)})
    odd = MultiModalKwargsItem({"pixel_values": MultiModalFieldElem(data=object(),
                                                                    field=shared)})
    for data in (handle, empty, odd):
        with pytest.raises(UnkeyableInput):
            item_digest(_item("unused", 0, 4, data=data))
    (item,) = request_items([_item("unused", 0, 4, data=handle)])
    assert item.digest is None and "shared-memory" in item.why
    assert item_digest(_item("x", 0, 4, data=MultiModalKwargsItem(
        {"pixel_values": MultiModalFieldElem(data=torch.ones(2), field=shared)})))


def _mm(identifier: str, digest: str | None) -> MMItem:
    return MMItem(identifier, digest, 0, 4, None)


def test_encoder_bindings_follow_vllms_encoder_cache():
    book = EncoderBindings()
    a, b = _mm("uuid", "digest-a"), _mm("uuid", "digest-b")
    assert not book.bound(a) and not book.conflicts(a)  # nothing cached: vLLM encodes it
    book.observe([], [("uuid", "digest-a")])
    assert book.bound(a) and not book.conflicts(a)
    assert not book.bound(b) and book.conflicts(b)  # vLLM would read a's embeddings for b
    book.observe(["uuid"], [])  # evicted
    assert not book.bound(a) and not book.conflicts(b)
    book.observe(["uuid"], [("uuid", "digest-b")])  # freed then encoded in one step
    assert book.bound(b) and book.conflicts(a)
    book.observe([], [("other", None)])  # encoded from content that cannot be named
    assert book.conflicts(_mm("other", "digest-a")) and not book.bound(_mm("other", None))
    book.lose()
    assert book.conflicts(b) and not book.bound(b)
