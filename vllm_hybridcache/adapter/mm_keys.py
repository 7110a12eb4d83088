"""Key token ids for prompts with multimodal items: placeholders replaced by content ids.

An image sits in the prompt as a run of placeholder tokens, the same ids for every picture, so
a key made of the prompt's token ids alone would hand one image's state to a request about
another. vLLM already hashes every item's content (`MultiModalFeatureSpec.identifier`: a digest
of the processed item, LoRA-prefixed where one applies; or the client's own `multi_modal_uuids`,
which vLLM's encoder cache trusts the same way). The cache keys a prompt on *key ids*: the
prompt's token ids with every embedding position of an item replaced by a negative id derived
from that item's identifier. Token ids are never negative, so a content id can never equal a
text token; positions of an item's range that take no embedding (`is_embed` false) keep their
token id, since the state there does not depend on the item's pixels.

What follows for exactness: two prompts share a key prefix exactly as far as they share text
*and* item contents. Same pixels under another URL hash the same and hit; new pixels at the
same URL differ from the item's first embedding position on; text before the first item is
shared with text-only prompts.

Cuts inside an item. The segmentation is a function of the token ids and may cut inside a
placeholder range; that is safe and needs no special case. vLLM 0.32's scheduler
(`_try_schedule_encoder_inputs`) runs the encoder on the *whole* item whenever any of its
positions is scheduled (the tower attends over the whole item) and caches its output by the
item's hash, so every step, cold or resumed, reads the rows of the complete item's output: the
state at a cut inside an item is the same whichever way the prefill got there. Its key holds at
least the item's first content id, which already names the whole item (the hash covers every
pixel and the grid), so no other picture can share it. M-RoPE positions after an item depend on
its grid, which the hash covers as well.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

_MASK62 = (1 << 62) - 1


class UnkeyableInput(ValueError):
    """The request carries an input whose content cannot be named (no usable hash)."""


def content_ids(identifier: str) -> tuple[int, int, int, int]:
    """Four negative ids carrying 248 bits of sha256(identifier), cycled over an item's rows."""
    digest = hashlib.sha256(identifier.encode("utf-8")).digest()
    words = (int.from_bytes(digest[i:i + 8], "little") & _MASK62 for i in range(0, 32, 8))
    return tuple(-(1 + w) for w in words)  # type: ignore[return-value]


def request_key_ids(request, tokens: Sequence[int]) -> list[int] | None:
    """Key ids of `tokens` (the request's prompt, or prompt plus output for an end anchor)
    under the request's multimodal items; None when the request cannot be keyed: prompt
    embeddings (their rows have no ids at all) or an item without a usable hash."""
    if getattr(request, "prompt_embeds", None) is not None:
        return None
    try:
        return key_token_ids(tokens, getattr(request, "mm_features", None))
    except UnkeyableInput:
        return None


def key_token_ids(prompt: Sequence[int], mm_features: Sequence | None) -> list[int]:
    """The prompt's key ids (see module docstring); the prompt itself when it has no items.

    Raises UnkeyableInput when an item has no identifier or a placeholder range that does not
    lie inside the prompt: the caller then serves the request without the cache.
    """
    keys = list(prompt)
    for feature in mm_features or ():
        identifier = getattr(feature, "identifier", None)
        if not isinstance(identifier, str) or not identifier:
            raise UnkeyableInput(f"a {getattr(feature, 'modality', 'multimodal')} item has no "
                                 "content hash")
        pos = feature.mm_position
        start, length = int(pos.offset), int(pos.length)
        if start < 0 or length <= 0 or start + length > len(keys):
            raise UnkeyableInput(f"placeholder range [{start}, {start + length}) outside the "
                                 f"prompt of {len(keys)} tokens")
        ids = content_ids(identifier)
        mask = pos.is_embed.tolist() if pos.is_embed is not None else None
        j = 0
        for i in range(length):
            if mask is None or mask[i]:
                keys[start + i] = ids[j % len(ids)]
                j += 1
    return keys
