"""LinkDirectory: the files of the disk tier, on one directory that several engines may share.

Layout: `ROOT/<F>/<T>-<D>/<N>-<end>.link` for tree links and
`ROOT/<F>/a-<T>-<D>/<N>-<end>.link` for spilled end anchors (session-exact state, kept apart: a
tree lookup never even stats an anchor's name, and every header names its kind), where F, T, D
and N are keyed digests (the disk key's `LinkKey.name`, core/auth.py) of the fingerprint, of
the domain's tenant tag (core/keys.py: a tenant's clear finds its folders by name), of the
domain, and of (domain, digest). Nobody without the disk key can tell from the names which
domain (tenant, adapter) a folder belongs to, nor which prompt a file continues; the files
themselves are 0600 in 0700 folders (folder.py) and authenticated (linkfile.py). A file's name
is a function of its key (kind, domain, end, digest), so any engine of the same fingerprint and
disk key finds a link written by another one by asking for the name: a tree lookup stats the
names of the prompt's cuts (the segmentation is part of the fingerprint, so links only ever sit
at cuts), then reads and verifies the headers of the chain it found. The in-memory index only
serves accounting and eviction; it is rebuilt by `scan()` and corrected whenever a file turns
out to be gone.

Every file and folder below ROOT is reached from ROOT's descriptor one component at a time
without following a symlink (safeio.py): a symlinked file or folder is refused (`symlink`,
counted like a damaged file; the symlink itself is removed), never read, written or deleted
through.

Sharing rules (several servers of one user on one box, data-parallel ranks):
- every engine holds a shared `flock` on `ROOT/<fp>/.in-use` for its lifetime; a directory of
  another fingerprint is deleted at start only if an exclusive lock on its `.in-use` can be
  taken (nobody uses it), so two engines of different fingerprints can share ROOT;
- writes go to a temporary name and are renamed into place (linkfile.py), so readers and a
  kill -9 never expose a torn file; temporaries older than `tmp_max_age_s` are swept;
- a file that disappears under a reader (evicted or swept by another engine) is a miss.

Not thread-safe: one thread owns an instance (the disk tier's writer thread).

Why one module over ~500 lines: `LinkDirectory` is one object with one lock discipline (the
folder's ownership, the index, eviction and the sweep of foreign files share its state);
splitting it would spread those invariants across files.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import stat
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..auth import LinkKey
from ..keys import PromptKeys, in_tenant, tenant_of
from ..linkformat.job import ANCHOR, TREE
from ..linkformat.linkfile import (
    TMP_PREFIX,
    LinkFileError,
    LinkFileHeader,
    LinkFileProblem,
    read_header,
    write_link_file,
)
from ..linkformat.safeio import SymlinkRefused, dir_fd, relative_parts
from ..linkformat.shard import Shard
from ..linkformat.tags import EncodedTag
from .folder import own_folder

__all__ = ["DirectoryStats", "DiskLink", "LinkDirectory"]

SUFFIX = ".link"
LOCK_NAME = ".in-use"
# tries to lock our folder while other engines keep sweeping it (each try is microseconds)
LOCK_ATTEMPTS = 8
DAY_S = 86400.0
ANCHOR_PREFIX = "a-"  # folder of a domain's spilled end anchors


@dataclass
class DiskLink:
    """One file of this engine's fingerprint, as the index knows it."""

    path: Path
    parent: Path | None  # the file holding the rows before `start` (None for a root link)
    end: int
    nbytes: int
    last_used: float
    hits: int = 0
    kind: str = TREE
    domain: bytes = b""
    digest: bytes = b""
    start: int = 0  # the first token it holds rows of (its parent's end; 0 for a root link)

    def value(self, now: float) -> float:
        """Eviction value: (hits + 1) x tokens it saves per byte, halved per day unused."""
        age_days = max(0.0, now - self.last_used) / DAY_S
        return (self.hits + 1) * self.end / max(self.nbytes, 1) * 0.5 ** age_days


@dataclass
class DirectoryStats:
    files: int = 0
    bytes: int = 0
    writes: int = 0
    write_bytes: int = 0
    writes_skipped: dict[str, int] = field(default_factory=dict)  # by reason
    reads: int = 0
    read_bytes: int = 0
    refused: dict[str, int] = field(default_factory=dict)  # LinkFileProblem -> files deleted
    evictions: int = 0
    expired: int = 0
    swept_dirs: int = 0
    kept_foreign_dirs: int = 0
    swept_temporaries: int = 0
    orphans: int = 0  # files deleted at a scan because a link below them was missing


class LinkDirectory:
    def __init__(
        self,
        root: Path,
        fingerprint: bytes,
        budget_bytes: int,
        min_free_bytes: int = 0,
        ttl_s: float = 0.0,
        tmp_max_age_s: float = 600.0,
        clock: Callable[[], float] | None = None,
        free_bytes: Callable[[Path], int] | None = None,
        *,
        key: LinkKey,
        key_file: Path | None = None,
        shard: Shard | None = None,
    ) -> None:
        """ttl_s: 0 = files never expire. free_bytes: free space of the file system holding a
        path (default shutil.disk_usage); injected by tests. key: the disk key (authenticates
        and names the files); key_file: where it is kept (`open` refuses one inside `root`).
        shard: which rank's files of a link this instance holds at TP > 1 (shard.py): its own
        folder below the fingerprint's, its rank's shard tag in every header."""
        self.root = Path(os.path.abspath(Path(root).expanduser()))
        self.shard = shard if shard is not None else Shard()
        self.fingerprint = fingerprint
        self.key = key
        self.key_file = key_file
        self.budget_bytes = budget_bytes
        self.min_free_bytes = min_free_bytes
        self.ttl_s = ttl_s
        self.tmp_max_age_s = tmp_max_age_s
        self._clock = clock or time.time
        self._free = free_bytes or (lambda p: shutil.disk_usage(p).free)
        # the fingerprint's folder (locked, swept and kept as one engine's), and where this
        # instance's files are: the same folder, or this rank's below it (shards.py)
        self.home = self.root / key.name(b"fingerprint", fingerprint, size=8)
        self.dir = self.home / self.shard.folder if self.shard.sharded else self.home
        self._index: dict[Path, DiskLink] = {}
        # indexed path -> indexed files whose parent it is (eviction takes leaves only: a
        # chain is usable only while every link below its end is on disk)
        self._children: dict[Path, set[Path]] = {}
        self._lock_fd: int | None = None
        self.stats = DirectoryStats()
        # called with every file this instance deletes (so another process's index of the
        # same files can forget it: the disk tier forwards them to its writer thread)
        self.on_delete: Callable[[Path], None] | None = None

    # ------------------------------------------------------------------ life cycle
    def open(self) -> None:
        """Create the directory, lock it shared, sweep what is not ours, index our files.

        Raises OSError (read-only or missing parent, permissions; UnsafeFolder for a folder
        others could write, folder.py) for the caller to turn into a clear start-up error or a
        tier that stays off.
        """
        own_folder(self.root, self.key_file)
        self._lock_fd = self._lock_shared()
        self._sweep_foreign()
        self.scan()

    def _lock_shared(self) -> int:
        """Create our directory and hold a shared lock on the `.in-use` file that is in it.

        Creating the lock file and locking it are two steps: an engine of another fingerprint
        sweeping at that moment can take its exclusive lock in between and delete the folder
        (the file we locked is then unlinked, and our files would land in a folder nobody
        locks). So the lock counts only if the file we locked is still the one at the path;
        otherwise the folder is created again.
        """
        path = self.home / LOCK_NAME
        for _ in range(LOCK_ATTEMPTS):
            self._mkdir(self.home)
            try:
                with dir_fd(self.home) as d:
                    fd = os.open(LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW
                                 | os.O_CLOEXEC, 0o600, dir_fd=d)
            except FileNotFoundError:
                continue  # the folder was removed between mkdir and open
            fcntl.flock(fd, fcntl.LOCK_SH)
            held = os.fstat(fd)
            at_path = self._lstat(path)
            if at_path is not None and (at_path.st_dev, at_path.st_ino) == (
                held.st_dev,
                held.st_ino,
            ):
                if self.dir != self.home:
                    self._mkdir(self.dir)
                return fd
            os.close(fd)
        raise OSError(
            errno.EBUSY, f"could not lock {path}: swept by another engine {LOCK_ATTEMPTS} times"
        )

    def probe_writable(self) -> None:
        """Create and remove a file in this fingerprint's folder (a start-up check: a folder
        that opened but cannot take a file is refused now, not at the first write). Created
        O_EXCL under a random name, never through a symlink. Raises OSError."""
        name = f".probe-{os.getpid()}-{uuid.uuid4().hex}"
        with dir_fd(self.dir) as d:
            os.close(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                             | os.O_CLOEXEC, 0o600, dir_fd=d))
            os.unlink(name, dir_fd=d)

    def close(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

    def _sweep_foreign(self) -> None:
        with os.scandir(self.root) as it:
            found = [self.root / e.name for e in it
                     if e.is_dir(follow_symlinks=False) and not e.name.startswith(".")]
        for d in found:
            if d == self.home:
                continue
            try:  # not a fingerprint directory of ours without it: left alone
                with dir_fd(d) as dfd:
                    fd = os.open(LOCK_NAME, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC,
                                 dir_fd=dfd)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                self.stats.kept_foreign_dirs += 1  # another engine still uses it
                os.close(fd)
                continue
            try:
                shutil.rmtree(d, ignore_errors=True)
                self.stats.swept_dirs += 1
            finally:
                os.close(fd)

    def _files(self) -> Iterator[Path]:
        """Every entry of every domain folder; a symlink where a folder or file should be is
        refused (removed and counted, never followed)."""
        with os.scandir(self.dir) as it:
            subs = list(it)
        for sub in subs:
            if sub.is_symlink():
                self._refuse_symlink(Path(sub.path))
            elif sub.is_dir(follow_symlinks=False):
                try:
                    with dir_fd(self.dir, sub.name) as d, os.scandir(d) as it:
                        entries = [(e.name, e.is_symlink()) for e in it]
                except (FileNotFoundError, SymlinkRefused):
                    continue  # removed or swapped meanwhile: the next scan sees it
                for name, link in entries:
                    p = Path(sub.path) / name
                    if link:
                        self._refuse_symlink(p)
                    else:
                        yield p

    def _refuse_symlink(self, path: Path) -> None:
        """Remove a symlink planted in the folder (never what it points to) and count it."""
        problem = LinkFileProblem.SYMLINK.value
        self.stats.refused[problem] = self.stats.refused.get(problem, 0) + 1
        self._unlink(path)

    def scan(self) -> None:
        """Rebuild the index from the files (headers only); delete damaged files and stale
        temporaries; expire files past the TTL."""
        now = self._clock()
        index: dict[Path, DiskLink] = {}
        for p in list(self._files()):
            st = self._lstat(p)
            if st is None:
                continue
            if p.name.startswith(TMP_PREFIX):
                if now - st.st_mtime > self.tmp_max_age_s:
                    self._unlink(p)
                    self.stats.swept_temporaries += 1
                continue
            if not p.name.endswith(SUFFIX):
                continue  # an unrelated file: never read, never deleted
            try:
                header, _ = read_header(p, self.fingerprint, self.key, self.root, self.shard.tag)
            except LinkFileError as e:
                self._refuse(p, e.problem)
                continue
            except FileNotFoundError:
                continue
            if p != self.path_for(header.domain, header.end, header.digest, header.kind):
                self._refuse(p, LinkFileProblem.MISMATCH)  # a header its name does not name
                continue
            old = self._index.get(p)
            index[p] = DiskLink(p, self._parent_path(p, header), header.end, st.st_size,
                                old.last_used if old else st.st_mtime,
                                old.hits if old else 0, header.kind, header.domain,
                                header.digest, header.start)
        self._index = {}
        self._children = {}
        for entry in index.values():
            self._add(entry)
        # A file whose parent is gone (refused above, evicted, its write skipped) can never
        # serve: a chain is usable only when every link below it is on disk.
        orphans = [e.path for e in self._index.values()
                   if e.parent is not None and e.parent not in self._index]
        for p in orphans:
            if p in self._index:
                self.stats.orphans += self._delete_subtree(p)
        self._expire(now)
        self._account()

    def _parent_path(self, path: Path, header: LinkFileHeader) -> Path | None:
        if header.start == 0:
            return None
        return self.path_for(header.domain, header.start, header.parent_digest, header.kind)

    def _add(self, entry: DiskLink) -> None:
        self._index[entry.path] = entry
        if entry.parent is not None:
            self._children.setdefault(entry.parent, set()).add(entry.path)

    def _account(self) -> None:
        self.stats.files = len(self._index)
        self.stats.bytes = sum(e.nbytes for e in self._index.values())

    # ------------------------------------------------------------------ names
    def path_for(self, domain: bytes, end: int, digest: bytes, kind: str = TREE) -> Path:
        """Where the link of (kind, domain, end, digest) lives (names keyed: module docstring)."""
        folder = (self._tenant_prefix(tenant_of(domain), kind)
                  + self.key.name(b"domain", domain, size=8))
        return self.dir / folder / f"{self.key.name(b'link', domain, digest)}-{end}{SUFFIX}"

    def _tenant_prefix(self, tag: bytes, kind: str) -> str:
        """The start of the names of one tenant's domain folders of `kind`: a keyed digest of
        its tenant tag, so a tenant's clear finds its folders by name, reading no header."""
        return ((ANCHOR_PREFIX if kind == ANCHOR else "")
                + self.key.name(b"tenant", tag, size=8) + "-")

    # ------------------------------------------------------------------ safe file operations
    def _mkdir(self, path: Path) -> None:
        """Create the folder `path` below ROOT (mode 0700) unless it exists; never through a
        symlink (SymlinkRefused when a component is one)."""
        parts = relative_parts(self.root, path)
        with dir_fd(self.root, *parts[:-1]) as d:
            try:
                os.mkdir(parts[-1], 0o700, dir_fd=d)
            except FileExistsError:
                pass

    def _lstat(self, path: Path) -> os.stat_result | None:
        """The file's own status (None when it is missing or a folder on its way is a
        symlink: such a path names nothing this directory uses)."""
        return self._stat_or_link(path)[0]

    def _stat_or_link(self, path: Path) -> tuple[os.stat_result | None, bool]:
        """(the file's own status or None, whether a symlink was met on the way or is the
        file itself)."""
        parts = relative_parts(self.root, path)
        try:
            with dir_fd(self.root, *parts[:-1]) as d:
                st = os.stat(parts[-1], dir_fd=d, follow_symlinks=False)
        except SymlinkRefused:
            return None, True
        except (FileNotFoundError, NotADirectoryError):
            return None, False
        return st, stat.S_ISLNK(st.st_mode)

    def has_file(self, path: Path) -> bool:
        """Whether `path` is a regular file reached without a symlink. A symlink found on the
        way (planted in the folder) is refused: removed and counted, never followed. One
        stat on the way of a lookup; the walk for the symlink only when one was met."""
        st, linked = self._stat_or_link(path)
        if st is not None and stat.S_ISREG(st.st_mode):
            return True
        if linked:
            link = self._first_symlink(path)
            if link is not None:
                self._refuse_symlink(link)
        return False

    def _first_symlink(self, path: Path) -> Path | None:
        """The first component of `path` below ROOT that is a symlink (None: none is)."""
        parts = relative_parts(self.root, path)
        for i in range(len(parts)):
            try:
                with dir_fd(self.root, *parts[:i]) as d:
                    st = os.stat(parts[i], dir_fd=d, follow_symlinks=False)
            except (FileNotFoundError, SymlinkRefused, NotADirectoryError):
                return None
            if stat.S_ISLNK(st.st_mode):
                return self.root.joinpath(*parts[:i + 1])
        return None

    def _unlink(self, path: Path) -> None:
        """Remove `path` itself: a file, or the first symlink on its way (what a symlink
        points to is never touched)."""
        target = self._first_symlink(path) or path
        parts = relative_parts(self.root, target)
        try:
            with dir_fd(self.root, *parts[:-1]) as d:
                os.unlink(parts[-1], dir_fd=d)
        except (FileNotFoundError, SymlinkRefused, NotADirectoryError, IsADirectoryError):
            pass

    def _stamp(self, path: Path, t: float) -> None:
        """Set a file's mtime to its last use (best effort: a file gone, read-only or reached
        through a symlink is skipped)."""
        parts = relative_parts(self.root, path)
        try:
            with dir_fd(self.root, *parts[:-1]) as d:
                os.utime(parts[-1], (t, t), dir_fd=d, follow_symlinks=False)
        except OSError:
            pass

    def anchors(self) -> list[DiskLink]:
        """The spilled end anchors this index knows (the disk anchor tier's candidates)."""
        return [e for e in self._index.values() if e.kind == ANCHOR]

    # ------------------------------------------------------------------ writes
    def write(
        self, *, domain: bytes, digest: bytes, parent_digest: bytes, start: int, end: int,
        tokens: np.ndarray, rows: int, parts, nbytes: int, kind: str = TREE,
        tag: EncodedTag | None = None,
    ) -> bool:
        """Write one link unless it exists already or does not fit; False = skipped (counted).

        nbytes: the payload size (to decide admission before writing anything). kind: "tree"
        or "anchor" (a spilled end anchor: one root file holding the whole prefix). tag: the
        link's encoded draft tag on a speculative route (tags.py).
        """
        path = self.path_for(domain, end, digest, kind)
        if self.has_file(path):
            return True
        if nbytes > self.budget_bytes:
            return self._skip("too_large")
        if not self._make_room(nbytes):
            return self._skip("budget")
        try:
            self._mkdir(path.parent)
        except SymlinkRefused:
            self._refuse_symlink(path.parent)
            return self._skip("symlink")
        if self._free(self.dir) - nbytes < self.min_free_bytes:
            return self._skip("min_free")
        try:
            written = write_link_file(
                path, key=self.key, fingerprint=self.fingerprint, domain=domain, digest=digest,
                parent_digest=parent_digest, start=start, end=end, tokens=tokens, rows=rows,
                parts=parts, created=self._clock(), kind=kind, tag=tag, root=self.root,
                shard=self.shard.tag)
        except LinkFileError:  # a symlink planted on the way: removed, counted
            link = self._first_symlink(path)
            if link is not None:
                self._refuse_symlink(link)
            return self._skip("symlink")
        except OSError as e:
            return self._skip("disk_full" if e.errno in (errno.ENOSPC, errno.EDQUOT)
                              else "io_error")
        parent = None if start == 0 else self.path_for(domain, start, parent_digest, kind)
        now = self._clock()
        self._stamp(path, now)  # mtime = last use, in this directory's clock
        self._add(DiskLink(path, parent, end, written, now, 0, kind, domain, digest, start))
        self.stats.writes += 1
        self.stats.write_bytes += written
        self._account()
        return True

    def _skip(self, reason: str) -> bool:
        self.stats.writes_skipped[reason] = self.stats.writes_skipped.get(reason, 0) + 1
        return False

    # ------------------------------------------------------------------ lookups
    def lookup(self, keys: PromptKeys, domain: bytes, cuts: list[int], limit: int
               ) -> list[tuple[Path, LinkFileHeader, int]]:
        """The deepest chain of files on a cut <= limit whose tokens equal the prompt's.

        Returns [(path, header, payload offset)] root first, or [] on a miss. Every header of
        the chain is verified (format, fingerprint, CRC) and every stored token compared with
        the prompt; a damaged file is deleted with every longer link of its chain. Parts are
        not read here (read_parts verifies them when they are restored).
        """
        return self.lookup_fitting(keys, domain, cuts, limit, None)[0]

    def lookup_fitting(self, keys: PromptKeys, domain: bytes, cuts: list[int], limit: int,
                       accept: Callable[[LinkFileHeader], bool] | None
                       ) -> tuple[list[tuple[Path, LinkFileHeader, int]], int]:
        """`lookup` where every link of the chain must also be accepted (`accept(header)`: on
        a speculative route, its draft tag fits the prompt). A chain ends before its first
        link not accepted, and a shallower file on another chain may then serve deeper, so
        the cuts are tried deepest first until none can beat the best chain found.

        Returns (chain, the end of the deepest link refused by `accept`, 0 if none). Refused
        files are left alone: they may fit another prompt.
        """
        best: list[tuple[Path, LinkFileHeader, int]] = []
        refused = 0
        for cut in sorted((c for c in cuts if 0 < c <= limit), reverse=True):
            if best and cut <= best[-1][1].end:
                break
            path = self.path_for(domain, cut, keys.digest(cut))
            if not self.has_file(path):
                continue
            chain = self._chain(path, keys, domain, cut)
            if not chain:
                continue
            n = len(chain)
            if accept is not None:
                n = 0
                while n < len(chain) and accept(chain[n][1]):
                    n += 1
                if n < len(chain):
                    refused = max(refused, chain[n][1].end)
            if n and (not best or chain[n - 1][1].end > best[-1][1].end):
                best = chain[:n]
        return best, refused

    def _chain(self, path: Path, keys: PromptKeys, domain: bytes, end: int
               ) -> list[tuple[Path, LinkFileHeader, int]]:
        """The chain root -> the file at `path`, which must hold the link ending at `end`.

        Every file must be the very link its name was looked up for: its header's end is the
        cut asked for (then each parent's is its child's start), its digests are the prompt's
        at its bounds, and its own tokens are the prompt's. Names are not authenticated (a
        writer of the folder can rename a genuine file), so a file found under another link's
        name must not stitch a chain with a gap or another prefix's state.
        """
        chain: list[tuple[Path, LinkFileHeader, int]] = []
        while True:
            try:
                header, base = read_header(path, self.fingerprint, self.key, self.root,
                                            self.shard.tag)
            except LinkFileError as e:
                self._refuse(path, e.problem, descendants=[p for p, _, _ in chain])
                return []
            except FileNotFoundError:
                self._forget(path)
                return []
            if (header.domain != domain or header.kind != TREE or header.end != end
                    or header.end > len(keys) or header.digest != keys.digest(end)
                    or header.parent_digest != (keys.digest(header.start) if header.start
                                                else b"")
                    or keys.token_bytes(header.start, header.end) != header.tokens):
                # not this prompt's link at this cut: a digest collision, or a file under
                # another link's name (a miss, never a chain with a gap)
                return []
            chain.append((path, header, base))
            if header.start == 0:
                chain.reverse()
                return chain
            end = header.start
            path = self.path_for(domain, header.start, header.parent_digest)

    def lookup_anchor(self, keys: PromptKeys, domain: bytes, limit: int,
                      candidates: list[tuple[int, bytes]]
                      ) -> tuple[Path, LinkFileHeader, int] | None:
        """The deepest spilled end anchor of `domain` among `candidates` ((end, digest) pairs)
        whose end is <= limit and whose every stored token equals the prompt's, or None.

        The digest only picks the candidates worth opening; the header is verified (format,
        fingerprint, CRC, kind, domain) and the tokens compared, as for a tree link. A damaged
        file is deleted.
        """
        for end, digest in sorted(candidates, reverse=True):
            if end > limit or end > len(keys) or keys.digest(end) != digest:
                continue
            path = self.path_for(domain, end, digest, ANCHOR)
            try:
                header, base = read_header(path, self.fingerprint, self.key, self.root,
                                            self.shard.tag)
            except LinkFileError as e:
                self._refuse(path, e.problem)
                continue
            except FileNotFoundError:
                self._forget(path)
                continue
            if (header.kind == ANCHOR and header.domain == domain and header.digest == digest
                    and (header.start, header.end) == (0, end)
                    and keys.token_bytes(0, end) == header.tokens):
                return path, header, base
        return None

    def warm_spans(self, limit_bytes: int) -> list[tuple[int, int]]:
        """(start, end) of the files a disk hit is likeliest to read, the most valuable first
        (`DiskLink.value`, the eviction order reversed), as many as fit in `limit_bytes` of
        file: what a starting worker warms its read buffers for (adapter/worker_side.py)."""
        now = self._clock()
        out: list[tuple[int, int]] = []
        total = 0
        for e in sorted(self._index.values(), key=lambda e: -e.value(now)):
            if total + e.nbytes <= limit_bytes:
                total += e.nbytes
                out.append((e.start, e.end))
        return out

    def touch(self, path: Path) -> None:
        """Count a restore served by a file (eviction value). The use is also stamped on the
        file (its mtime), so another process's index of the same files (the writer's, another
        engine's) sees it before it evicts or expires the file."""
        entry = self._index.get(path)
        now = self._clock()
        self._stamp(path, now)
        if entry is not None:
            entry.hits += 1
            entry.last_used = now
        self.stats.reads += 1
        if entry is not None:
            self.stats.read_bytes += entry.nbytes

    # ------------------------------------------------------------------ removal
    def refuse(self, path: Path, problem: LinkFileProblem, descendants: list[Path]) -> None:
        """A file failed verification when its parts were read: delete it and the longer links
        of the chain that was being restored."""
        self._refuse(path, problem, descendants)

    def _refuse(self, path: Path, problem: LinkFileProblem,
                descendants: list[Path] | None = None) -> None:
        self.stats.refused[problem.value] = self.stats.refused.get(problem.value, 0) + 1
        for p in [path, *(descendants or [])]:
            self._delete_subtree(p)

    def _delete_subtree(self, path: Path) -> int:
        """Delete a file and every indexed file that chains through it; returns how many."""
        order = [path]
        i = 0
        while i < len(order):
            order.extend(self._children.get(order[i], ()))
            i += 1
        for p in reversed(order):
            self._delete(p)
        return len(order)

    def _delete(self, path: Path) -> None:
        self._unlink(path)
        self._forget(path)
        if self.on_delete is not None:
            self.on_delete(path)

    def _forget(self, path: Path) -> None:
        entry = self._index.pop(path, None)
        if entry is None:
            return
        if entry.parent is not None:
            kids = self._children.get(entry.parent)
            if kids is not None:
                kids.discard(path)
                if not kids:
                    del self._children[entry.parent]
        self._account()

    def _expire(self, now: float) -> None:
        if self.ttl_s <= 0:
            return
        for entry in [e for e in self._index.values() if now - e.last_used > self.ttl_s]:
            self._refresh(entry)  # used by another process since?
            if entry.path in self._index and now - entry.last_used > self.ttl_s:
                self.stats.expired += self._delete_subtree(entry.path)

    def _make_room(self, nbytes: int) -> bool:
        """Evict the least valuable files until nbytes more fit in the budget."""
        now = self._clock()
        self._expire(now)
        total = sum(e.nbytes for e in self._index.values())
        if total + nbytes > self.budget_bytes:
            for e in list(self._index.values()):
                self._refresh(e)
        while total + nbytes > self.budget_bytes:
            leaves = [e for e in self._index.values() if e.path not in self._children]
            if not leaves:
                return False
            victim = min(leaves, key=lambda e: e.value(now))
            self._delete(victim.path)
            self.stats.evictions += 1
            total -= victim.nbytes
        return True

    def _refresh(self, entry: DiskLink) -> None:
        """Take a use stamped on the file by another process (touch) into the index."""
        st = self._lstat(entry.path)
        if st is not None:  # else gone: the caller's delete only forgets it
            entry.last_used = max(entry.last_used, st.st_mtime)

    def delete(self, paths: list[Path]) -> int:
        """Delete files (and every indexed file that chains through them), e.g. ones another
        process found damaged; returns how many this index knew or found. Missing ones are
        only forgotten."""
        n = 0
        for p in paths:
            n += self._delete_subtree(Path(p))
        return n

    def evict(self, nbytes: int) -> int:
        """Delete the least valuable leaves until `nbytes` are freed; returns the bytes freed."""
        now = self._clock()
        for e in list(self._index.values()):
            self._refresh(e)
        freed = 0
        while freed < nbytes:
            leaves = [e for e in self._index.values() if e.path not in self._children]
            if not leaves:
                break
            victim = min(leaves, key=lambda e: e.value(now))
            self._delete(victim.path)
            self.stats.evictions += 1
            freed += victim.nbytes
        return freed

    def clear(self, kind: str | None = None) -> int:
        """Delete every file of this fingerprint (of one kind, when given); returns how many."""
        n = 0
        for p in list(self._files()):
            is_anchor = p.parent.name.startswith(ANCHOR_PREFIX)
            if (p.name.endswith(SUFFIX) and not p.name.startswith(TMP_PREFIX)
                    and (kind is None or (kind == ANCHOR) == is_anchor)):
                self._unlink(p)
                self._forget(p)
                if kind == ANCHOR and self.on_delete is not None:
                    self.on_delete(p)  # another index of these files (the writer's) forgets it
                n += 1
        if kind is None:
            self._index.clear()
            self._children.clear()
        self._account()
        return n

    def clear_tenant(self, tag: bytes, kind: str) -> int:
        """Delete every file of `kind` (TREE or ANCHOR) of one tenant (domains ending with its
        tag, `core/keys.py`): the files of its domain folders, found by their names' tenant
        prefix (`_tenant_prefix`), so the work is one listing of this fingerprint's folder and
        the tenant's own files, whoever wrote them; returns how many were deleted. Index
        entries of the tenant's files already gone are forgotten too. Other tenants' files
        stay."""
        prefix = self._tenant_prefix(tag, kind)
        n = 0
        with os.scandir(self.dir) as it:
            folders = [e.name for e in it
                       if e.name.startswith(prefix) and e.is_dir(follow_symlinks=False)]
        for name in folders:
            try:
                with dir_fd(self.dir, name) as d, os.scandir(d) as it:
                    files = [e.name for e in it if e.name.endswith(SUFFIX)
                             and not e.name.startswith(TMP_PREFIX)]
                    for f in files:
                        try:
                            os.unlink(f, dir_fd=d)
                            n += 1
                        except FileNotFoundError:
                            pass
            except (FileNotFoundError, SymlinkRefused, NotADirectoryError):
                continue
        ours = in_tenant(tag)
        for entry in [e for e in self._index.values() if e.kind == kind and ours(e.domain)]:
            self._forget(entry.path)
        self._account()
        return n

    def __len__(self) -> int:
        return len(self._index)

    def sanity_check(self) -> None:
        """Index invariants (tests call this): every indexed file exists under this
        fingerprint's directory, names its own end, and the byte count adds up."""
        for p, e in self._index.items():
            assert p == e.path and p.parent.parent == self.dir, p
            assert p.exists(), f"indexed file {p} is gone"
            assert p.name.endswith(f"-{e.end}{SUFFIX}"), p
            if e.parent is not None and e.parent in self._index:
                assert p in self._children[e.parent], p
        for parent, kids in self._children.items():
            assert kids and all(k in self._index and self._index[k].parent == parent
                                for k in kids), parent
        assert self.stats.bytes == sum(e.nbytes for e in self._index.values())
