"""SpillBook: which end anchors the disk tier writes, and when (session spill, scheduler side).

An end anchor lives in the worker's RAM store; it reaches the disk tier in two moments only:
- at a graceful shutdown, every live anchor is written (the worker drains them: it learns of
  each anchor through a `when="spill"` job sent with the anchor's capture, and forgets it when
  the anchor is dropped);
- when RAM *evicts* a committed anchor (LRU, budget) while the tier is on, it is written right
  away (`when="now"`, before the worker drops it) rather than lost.

Every other way an anchor leaves RAM loses nothing worth a file, so the book tells the
evictions apart from them: the conversation moved on (a newer anchor of the same domain
extends its tokens: `superseded`), its restore failed or a worker lost it (its bytes are
suspect: `discard`), or the cache was cleared (`discard_all`; one tenant's anchors:
`discard_domains`).

Pure and single-threaded (the scheduler thread), like the tiers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from ..keys import PromptKeys
from ..linkformat.job import ANCHOR, WriteJob
from ..linkformat.tags import EncodedTag

__all__ = ["SpillBook", "anchor_job"]


def anchor_job(link_id: int, domain: bytes, keys: PromptKeys, rows: int, when: str,
               tag: EncodedTag | None = None) -> WriteJob:
    """The write of an end anchor holding the state after every token of `keys`: one root
    file [0, n) named by the digest of the whole prefix. `tag`: the anchor's encoded draft
    tag on a speculative route (tags.py), carried into the header; None on the AR route."""
    n = len(keys)
    return WriteJob(link_id, domain, keys.digest(n), b"", 0, n, keys.token_bytes(0, n), rows,
                    kind=ANCHOR, when=when, tag=tag)


@dataclass
class _Entry:
    job: WriteJob
    tokens: np.ndarray
    committed: bool = False


class SpillBook:
    """Anchors reserved while session spill is on, by link id (see the module docstring)."""

    def __init__(self) -> None:
        self._entries: dict[int, _Entry] = {}

    def reserved(self, job: WriteJob, tokens: np.ndarray) -> None:
        """A new anchor was reserved (`job.when == "spill"`). Anchors of its domain whose
        tokens it extends are superseded: RAM drops them, and they are not written."""
        self.superseded(job.domain, tokens)
        self._entries[job.link_id] = _Entry(job, np.array(tokens, dtype=np.int64, copy=True))

    def superseded(self, domain: bytes, tokens: np.ndarray) -> None:
        """A new anchor of `domain` holding `tokens` was reserved, written or not (one whose
        draft tag no file can carry is not): the anchors it extends are forgotten, since RAM
        drops them as superseded, not evicted."""
        n = len(tokens)
        for lid, e in list(self._entries.items()):
            m = len(e.tokens)
            if (e.job.domain == domain and m <= n
                    and np.array_equal(np.asarray(tokens[:m]), e.tokens)):
                del self._entries[lid]

    def committed(self, link_id: int) -> None:
        e = self._entries.get(link_id)
        if e is not None:
            e.committed = True

    def discard(self, link_ids: Iterable[int]) -> None:
        """Aborted, failed or lost anchors: never written."""
        for lid in link_ids:
            self._entries.pop(lid, None)

    def discard_all(self) -> None:
        self._entries.clear()

    def discard_domains(self, domains: Callable[[bytes], bool]) -> None:
        """The anchors of the domains `domains(domain)` names were cleared (a tenant's clear):
        never written."""
        for lid in [i for i, e in self._entries.items() if domains(e.job.domain)]:
            del self._entries[lid]

    def dropped(self, link_ids: Iterable[int]) -> list[WriteJob]:
        """RAM dropped these ids: the committed anchors among them were evicted; their writes
        (`when="now"`), in the order given. Every id is forgotten."""
        out = []
        for lid in link_ids:
            e = self._entries.pop(lid, None)
            if e is not None and e.committed:
                out.append(WriteJob(**{f: getattr(e.job, f) for f in WriteJob.__struct_fields__
                                       if f != "when"}, when="now"))
        return out

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, link_id: int) -> bool:
        return link_id in self._entries
