"""Key token ids for prompts with multimodal items: placeholders replaced by content ids.

An image sits in the prompt as a run of placeholder tokens, the same ids for every picture, so
a key made of the prompt's token ids alone would hand one image's state to a request about
another. The cache keys a prompt on *key ids*: the prompt's token ids with every embedding
position of an item replaced by a negative id derived from a digest of the item's *processed
content* (`item_digest`: the tensors vLLM hands the encoder, field names, dtypes, shapes and
bytes). Token ids are never negative, so a content id can never equal a text token; positions
of an item's range that take no embedding (`is_embed` false) keep their token id, since the
state there does not depend on the item's pixels.

Why not vLLM's `MultiModalFeatureSpec.identifier`: it is the client's own `multi_modal_uuids`
value when the client sends one (vLLM then skips hashing), or a hash of the raw media (an
image's EXIF ImageID when it has one: a client-chosen value again). A key made of it would let
one client plant state under another client's picture, and the disk and cluster tiers would
keep it across restarts and replicas. The identifier only names vLLM's encoder-cache entry,
and that matters for one more rule (`EncoderBindings`): the embeddings a request's prefill
reads are the encoder-cache entry of its identifier, which may hold *another* content when two
requests sent one uuid with different pixels. A link is only captured (and a lookup only
served) while every item's identifier is bound, in this engine, to an encoding of the very
content its key names; otherwise the request is served without the cache.

Where the content is not at the scheduler the request cannot be keyed (`UnkeyableInput`, miss
reason `unkeyed_input`): vLLM 0.32's engine core refills `data` from its receiver cache before
the scheduler sees a request when the processor cache is an `lru` one (the default), and sends
it whole without a processor cache or with `processor_only`; with the `shm` processor cache the
scheduler holds only a shared-memory handle ("address"), which names no content.

What follows for exactness: two prompts share a key prefix exactly as far as they share text
*and* processed item contents. The same pixels under another URL or another PNG encoding give
the same processed tensors and hit; new pixels at the same URL or under the same uuid differ
from the item's first embedding position on; text before the first item is shared with
text-only prompts.

Cuts inside an item. The segmentation is a function of the token ids and may cut inside a
placeholder range; that is safe and needs no special case. vLLM 0.32's scheduler
(`_try_schedule_encoder_inputs`) runs the encoder on the *whole* item whenever any of its
positions is scheduled (the tower attends over the whole item) and caches its output by the
item's identifier, so every step, cold or resumed, reads the rows of the complete item's output:
the state at a cut inside an item is the same whichever way the prefill got there. Its key
holds at least the item's first content id, which already names the whole item (the digest
covers every processed tensor, the grid included), so no other picture can share it. M-RoPE
positions after an item depend on its grid, which the digest covers as well.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from typing import NamedTuple

_MASK62 = (1 << 62) - 1


class UnkeyableInput(ValueError):
    """The request carries an input whose content cannot be named (no usable hash)."""


class MMItem(NamedTuple):
    """One multimodal item of a request, as the cache keys it."""

    identifier: str       # vLLM's encoder-cache key (a client's uuid, or vLLM's hash)
    digest: str | None    # sha256 of the processed content; None: not at the scheduler
    start: int            # first placeholder position
    length: int           # placeholder positions
    is_embed: tuple[bool, ...] | None  # which of them take an embedding (None: all)
    why: str = ""         # why digest is None


def content_ids(digest: str) -> tuple[int, int, int, int]:
    """Four negative ids carrying 248 bits of sha256(digest), cycled over an item's rows."""
    h = hashlib.sha256(digest.encode("utf-8")).digest()
    words = (int.from_bytes(h[i:i + 8], "little") & _MASK62 for i in range(0, 32, 8))
    return tuple(-(1 + w) for w in words)  # type: ignore[return-value]


def _feed(h, tag: bytes, payload: bytes | memoryview) -> None:
    """One framed chunk: tag, length, bytes (the stream is uniquely decodable)."""
    n = payload.nbytes if isinstance(payload, memoryview) else len(payload)
    h.update(tag + n.to_bytes(8, "little"))
    h.update(payload)


def _feed_nested(h, value: object, where: str) -> None:
    """Tensors (dtype, shape, bytes), numpy arrays, nested lists of them, and plain numbers or
    strings; anything else has no canonical bytes here and is refused."""
    import numpy as np
    import torch

    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        _feed(h, b"T", f"{t.dtype}|{tuple(t.shape)}".encode())
        _feed(h, b"B", memoryview(t.reshape(-1).view(torch.uint8).numpy()))
    elif isinstance(value, np.ndarray):
        a = np.ascontiguousarray(value)
        if a.dtype.hasobject:
            raise UnkeyableInput(f"{where}: an object array has no canonical bytes")
        _feed(h, b"A", f"{a.dtype.str}|{a.shape}".encode())
        _feed(h, b"B", memoryview(a.reshape(-1).view(np.uint8)))
    elif isinstance(value, (list, tuple)):
        _feed(h, b"L", len(value).to_bytes(8, "little"))
        for i, v in enumerate(value):
            _feed_nested(h, v, f"{where}[{i}]")
    elif isinstance(value, bool):
        _feed(h, b"b", b"1" if value else b"0")
    elif isinstance(value, (int, float)):
        _feed(h, b"n", f"{type(value).__name__}:{value!r}".encode())
    elif isinstance(value, str):
        _feed(h, b"s", value.encode("utf-8"))
    else:
        raise UnkeyableInput(f"{where}: a {type(value).__name__} has no canonical bytes")


def item_digest(feature) -> str:
    """sha256 of one item's processed content (`MultiModalFeatureSpec.data`, a
    `MultiModalKwargsItem`): per field, in name order, its name, its field kind and its
    data's dtypes, shapes and bytes; the modality first. The item's identifier is not mixed
    in: the same content under two uuids (or two URLs) is the same state.

    Raises UnkeyableInput when the content is not there: no data (a processor cache that
    elided it and no receiver cache that refilled it), a shared-memory handle, a field without
    data, or a value with no canonical bytes.
    """
    data = getattr(feature, "data", None)
    modality = str(getattr(feature, "modality", "multimodal"))
    if data is None:
        raise UnkeyableInput(f"a {modality} item's content is not at the scheduler")
    if "address" in data:
        raise UnkeyableInput(f"a {modality} item is a shared-memory handle, not its content")
    h = hashlib.sha256()
    _feed(h, b"M", modality.encode("utf-8"))
    for key in sorted(data):
        elem = data[key]
        field = getattr(elem, "field", None)
        value = getattr(elem, "data", None)
        if value is None:
            raise UnkeyableInput(f"{modality} field {key!r} carries no data")
        _feed(h, b"K", str(key).encode("utf-8"))
        _feed(h, b"F", f"{type(field).__name__}:{getattr(field, 'dim', '')}".encode())
        _feed_nested(h, value, f"{modality}.{key}")
    return h.hexdigest()


def request_items(mm_features: Sequence | None) -> tuple[MMItem, ...]:
    """The request's items with their content digests (None, with why, where the content
    cannot be named). Raises UnkeyableInput for an item without an identifier or position."""
    items = []
    for feature in mm_features or ():
        identifier = getattr(feature, "identifier", None)
        if not isinstance(identifier, str) or not identifier:
            raise UnkeyableInput(f"a {getattr(feature, 'modality', 'multimodal')} item has no "
                                 "identifier")
        pos = feature.mm_position
        mask = pos.is_embed.tolist() if getattr(pos, "is_embed", None) is not None else None
        try:
            digest, why = item_digest(feature), ""
        except UnkeyableInput as e:
            digest, why = None, str(e)
        items.append(MMItem(identifier, digest, int(pos.offset), int(pos.length),
                            tuple(bool(m) for m in mask) if mask is not None else None, why))
    return tuple(items)


def keys_from_items(prompt: Sequence[int], items: Sequence[MMItem]) -> list[int]:
    """The key ids of `prompt` under `items` (see module docstring); the prompt itself when
    there are none. Raises UnkeyableInput when an item has no content digest or a placeholder
    range that does not lie inside the prompt: the caller then serves the request without
    the cache."""
    keys = list(prompt)
    for item in items:
        if item.digest is None:
            raise UnkeyableInput(item.why or "an item's content is not known")
        start, length = item.start, item.length
        if start < 0 or length <= 0 or start + length > len(keys):
            raise UnkeyableInput(f"placeholder range [{start}, {start + length}) outside the "
                                 f"prompt of {len(keys)} tokens")
        ids = content_ids(item.digest)
        j = 0
        for i in range(length):
            if item.is_embed is None or item.is_embed[i]:
                keys[start + i] = ids[j % len(ids)]
                j += 1
    return keys


def key_token_ids(prompt: Sequence[int], mm_features: Sequence | None) -> list[int]:
    """The prompt's key ids under its multimodal features (digests computed here)."""
    return keys_from_items(prompt, request_items(mm_features))


def request_key_ids(request, tokens: Sequence[int],
                    items: Sequence[MMItem] | None = None) -> list[int] | None:
    """Key ids of `tokens` (the request's prompt, or prompt plus output for an end anchor)
    under the request's multimodal items (`items`: already computed for it); None when the
    request cannot be keyed: prompt embeddings (their rows have no ids at all) or an item
    whose content cannot be named."""
    if getattr(request, "prompt_embeds", None) is not None:
        return None
    try:
        if items is None:
            items = request_items(getattr(request, "mm_features", None))
        return keys_from_items(tokens, items)
    except UnkeyableInput:
        return None


_MISSING = object()


class EncoderBindings:
    """Which content vLLM's encoder cache holds under each identifier, as this engine saw it.

    vLLM 0.32 keeps the encoder's output per item identifier beyond the request that computed
    it (`EncoderCacheManager`: an entry stays until its space is needed and it is listed in a
    step's `free_encoder_mm_hashes`), and a later request whose item has the same identifier
    reads that output without running the encoder: with a client's uuid, possibly another
    picture's. The scheduler side tells this book, every step, what vLLM freed and what it
    encoded (`scheduled_encoder_inputs`, with the digest of the encoded request's content), so
    the embeddings behind an identifier are known: `bound(item)` holds when they are an
    encoding of the item's own content. A request whose prefill reads an item that is not
    bound captures nothing from there on, and a lookup for one whose identifier is bound to
    other content is not served. An encoding the book cannot attribute (a request it does not
    know) makes it `lost`: nothing is bound any more, for this engine's life (on doubt, miss).
    vLLM's `EncoderCacheManager.reset()` (a weight update) is not seen: its entries stay here,
    which can only make an identifier conflict (a miss), never bind it to content vLLM does not
    hold, since an identifier vLLM no longer holds is encoded again from the request's own
    content.
    """

    def __init__(self) -> None:
        self._bound: dict[str, str | None] = {}
        self.lost = False

    def __len__(self) -> int:
        return len(self._bound)

    def observe(self, freed: Iterable[str], encoded: Iterable[tuple[str, str | None]]) -> None:
        """One step: entries vLLM evicted (its workers drop them before encoding), then what
        it encodes, as (identifier, digest of the content encoded; None: not known)."""
        for identifier in freed:
            self._bound.pop(identifier, None)
        for identifier, digest in encoded:
            self._bound[identifier] = digest

    def lose(self) -> None:
        self.lost = True
        self._bound.clear()

    def bound(self, item: MMItem) -> bool:
        """The encoder output under the item's identifier is an encoding of its content."""
        return (not self.lost and item.digest is not None
                and self._bound.get(item.identifier, _MISSING) == item.digest)

    def conflicts(self, item: MMItem) -> bool:
        """The encoder output under the item's identifier is (or may be) of other content: a
        prefill of this request would read embeddings its key does not name."""
        if self.lost:
            return True
        held = self._bound.get(item.identifier, _MISSING)
        return held is not _MISSING and (held is None or held != item.digest)
