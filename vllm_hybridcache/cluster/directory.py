"""The cluster's link directory: one named Ray actor, keyed by (fingerprint, domain, digest).

Why an actor: Ray already provides a cluster-wide, addressable, single-threaded place to keep a
small table; a replica finds it by name. Each entry names the link's segment, its size, the
replica that published it (its owner) and a reference to the payload object. The reference is
kept inside a list so Ray passes the reference itself rather than the object: holding it here
keeps the payload alive for as long as its owner lives (Ray loses an object with its owner,
which a fetch reports as a lost owner).

End anchors live in a table of their own (a session-exact state never answers a tree lookup),
keyed the same way and indexed by their key block digest (core/tiers/cluster.py
`anchor_block`): a lookup does not know an anchor's length, so it sends the digests at its
prompt's block boundaries and gets the anchors indexed under them.
"""

from __future__ import annotations

from typing import Any

import ray

DIRECTORY_NAME = "hybridcache-directory"
NAMESPACE = "hybridcache"

Key = tuple[bytes, bytes, bytes]  # (fingerprint, domain, digest)


class LinkDirectory:
    """The table itself (plain Python: unit-testable without Ray)."""

    def __init__(self) -> None:
        # key -> (parent digest, start, end, nbytes, owner, [payload ref])
        self._entries: dict[Key, tuple[bytes, int, int, int, str, list[Any]]] = {}
        # end anchors: key -> (block digest, end, nbytes, owner, [payload ref]), and
        # (fingerprint, domain, block digest) -> their digests
        self._anchors: dict[Key, tuple[bytes, int, int, str, list[Any]]] = {}
        self._blocks: dict[Key, set[bytes]] = {}

    def publish(self, fingerprint: bytes, domain: bytes, digest: bytes, parent_digest: bytes,
                start: int, end: int, nbytes: int, owner: str, ref: list[Any]) -> None:
        self._entries[(fingerprint, domain, digest)] = (parent_digest, start, end, nbytes,
                                                       owner, ref)

    def locate(self, fingerprint: bytes, domain: bytes, digests: list[bytes]
               ) -> list[tuple[bytes, bytes, int, int, int, str, list[Any]]]:
        out = []
        for d in digests:
            e = self._entries.get((fingerprint, domain, d))
            if e is not None:
                out.append((d, *e))
        return out

    def forget(self, fingerprint: bytes, domain: bytes, digests: list[bytes],
               owner: str | None = None) -> int:
        """Remove entries (only `owner`'s when given: a replica withdrawing its own links
        never removes a newer copy another replica published)."""
        n = 0
        for d in digests:
            k = (fingerprint, domain, d)
            e = self._entries.get(k)
            if e is not None and (owner is None or e[4] == owner):
                del self._entries[k]
                n += 1
        return n

    def forget_owner(self, owner: str) -> int:
        """Remove every entry (tree links and end anchors) of a replica that is gone."""
        gone = [k for k, e in self._entries.items() if e[4] == owner]
        for k in gone:
            del self._entries[k]
        anchors = [k for k, e in self._anchors.items() if e[3] == owner]
        for fp, dom, d in anchors:
            self.forget_anchors(fp, dom, [d])
        return len(gone) + len(anchors)

    # ------------------------------------------------------------------ end anchors
    def publish_anchor(self, fingerprint: bytes, domain: bytes, digest: bytes, block: bytes,
                       end: int, nbytes: int, owner: str, ref: list[Any]) -> None:
        key = (fingerprint, domain, digest)
        self.forget_anchors(fingerprint, domain, [digest])
        self._anchors[key] = (block, end, nbytes, owner, ref)
        self._blocks.setdefault((fingerprint, domain, block), set()).add(digest)

    def locate_anchors(self, fingerprint: bytes, domain: bytes, blocks: list[bytes], limit: int
                       ) -> list[tuple[bytes, bytes, int, int, int, str, list[Any]]]:
        """Anchors of at most `limit` tokens indexed under one of `blocks`, in the shape of
        `locate`'s entries (roots: no parent, start 0)."""
        out = []
        for b in blocks:
            for d in self._blocks.get((fingerprint, domain, b), ()):
                _, end, nbytes, owner, ref = self._anchors[(fingerprint, domain, d)]
                if end <= limit:
                    out.append((d, b"", 0, end, nbytes, owner, ref))
        return out

    def forget_anchors(self, fingerprint: bytes, domain: bytes, digests: list[bytes],
                       owner: str | None = None) -> int:
        """Remove anchors (only `owner`'s when given)."""
        n = 0
        for d in digests:
            k = (fingerprint, domain, d)
            e = self._anchors.get(k)
            if e is None or (owner is not None and e[3] != owner):
                continue
            del self._anchors[k]
            bk = (fingerprint, domain, e[0])
            ds = self._blocks.get(bk)
            if ds is not None:
                ds.discard(d)
                if not ds:
                    del self._blocks[bk]
            n += 1
        return n

    def anchors_of(self, owner: str) -> list[tuple[Key, tuple[bytes, int, int, list[Any]]]]:
        """Every end anchor of one replica (key, (block digest, end, nbytes, [ref]))."""
        return [(k, (e[0], e[1], e[2], e[4])) for k, e in self._anchors.items()
                if e[3] == owner]

    def entries_of(self, owner: str) -> list[tuple[Key, tuple[bytes, int, int, int, list[Any]]]]:
        """Every entry of one replica (key, (parent digest, start, end, nbytes, [ref]))."""
        return [(k, (e[0], e[1], e[2], e[3], e[5])) for k, e in self._entries.items()
                if e[4] == owner]

    def stats(self) -> dict[str, dict[str, int]]:
        """Entries (tree links, end anchors) and payload bytes per owner."""
        out: dict[str, dict[str, int]] = {}
        for e in self._entries.values():
            s = out.setdefault(e[4], {"links": 0, "anchors": 0, "bytes": 0})
            s["links"] += 1
            s["bytes"] += e[3]
        for a in self._anchors.values():
            s = out.setdefault(a[3], {"links": 0, "anchors": 0, "bytes": 0})
            s["anchors"] += 1
            s["bytes"] += a[2]
        return out


DirectoryActor = ray.remote(num_cpus=0, max_restarts=0)(LinkDirectory)


def directory_handle() -> Any:
    """The cluster's directory actor, created by the first replica that asks (detached, so it
    outlives that replica; it goes with the cluster)."""
    return DirectoryActor.options(name=DIRECTORY_NAME, namespace=NAMESPACE, get_if_exists=True,
                                  lifetime="detached").remote()
