"""Draft tags in link files: a RAM link's tag as plain data, and back.

On a speculative (MTP) route a link's bytes are only valid for prompts whose draft rows it
fits: the RAM tiers keep an opaque tag per link and a lookup's `fits(p, tag)` predicate reads
it. The adapter's tags: for a tree link, the first position of the prefill step that ended at
the cut on Flash-Next's rebuild route, the prompt tokens the boundary draft row read on the
others; for an end anchor, a field-less marker on the rebuild route (its boundary row is
rebuilt for whatever token comes next), the token its last draft row read on the others. A
link file (tree link or spilled end anchor) must carry that tag exactly, or a restore from
disk could serve a prompt the link does not fit. The core imports no adapter code, so the
adapter names the tag types it uses (`TagCodec(types)`, one codec per kind of file: a tag
type of the other kind decodes as unknown) and this module only moves their integer fields:

    None                        -> no tag (the AR route)
    an int                      -> ("int", (v,))
    a tuple of ints             -> ("tuple", (v, ...))
    a NamedTuple of ints named  -> (its class name, its fields; () for a field-less marker)

Anything else cannot be carried (`UnencodableTag`): such a link is not written. A file whose
tag names a type this engine does not know decodes to a value equal to nothing, so it fits no
prompt (a miss, never a guess).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from enum import StrEnum

__all__ = ["EncodedTag", "TagCodec", "TagProblem", "UnencodableTag"]

# (type name, integer fields): what a link file's header holds
EncodedTag = tuple[str, tuple[int, ...]]


class TagProblem(StrEnum):
    """The counted reason around draft tags on disk: as a miss, a file whose tag does not fit
    the prompt's draft rows (a deeper chain refused); as a skip, a RAM link whose tag no file
    can carry (not written)."""

    DRAFT_TAG = "draft_tag"


class UnencodableTag(ValueError):
    """A tag the codec cannot write exactly."""


class _Unknown:
    """A tag of a type this engine does not know: equal to nothing, so it fits nothing."""

    __slots__ = ("enc",)

    def __init__(self, enc: EncodedTag) -> None:
        self.enc = enc

    def __eq__(self, other: object) -> bool:
        return False

    def __hash__(self) -> int:
        return hash(self.enc)

    def __repr__(self) -> str:
        return f"<unknown draft tag {self.enc!r}>"


def _ints(values) -> tuple[int, ...]:
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int):
            raise UnencodableTag(f"a tag field {v!r} is not an int")
        out.append(int(v))
    return tuple(out)


class TagCodec:
    """Encode and decode draft tags; `types`: class name -> class, the NamedTuples of ints the
    adapter uses as tags (core/tiers/disk.py gets them from the scheduler side)."""

    def __init__(self, types: Mapping[str, Callable[..., object]] | None = None) -> None:
        self.types = dict(types or {})
        if {"int", "tuple"} & set(self.types):
            raise ValueError("'int' and 'tuple' are the codec's own names")

    def encode(self, tag: object) -> EncodedTag | None:
        """The tag as plain data (None for no tag); UnencodableTag when it cannot be carried."""
        if tag is None:
            return None
        if isinstance(tag, bool):
            raise UnencodableTag("a bool is not a draft tag")
        if isinstance(tag, int):
            return ("int", (int(tag),))
        if isinstance(tag, tuple):
            name = type(tag).__name__
            if type(tag) is tuple:
                return ("tuple", _ints(tag))
            if self.types.get(name) is type(tag):
                return (name, _ints(tag))
        raise UnencodableTag(f"no file can carry a tag of type {type(tag).__name__}")

    def decode(self, enc: EncodedTag | None) -> object:
        """The tag a file carries, as the RAM tiers would hold it."""
        if enc is None:
            return None
        name, values = enc
        values = tuple(int(v) for v in values)
        if name == "int" and len(values) == 1:
            return values[0]
        if name == "tuple":
            return values
        cls = self.types.get(name)
        if cls is None:
            return _Unknown((name, values))
        try:
            return cls(*values)
        except TypeError:  # another arity than this engine's class
            return _Unknown((name, values))
