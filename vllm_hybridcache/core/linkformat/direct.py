"""Reading a link file's parts with direct I/O, verified as they stream (the disk hit's read).

Why: the buffered read (linkfile.read_parts) lets the kernel copy every byte out of the page
cache into the store buffer, allocating and filing page-cache pages on the way, and the CRC
pass then reads the destination back from memory: on the CI VM that CPU work, not the device,
set the read rate (docs/benchmarks/disk.md). Here the device writes the file straight into a
few page-aligned bounce buffers (`O_DIRECT`, CHUNK bytes per request, read ahead by a helper
thread while the caller works), and the caller checksums each chunk while it is still in the
CPU's cache and copies it into its part's destination. The page cache is neither filled nor
read. The file format already places every part at a page-aligned offset (linkfile.ALIGN).
The cost: a file still in the page cache (read in the life that wrote it) comes from the
device again; the restart this tier is for reads files the page cache no longer holds.

Verification is the same as the buffered read's: every part named and sized as the header
says, every byte of it read (a short read is `truncated`), and its CRC-32 and MAC over all its
bytes compared with the header's before the caller may use it (`checksum`, `unauthenticated`:
linkfile.check_part; both are computed chunk by chunk as the bytes land). A file system that
refuses direct I/O (tmpfs, some network and FUSE file systems) raises DirectIOUnsupported
before anything is verified; the caller then reads the file the buffered way.
"""

from __future__ import annotations

import errno
import itertools
import mmap
import os
import threading
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from ..auth import LinkKey
from .crc import crc32
from .linkfile import (
    ALIGN,
    LinkFileError,
    LinkFileHeader,
    LinkFileProblem,
    PartEntry,
    check_part,
    open_link,
)

__all__ = ["CHUNK", "DirectIOUnsupported", "helper", "read_parts_direct"]

CHUNK = 4 << 20  # bytes per read request (a common device maximum; a multiple of ALIGN)
AHEAD = 2  # chunks read ahead of the one being verified and copied
HELPERS = 2  # helper threads: two files read at once keep the device busy between files
_O_DIRECT = getattr(os, "O_DIRECT", 0)  # 0 off Linux: never used there


class DirectIOUnsupported(OSError):
    """The file system refused direct I/O for this file: read it the buffered way."""


class _Bounce:
    """Page-aligned buffers for direct reads, reused across reads (a fresh mapping per read
    would fault its pages in again), and the helper threads. Lock-protected: any thread may
    read a chain. A forked child starts afresh (`reset`): it inherits neither the parent's
    thread (a pool without it would never run a read) nor a lock another thread held."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._free: list[mmap.mmap] = []
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None

    def take(self, n: int) -> list[mmap.mmap]:
        with self._lock:
            self._free = [b for b in self._free if len(b) == CHUNK]
            got = [self._free.pop() for _ in range(min(n, len(self._free)))]
        return got + [mmap.mmap(-1, CHUNK) for _ in range(n - len(got))]

    def give(self, bufs: list[mmap.mmap]) -> None:
        with self._lock:
            self._free.extend(bufs)
            del self._free[AHEAD + 1:]  # what one read at a time needs; the rest unmapped

    def pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(HELPERS,
                                                thread_name_prefix="hybridcache-disk-read")
            return self._pool


_BOUNCE = _Bounce()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_BOUNCE.reset)


def helper() -> ThreadPoolExecutor:
    """The disk reads' helper threads (this process's own, also after a fork): they read
    ahead here (each chunk into its own bounce buffer), and read and check two link files at
    once for reader.py."""
    return _BOUNCE.pool()


def _dest(path: Path, header: LinkFileHeader, dst: Mapping[str, torch.Tensor]
          ) -> list[tuple[int, int, PartEntry, memoryview, str]]:
    """(offset in the payload, bytes, its header entry, destination, name) per part, by offset;
    raises `mismatch` unless `dst` names exactly the header's parts, each sized as stored, and
    `format` when parts overlap (the streaming below gives each byte to one part)."""
    entries = {e.name: e for e in header.parts}
    if set(dst) != set(entries):
        raise LinkFileError(LinkFileProblem.MISMATCH,
                            f"{path}: parts {sorted(entries)} != {sorted(dst)}")
    out = []
    for name, t in dst.items():
        e = entries[name]
        if not t.is_contiguous():
            raise ValueError("destination parts must be contiguous")
        mv = memoryview(t.view(torch.uint8).numpy()).cast("B")
        if mv.nbytes != e.nbytes:
            raise LinkFileError(LinkFileProblem.MISMATCH,
                                f"{path}: part {name} is {e.nbytes} bytes, {mv.nbytes} wanted")
        out.append((e.offset, e.nbytes, e, mv, name))
    out.sort(key=lambda p: p[0])
    for (o1, n1, *_), (o2, *_) in itertools.pairwise(out):
        if o2 < o1 + n1:
            raise LinkFileError(LinkFileProblem.FORMAT, f"{path}: parts overlap")
    return out


def read_parts_direct(path: Path, header: LinkFileHeader, base: int,
                      dst: Mapping[str, torch.Tensor], key: LinkKey,
                      root: Path | None = None) -> int:
    """Read every part named in `dst` into it with direct I/O and verify its CRC-32 and MAC
    (`key`); `root`: the cache folder no symlink below which is followed. Returns the
    bytes read. Same contract as linkfile.read_parts: on LinkFileError the destinations may
    hold partial bytes and must not be used. DirectIOUnsupported: nothing verified, read the
    file the buffered way."""
    parts = _dest(path, header, dst)
    if not parts:
        return 0
    if not _O_DIRECT or base % ALIGN or any(off % ALIGN for off, *_ in parts):
        raise DirectIOUnsupported(errno.EINVAL, "not aligned for direct I/O", str(path))
    lo = base + parts[0][0]
    hi = base + max(off + n for off, n, *_ in parts)
    starts = list(range(lo, hi, CHUNK))
    try:
        fd = open_link(path, root, os.O_RDONLY | _O_DIRECT)
    except OSError as e:
        if e.errno == errno.EINVAL:
            raise DirectIOUnsupported(e.errno, "direct I/O refused", str(path)) from e
        raise
    bufs = _BOUNCE.take(AHEAD + 1)
    views = [memoryview(b) for b in bufs]
    pending: dict[int, Future[int]] = {}
    pool = _BOUNCE.pool()
    try:
        def submit(k: int) -> None:
            if k < len(starts):
                pending[k] = pool.submit(os.preadv, fd, [views[k % len(views)]], starts[k])

        for k in range(AHEAD):
            submit(k)
        crcs = [0] * len(parts)
        macs = [key.part_mac(header.mac_alg) for _ in parts]
        i = 0  # the first part not read to its end yet (parts are sorted, disjoint)
        for k, at in enumerate(starts):
            try:
                got = (pending.pop(k).result() if AHEAD
                       else os.preadv(fd, [views[0]], at))
            except OSError as e:
                if e.errno == errno.EINVAL:
                    raise DirectIOUnsupported(e.errno, "direct I/O refused", str(path)) from e
                raise
            if AHEAD:
                submit(k + AHEAD)  # its buffer was copied out in iteration k - 1
            end = min(at + CHUNK, hi)
            if got < end - at:
                raise LinkFileError(LinkFileProblem.TRUNCATED,
                                    f"{path}: {at + got - base} payload bytes, "
                                    f"{hi - base} wanted")
            chunk = views[k % len(views)]
            while i < len(parts):
                off, n, _, mv, _ = parts[i]
                p_lo, p_hi = base + off, base + off + n
                if p_lo >= end:
                    break
                a, b = max(p_lo, at), min(p_hi, end)
                if a < b:  # this chunk's bytes of part i: copied, then checksummed where
                    # they landed (still in the CPU's cache): the CRC covers the store's bytes
                    out = mv[a - p_lo:b - p_lo]
                    out[:] = chunk[a - at:b - at]
                    crcs[i] = crc32(out, crcs[i])
                    macs[i].update(out)
                if p_hi > end:
                    break  # part i goes on in the next chunk
                i += 1
        for (_, _, entry, mv, _), got_crc, mac in zip(parts, crcs, macs, strict=True):
            check_part(path, entry, mv, key, header.mac_alg, crc=got_crc,
                       mac=mac.digest())
        return sum(n for _, n, *_ in parts)
    finally:
        for f in pending.values():  # never hand a buffer back while a read still fills it
            f.cancel()
            try:
                f.result()
            except BaseException:  # the read is abandoned either way
                pass
        os.close(fd)
        _BOUNCE.give(bufs)
