"""Stand-ins for the cluster tests' negative controls and dead owners: a `Ghost` replica that
publishes payloads (tree links or end anchors) under its own name, and forged payloads (state
bytes altered, every header check and CRC valid, the kind kept: what a bug in a copy would
produce)."""

from __future__ import annotations

from pathlib import Path

import ray

from tests.keys import TEST_KEY
from vllm_hybridcache.cluster import RayTransport


@ray.remote(num_cpus=0)
class Ghost:
    """A replica stand-in that re-publishes payloads as their owner, then dies."""

    def __init__(self) -> None:
        self.t = RayTransport(ray.get_runtime_context().gcs_address, owner="ghost")

    def publish(self, items) -> list:
        for it in items:
            self.t.publish(*it)
        return [ray.put(b"probe")]

    def publish_anchors(self, items) -> int:
        """End anchors (RayTransport.publish_anchor arguments), listed as the ghost's."""
        for it in items:
            self.t.publish_anchor(*it)
        return len(items)


def forge(payload: bytes, fingerprint: bytes, folder: Path) -> bytes:
    """The same link with slightly different state bytes and valid checksums."""
    import numpy as np

    from vllm_hybridcache.core.disk.linkfile import read_header, write_link_file

    src, dst = folder / "src.link", folder / "forged.link"
    src.write_bytes(payload)
    h, base = read_header(src, fingerprint, TEST_KEY)
    parts = {}
    for e in h.parts:
        a = np.frombuffer(payload, np.uint8, e.nbytes, base + e.offset).copy()
        a[::16] ^= 0x04
        parts[e.name] = a
    write_link_file(dst, fingerprint=h.fingerprint, domain=h.domain, digest=h.digest,
                    parent_digest=h.parent_digest, start=h.start, end=h.end,
                    tokens=h.token_ids(), rows=h.rows, parts=parts, kind=h.kind, key=TEST_KEY)
    return dst.read_bytes()


def forged_chain(entries, folder: Path) -> list[tuple]:
    """A replica's directory entries (root first) as publishable items, the deepest forged."""
    items = []
    for i, ((fp, dom, digest), (parent, start, end, _, refs)) in enumerate(entries):
        data = bytes(ray.get(refs[0]))
        if i == len(entries) - 1:
            data = forge(data, fp, folder)
        items.append((fp, dom, digest, parent, start, end, data))
    return items
