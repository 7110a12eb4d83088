"""Key ids of multimodal prompts: content decides, URLs and placeholders do not."""

from __future__ import annotations

import pytest
import torch

from vllm_hybridcache.adapter.mm_keys import UnkeyableInput, content_ids, key_token_ids

PAD = 151655  # one placeholder id for every image, as in Qwen-VL prompts


def _item(identifier: str | None, offset: int, length: int, is_embed=None):
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    return MultiModalFeatureSpec(data=None, modality="image", identifier=identifier,
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
    x1 = key_token_ids(p, [_item("sha-of-pixels-x", 10, 8)])
    x2 = key_token_ids(p, [_item("sha-of-pixels-x", 10, 8)])  # same pixels, another URL
    y = key_token_ids(p, [_item("sha-of-pixels-y", 10, 8)])
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


@pytest.mark.parametrize("identifier,offset,length", [(None, 10, 8), ("", 10, 8),
                                                      ("x", 20, 8), ("x", -1, 4), ("x", 3, 0)])
def test_items_without_a_hash_or_outside_the_prompt_are_refused(identifier, offset, length):
    with pytest.raises(UnkeyableInput):
        key_token_ids(_prompt(), [_item(identifier, offset, length)])
