"""Stand-ins for the cluster tests' negative controls and dead owners: a `Ghost` replica that
publishes payloads (tree links or end anchors) under its own name, and forged payloads.

Two kinds of forgery, for the two questions a test asks:
- made WITH the cluster secret (`forge(..., key)`: state bytes altered, every header check,
  CRC and MAC valid, the kind kept): what a bug in a copy would produce. Nothing can tell it
  from a true payload, so it is restored, and the test's comparison with a cold run must
  catch it (the comparison still bites);
- made WITHOUT it (`forge(..., write_key=other_key("cluster"))`, or `forge_keeping_header`:
  the true header bytes, MAC and all, and parts altered so that every CRC-32 still matches):
  what anyone who can list entries but does not hold the secret could offer. It must be
  refused as `unauthenticated` before any byte of it reaches the engine.

This module reads no key itself (callers pass theirs): a Ghost runs in a Ray worker, which
must not make keys of its own by importing tests/keys.py.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import numpy as np
import ray

from vllm_hybridcache.cluster import RayTransport
from vllm_hybridcache.core.auth import LinkKey, key_from_file
from vllm_hybridcache.core.linkformat import linkfile
from vllm_hybridcache.core.linkformat.linkfile import LinkFileHeader, read_header, write_link_file

# The CRC-32 generator polynomial in zlib's (reflected) bit order, as 5 bytes: a message XORed
# with it at any offset keeps its CRC-32 (the difference is a multiple of the polynomial).
CRC_NEUTRAL = (0x1DB710641).to_bytes(5, "little")


@ray.remote(num_cpus=0)
class Ghost:
    """A replica stand-in (another process) that publishes payloads as their owner `owner`,
    then dies. It reads the cluster secret's file `secret_file` itself: the test's own, to be
    let into the directory (what a member of the Ray cluster who read the directory key can
    do, docs/security.md), or another one (a replica of another secret)."""

    def __init__(self, secret_file: str, owner: str = "ghost") -> None:
        self.t = RayTransport(ray.get_runtime_context().gcs_address,
                              key_from_file(secret_file, "cluster"), owner=owner)

    def publish(self, items) -> list:
        """Tree links (RayTransport.publish arguments); a probe object this process owns."""
        for it in items:
            self.t.publish(*it)
        return [ray.put(b"probe")]

    def publish_anchors(self, items) -> int:
        """End anchors (RayTransport.publish_anchor arguments), listed as the ghost's."""
        for it in items:
            self.t.publish_anchor(*it)
        return len(items)

    def withdraw_anchor(self, loc: bytes) -> None:
        self.t.withdraw_anchor(loc)

    def probe(self) -> list:
        """An object this process owns, to learn when the cluster knows it is gone."""
        return [ray.put(b"probe")]


def payload_header(payload: bytes, key: LinkKey, folder: Path) -> tuple[LinkFileHeader, int]:
    """A payload's header, verified under `key` (read_header's every check, the fingerprint
    being the one the header names), and the payload's offset."""
    pre = linkfile._PRE.unpack_from(payload)
    raw = payload[linkfile._PRE.size:linkfile._PRE.size + pre[1]]
    fingerprint = msgspec.msgpack.decode(raw, type=LinkFileHeader).fingerprint
    path = folder / "header.link"
    path.write_bytes(payload)
    try:
        return read_header(path, fingerprint, key)
    finally:
        path.unlink()


def forge(payload: bytes, folder: Path, key: LinkKey, write_key: LinkKey | None = None) -> bytes:
    """The same link with slightly different state bytes and valid checksums, re-written with
    MACs under `write_key` (default `key`, the secret the payload was read with)."""
    h, base = payload_header(payload, key, folder)
    parts = {}
    for e in h.parts:
        a = np.frombuffer(payload, np.uint8, e.nbytes, base + e.offset).copy()
        a[::16] ^= 0x04
        parts[e.name] = a
    dst = folder / "forged.link"
    write_link_file(dst, fingerprint=h.fingerprint, domain=h.domain, digest=h.digest,
                    parent_digest=h.parent_digest, start=h.start, end=h.end,
                    tokens=h.token_ids(), rows=h.rows, parts=parts, kind=h.kind,
                    key=write_key or key)
    data = dst.read_bytes()
    dst.unlink()
    return data


def forge_keeping_header(payload: bytes, folder: Path, key: LinkKey) -> bytes:
    """The payload's own header bytes (its MAC valid) with every part altered so that its
    CRC-32 still matches: only the part MACs, which need the secret, can tell."""
    h, base = payload_header(payload, key, folder)
    out = bytearray(payload)
    n = len(CRC_NEUTRAL)
    for e in h.parts:
        for at in range(base + e.offset, base + e.offset + e.nbytes - n + 1, 64):
            for i, b in enumerate(CRC_NEUTRAL):
                out[at + i] ^= b
    return bytes(out)


def forged_chain(entries, folder: Path, key: LinkKey, write_key: LinkKey | None = None,
                 keep_header: bool = False) -> list[tuple]:
    """A replica's directory entries (root first, as `entries_of` lists them) as publishable
    items (RayTransport.publish arguments), the deepest forged: `forge` under `write_key`
    (default the secret itself), or `forge_keeping_header`."""
    items = []
    for i, (loc, (parent, start, end, _, refs)) in enumerate(entries):
        data = bytes(ray.get(refs[0]))
        if i == len(entries) - 1:
            data = (forge_keeping_header(data, folder, key) if keep_header
                    else forge(data, folder, key, write_key))
        items.append((loc, parent, start, end, data))
    return items
