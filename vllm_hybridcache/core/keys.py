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

__all__ = ["BLOCK", "Hasher", "PromptKeys", "as_tokens", "blake2b_128", "make_domain"]

BLOCK = 64
TOKEN_DTYPE = np.int64
_ISZ = 8  # bytes per stored token id

Hasher = Callable[[bytes], bytes]


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


def make_domain(**fields: Any) -> bytes:
    """Canonical digest (sha256, 32 bytes) of everything that must match for two keys to compare.

    Pass the weights fingerprint, dtypes, KV layout, tp/pp rank and size, route (AR/MTP), LoRA
    adapter, cache_salt, image digests, ... as keyword fields. The encoding is JSON with sorted
    keys (bytes become base64), so field order never changes the domain, while any changed value
    does. Values must be JSON-encodable by msgspec (str, int, float, bool, None, bytes, lists,
    tuples, dicts with str keys, msgspec structs).
    """
    payload = msgspec.json.encode({"v": 1, "fields": fields}, order="sorted")
    return hashlib.sha256(payload).digest()


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
