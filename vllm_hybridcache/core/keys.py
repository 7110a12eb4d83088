"""Keys: domains and chained prefix digests.

A link is addressed by (domain, p, digest(tokens[:p])). The digest chains over fixed blocks of
BLOCK tokens, D_0 = b"", D_k = H(D_{k-1} || block_k), and the key of any cut p is
H(D_{p // BLOCK} || tail || p) where tail is the partial block. A prompt's chain is computed
lazily, once, in O(p); every candidate cut then costs one hash of fewer than BLOCK tokens.

The default H is blake2b with a 128-bit digest. A digest is a hint, never an answer: the tree
compares the stored tokens element by element before anything is restored, so a collision (or a
deliberately weak hasher injected by a test) can only cost a miss, never a wrong restore.
"""

from __future__ import annotations

import array
import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import numpy as np

__all__ = ["BLOCK", "DOMAIN_BYTES", "TENANT_BYTES", "Hasher", "PromptKeys", "as_tokens",
           "blake2b_128", "in_tenant", "make_domain", "tenant_of", "tenant_tag"]

BLOCK = 64
TOKEN_DTYPE = np.int64
_ISZ = 8  # bytes per stored token id

Hasher = Callable[[bytes], bytes]

TENANT_BYTES = 16  # the tenant tag: the last 16 bytes of a domain
DOMAIN_BYTES = 32  # digest of every field (16 bytes), then the tenant tag
TENANT_FIELD = "cache_salt"  # the make_domain field that names the tenant
_TENANT_PERSON = b"hc-tenant-v1"  # blake2b personalisation: a tag is no other digest


def blake2b_128(data: bytes) -> bytes:
    """The default hasher: blake2b with a 128-bit digest (fast, cryptographic)."""
    return hashlib.blake2b(data, digest_size=16).digest()


def as_tokens(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    """A read-only 1-D int64 array of token ids (no copy when it already is one)."""
    if isinstance(tokens, np.ndarray):
        arr = np.ascontiguousarray(tokens, dtype=TOKEN_DTYPE)
        if arr is tokens and arr.flags.writeable:
            arr = arr.copy()  # never alias a caller's writable buffer
    else:
        try:  # array.array parses a list of ints several times faster than np.array
            arr = np.frombuffer(array.array("q", tokens), dtype=TOKEN_DTYPE)
        except TypeError:
            arr = np.array(tokens, dtype=TOKEN_DTYPE)
    if arr.ndim != 1:
        raise ValueError("tokens must be one-dimensional")
    arr.flags.writeable = False
    return arr


def tenant_tag(salt: str) -> bytes:
    """The 16-byte tag of the tenant named by a request's `cache_salt` ("" for requests without
    one: they share one tenant).

    Why a tag inside every domain: clearing one tenant's links (`clear_tenant` on every tier)
    must find them without knowing every other field of their domains (route, LoRA adapter,
    weights). The tag is a blake2b of the salt alone, personalised for this use (it never
    equals a digest made for another purpose), and it does not reveal the salt.
    """
    if not isinstance(salt, str):
        raise TypeError(f"a cache_salt is a str, got {type(salt).__name__}")
    return hashlib.blake2b(salt.encode("utf-8"), digest_size=TENANT_BYTES,
                           person=_TENANT_PERSON).digest()


def tenant_of(domain: bytes) -> bytes:
    """The tenant tag a domain made by `make_domain` ends with."""
    return domain[DOMAIN_BYTES - TENANT_BYTES:DOMAIN_BYTES]


def in_tenant(tag: bytes) -> Callable[[bytes], bool]:
    """A predicate: whether a domain belongs to the tenant `tag` (what a tenant's clear asks
    of every index of domains)."""
    tag = bytes(tag)

    def of_tag(domain: bytes) -> bool:
        return tenant_of(domain) == tag

    return of_tag


def make_domain(**fields: Any) -> bytes:
    """Canonical 32-byte domain of everything that must match for two keys to compare.

    Pass the weights fingerprint, dtypes, KV layout, tp/pp rank and size, route (AR/MTP), LoRA
    adapter, cache_salt, image digests, ... as keyword fields. The encoding is JSON with sorted
    keys (bytes become base64), so field order never changes the domain, while any changed value
    does. Values must be JSON-encodable by msgspec (str, int, float, bool, None, bytes, lists,
    tuples, dicts with str keys, msgspec structs).

    Layout: the first 16 bytes are the sha256 of every field (the salt included), the last 16
    the tenant tag of the `cache_salt` field (`tenant_tag`; "" when absent). The digest comes
    first so that a short prefix of a domain, wherever one is shown or used, still tells apart
    two domains of one tenant (another adapter, another route); the tag is last, and
    `tenant_of(domain)` names the tenant without the other fields, for a tenant's clear.
    """
    salt = fields.get(TENANT_FIELD, "")
    if salt is None:
        salt = ""
    payload = msgspec.json.encode({"v": 2, "fields": fields}, order="sorted")
    return hashlib.sha256(payload).digest()[:DOMAIN_BYTES - TENANT_BYTES] + tenant_tag(salt)


class PromptKeys:
    """The tokens of one prompt and the digests of its prefixes, computed lazily.

    Build one per prompt (SnapshotTree.keys) and pass it to lookup and reserve instead of the raw
    tokens to share the hashing work between calls for the same request.
    """

    __slots__ = ("_chain", "_hasher", "_memo", "raw", "tokens")

    def __init__(self, tokens: Sequence[int] | np.ndarray, hasher: Hasher = blake2b_128) -> None:
        self.tokens: np.ndarray = as_tokens(tokens)
        self._hasher = hasher
        self.raw: bytes = self.tokens.tobytes()  # int64 ids (native order), compared verbatim
        self._chain: list[bytes] = [b""]
        self._memo: dict[int, bytes] = {}

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def hasher(self) -> Hasher:
        return self._hasher

    @property
    def memo(self) -> dict[int, bytes]:
        """Digests computed so far, by cut (read-only for callers)."""
        return self._memo

    def digest(self, p: int) -> bytes:
        """Key digest of tokens[:p]; O(BLOCK) once the chain reaches p // BLOCK."""
        memo = self._memo.get(p)
        if memo is not None:
            return memo
        if p < 0 or p > len(self):
            raise ValueError(f"cut {p} outside the prompt (length {len(self)})")
        k = p // BLOCK
        chain = self._chain
        if k >= len(chain):
            h = self._hasher
            raw = self.raw
            step = BLOCK * _ISZ
            prev = chain[-1]
            for i in range(len(chain), k + 1):
                prev = h(prev + raw[(i - 1) * step : i * step])
                chain.append(prev)
        tail = self.raw[k * BLOCK * _ISZ : p * _ISZ]
        d = self._hasher(chain[k] + tail + p.to_bytes(8, "little"))
        self._memo[p] = d
        return d

    def token_bytes(self, start: int, end: int) -> bytes:
        """The raw bytes of tokens[start:end] (what a link stores and verification compares)."""
        return self.raw[start * _ISZ : end * _ISZ]
