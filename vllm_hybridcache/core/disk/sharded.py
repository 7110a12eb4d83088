"""One logical link, one file per tensor-parallel rank: the disk tier at TP > 1.

Why: at TP = N every worker holds its own shard of every link (its GDN heads, its attention
heads' K/V), so a link on disk is N files, one per rank, each written by its own worker. The
rules that keep a restore whole:

- **Where**: rank r of N keeps its files in `ROOT/<F>/shard-r-of-N/`, under the same names as
  every other rank's (a link's name is a function of its key), below the fingerprint folder
  F that all ranks lock together (directory.py: sweeps and clears treat F as one engine's).
  At N = 1 nothing changes: the files stay in `ROOT/<F>/`.
- **Whose**: each rank's headers carry the engine's fingerprint and the rank's shard tag
  ("r/N", authenticated with the header), so a file of another rank, moved or renamed into a
  rank's folder, fails verification like a foreign file and is never restored into the wrong
  shard.
- **Whole**: a link is on disk only while every rank's file is; each rank's file lands by an
  atomic rename, so the set becomes visible at once when its last file lands. The scheduler
  side (`ShardedDirectory`) finds chains in rank 0's folder and keeps a link only when every
  other rank's file is there with a verified header of the same link; a file deleted on one
  rank (evicted, refused, cleared) is deleted on every rank. A rank's file that fails when its
  worker reads it fails that worker's load, and vLLM recomputes the request on every rank
  (the step report's failed loads are merged over the workers): a restore is never mixed.

Pure (no vLLM); single-threaded like LinkDirectory.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from ..keys import PromptKeys
from ..linkformat.linkfile import LinkFileError, LinkFileHeader, LinkFileProblem, read_header
from ..linkformat.shard import relocate
from .directory import DirectoryStats, DiskLink, LinkDirectory

__all__ = ["ShardedDirectory"]


def _same_link(a: LinkFileHeader, b: LinkFileHeader) -> bool:
    return (a.kind, a.domain, a.digest, a.parent_digest, a.start, a.end, a.tokens, a.rows,
            a.tag) == (b.kind, b.domain, b.digest, b.parent_digest, b.start, b.end, b.tokens,
                       b.rows, b.tag)


class ShardedDirectory:
    """The scheduler side's view of N ranks' folders as one directory of whole links (the
    module docstring): what DiskTier and DiskAnchors call on a LinkDirectory, over rank 0's
    index, each answer confirmed on every other rank and each deletion done on every rank."""

    def __init__(self, shards: list[LinkDirectory]) -> None:
        if len(shards) < 2:
            raise ValueError("a sharded directory holds two ranks' folders or more")
        self.shards = shards
        self.world = len(shards)
        self.first = shards[0]
        self._on_delete: Callable[[Path], None] | None = None
        self.first.on_delete = self._deleted_on_first
        self._mirrored = 0  # files of other ranks deleted because rank 0's went

    # ------------------------------------------------------------------ the LinkDirectory face
    @property
    def root(self) -> Path:
        return self.first.root

    @property
    def dir(self) -> Path:
        return self.first.dir

    @property
    def key(self):
        return self.first.key

    @property
    def budget_bytes(self) -> int:
        return sum(s.budget_bytes for s in self.shards)

    @property
    def on_delete(self) -> Callable[[Path], None] | None:
        return self._on_delete

    @on_delete.setter
    def on_delete(self, callback: Callable[[Path], None] | None) -> None:
        self._on_delete = callback

    @property
    def stats(self) -> DirectoryStats:
        """Rank 0's files and counts (one per link), the bytes and refusals of every rank."""
        out = _copy_stats(self.first.stats)
        for s in self.shards[1:]:
            st = s.stats
            out.bytes += st.bytes
            for reason, n in st.refused.items():
                out.refused[reason] = out.refused.get(reason, 0) + n
            out.swept_temporaries += st.swept_temporaries
        return out

    def open(self) -> None:
        for s in self.shards:
            s.open()

    def probe_writable(self) -> None:
        for s in self.shards:
            s.probe_writable()

    def close(self) -> None:
        for s in self.shards:
            s.close()

    def path_for(self, domain: bytes, end: int, digest: bytes, kind: str = "tree") -> Path:
        return self.first.path_for(domain, end, digest, kind)

    def has_file(self, path: Path) -> bool:
        return all(s.has_file(relocate(path, r, self.world))
                   for r, s in enumerate(self.shards))

    def lookup(self, keys: PromptKeys, domain: bytes, cuts: list[int], limit: int):
        return self.lookup_fitting(keys, domain, cuts, limit, None)[0]

    def lookup_fitting(self, keys: PromptKeys, domain: bytes, cuts: list[int], limit: int,
                       accept: Callable[[LinkFileHeader], bool] | None):
        """Rank 0's deepest chain, cut before its first link some rank lacks."""
        chain, refused = self.first.lookup_fitting(keys, domain, cuts, limit, accept)
        for i, (path, header, _) in enumerate(chain):
            if not self._whole(path, header, [p for p, _, _ in chain[i + 1:]]):
                return chain[:i], refused
        return chain, refused

    def lookup_anchor(self, keys: PromptKeys, domain: bytes, limit: int,
                      candidates: list[tuple[int, bytes]]):
        found = self.first.lookup_anchor(keys, domain, limit, candidates)
        if found is None or not self._whole(found[0], found[1], []):
            return None
        return found

    def _whole(self, path: Path, header: LinkFileHeader, longer: list[Path]) -> bool:
        """Whether every other rank holds this link's file, its header verified and naming the
        same link. A rank's damaged file is refused on every rank (with the longer links of the
        chain); a missing one only makes the link not whole."""
        for r, s in enumerate(self.shards[1:], start=1):
            theirs = relocate(path, r, self.world)
            if not s.has_file(theirs):
                return False
            try:
                h, _ = read_header(theirs, s.fingerprint, s.key, s.root, s.shard.tag)
            except LinkFileError as e:
                self.refuse(path, e.problem, longer)
                return False
            except FileNotFoundError:
                return False
            if not _same_link(h, header):
                self.refuse(path, LinkFileProblem.MISMATCH, longer)
                return False
        return True

    def touch(self, path: Path) -> None:
        for r, s in enumerate(self.shards):
            s.touch(relocate(path, r, self.world))

    def refuse(self, path: Path, problem: LinkFileProblem, descendants: list[Path]) -> None:
        self.first.refuse(path, problem, descendants)
        self.delete_everywhere([path, *descendants])

    def delete(self, paths: list[Path]) -> int:
        n = self.first.delete(paths)
        self.delete_everywhere(paths)
        return n

    def delete_everywhere(self, paths: list[Path]) -> None:
        """Delete these links' files (and their longer links) on every rank but 0, whether
        rank 0's index knew them or not."""
        for r, s in enumerate(self.shards[1:], start=1):
            s.delete([relocate(p, r, self.world) for p in paths])

    def _deleted_on_first(self, path: Path) -> None:
        for r, s in enumerate(self.shards[1:], start=1):
            self._mirrored += s.delete([relocate(path, r, self.world)])
        if self._on_delete is not None:
            self._on_delete(path)

    def evict(self, nbytes: int) -> int:
        """Rank 0 picks the victims (mirrored on every rank); the bytes of every rank."""
        if nbytes <= 0:
            return 0
        before = sum(s.stats.bytes for s in self.shards)
        self.first.evict(-(-nbytes // self.world))  # rank 0's share, rounded up
        return before - sum(s.stats.bytes for s in self.shards)

    def clear(self, kind: str | None = None) -> int:
        n = self.first.clear(kind)
        for s in self.shards[1:]:
            s.clear(kind)
        return n

    def clear_tenant(self, tag: bytes, kind: str) -> int:
        n = self.first.clear_tenant(tag, kind)
        for s in self.shards[1:]:
            s.clear_tenant(tag, kind)
        return n

    def anchors(self) -> list[DiskLink]:
        return self.first.anchors()

    def warm_spans(self, limit_bytes: int) -> list[tuple[int, int]]:
        return self.first.warm_spans(limit_bytes // self.world)

    def sanity_check(self) -> None:
        for s in self.shards:
            s.sanity_check()

    def __len__(self) -> int:
        return len(self.first)


def _copy_stats(st: DirectoryStats) -> DirectoryStats:
    out = replace(st)
    out.refused = dict(st.refused)
    out.writes_skipped = dict(st.writes_skipped)
    return out
