"""A link file read with one request straight into its staged link's buffer, then verified.

Why: the store lays a link staged from disk out as its file lays out its payload (every part at
a page-aligned offset, store.py `allocate(page_aligned=True)`) in a reused page-aligned buffer
(slabs.PagePool). The whole payload then goes from the file into that buffer with one read, and
with direct I/O the device writes it there itself: no page-cache copy, no user copy, no fresh
pages to fault in. On the CI VM reading that way into reused memory ran at 0.87-0.94 of `dd`
where the per-part buffered read into fresh buffers ran at 0.61-0.90
(docs/benchmarks/disk.md).

The read covers the payload rounded up to whole pages (direct I/O reads whole blocks; a file
ends where its last part ends, so the last request is cut short by the end of the file), and
only the payload's real length counts. Verification is the other reads' (linkfile.read_parts):
every part named and sized as the header says, the file long enough for all of them
(`truncated`), each part's CRC-32 and MAC over the bytes in the buffer, the ones the engine
gets (`checksum`, `unauthenticated`); on any error the buffer's bytes must not be used. A
file system that refuses direct I/O (tmpfs, some FUSE and network file systems) is read with
the same one request through the page cache; the reason is logged once per device.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from collections.abc import Collection, Mapping
from pathlib import Path

import torch

from ..auth import LinkKey
from .linkfile import (
    ALIGN,
    LinkFileError,
    LinkFileHeader,
    LinkFileProblem,
    check_part,
    open_link,
)

__all__ = ["DIRECT_FALLBACKS", "fits_in_place", "read_in_place", "read_payload",
           "split_point", "verify_payload"]

logger = logging.getLogger("vllm_hybridcache")

_O_DIRECT = getattr(os, "O_DIRECT", 0)  # 0 off Linux: always the buffered request there
# device id -> why its files were read through the page cache although direct I/O was asked
DIRECT_FALLBACKS: dict[int, str] = {}
_LOCK = threading.Lock()


def _payload_end(header: LinkFileHeader) -> int:
    return max((e.offset + e.nbytes for e in header.parts), default=0)


def _round_up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def fits_in_place(header: LinkFileHeader, buf: torch.Tensor,
                  parts: Mapping[str, torch.Tensor]) -> bool:
    """Whether `parts` (views of the CPU uint8 tensor `buf`) sit in `buf` exactly where the
    file puts them, with `buf` page-aligned and long enough for the payload in whole pages:
    then one read fills every part. False sends the caller to a per-part read (which also
    reports a header naming other parts or sizes as `mismatch`)."""
    entries = {e.name: e for e in header.parts}
    if (not entries or set(parts) != set(entries) or buf.device.type != "cpu"
            or buf.dtype != torch.uint8 or not buf.is_contiguous()):
        return False
    at = buf.data_ptr()
    if at % ALIGN or buf.numel() < _round_up(_payload_end(header)):
        return False
    for name, t in parts.items():
        e = entries[name]
        if (not t.is_contiguous() or t.data_ptr() - at != e.offset
                or t.numel() * t.element_size() != e.nbytes):
            return False
    return True


def _note_fallback(path: Path, reason: str) -> None:
    try:
        dev = os.stat(path).st_dev
    except OSError:
        dev = -1
    with _LOCK:
        if dev in DIRECT_FALLBACKS:
            return
        DIRECT_FALLBACKS[dev] = reason
    logger.warning("hybridcache: disk tier: direct I/O unavailable for %s (%s); reading its "
                   "device's link files through the page cache", path.parent, reason)


def _read_span(fd: int, out: memoryview, at: int) -> int:
    """Read into all of `out` from offset `at`; stops at the end of the file. Returns bytes."""
    got = 0
    while got < len(out):
        n = os.preadv(fd, [out[got:]], at + got)
        if n <= 0:
            break
        got += n
        if n % ALIGN:  # a request cut short by the end of the file
            break
    return got


def _read(path: Path, out: memoryview, at: int, direct: bool, root: Path | None) -> int:
    if direct and _O_DIRECT:
        try:
            fd = open_link(path, root, os.O_RDONLY | _O_DIRECT)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            _note_fallback(path, f"open with O_DIRECT: {os.strerror(e.errno)}")
        else:
            try:
                return _read_span(fd, out, at)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                _note_fallback(path, f"read with O_DIRECT: {os.strerror(e.errno)}")
            finally:
                os.close(fd)
    elif direct:
        _note_fallback(path, "no O_DIRECT on this platform")
    fd = open_link(path, root)
    try:
        return _read_span(fd, out, at)
    finally:
        os.close(fd)


def _span(header: LinkFileHeader, names: Collection[str] | None) -> tuple[int, int]:
    """The payload byte range [lo, hi) a read of the parts `names` (None: all) covers: from
    the first one's page-aligned offset to the last one's end."""
    parts = [e for e in header.parts if names is None or e.name in names]
    if not parts:
        return 0, 0
    return min(e.offset for e in parts) // ALIGN * ALIGN, max(e.offset + e.nbytes for e in parts)


def split_point(header: LinkFileHeader, first: Collection[str]) -> int | None:
    """Where the parts `first` end and all the others begin, when every part of `first` lies
    before every other part and the others start on a page boundary (a link file lays out its
    sections, then its views); None otherwise. Reading [split, end) then [0, split) reads
    the others first and `first` later, each with one request."""
    head = [e for e in header.parts if e.name in first]
    tail = [e for e in header.parts if e.name not in first]
    if not head or not tail:
        return None
    split = min(e.offset for e in tail)
    if split % ALIGN or max(e.offset + e.nbytes for e in head) > split:
        return None
    return split


def read_payload(path: Path, header: LinkFileHeader, base: int, buf: torch.Tensor,
                 direct: bool, names: Collection[str] | None = None,
                 root: Path | None = None) -> int:
    """Read the payload of the file at `path` (it starts at `base`, page-aligned) into `buf`
    with one request, direct I/O when `direct` and the file system takes it; nothing is
    verified yet (`verify_payload`). `buf` must pass `fits_in_place`. `names`: only the span
    of the payload that holds these parts (`_span`), each byte where the whole payload's read
    puts it. `root`: the cache folder no symlink below which is followed. Returns the bytes
    of the parts read; raises LinkFileError (`truncated`, `symlink`) or OSError."""
    lo, hi = _span(header, names)
    mv = memoryview(buf.numpy()).cast("B")
    got = _read(path, mv[lo:_round_up(hi)], base + lo, direct, root)
    if got < hi - lo:
        raise LinkFileError(LinkFileProblem.TRUNCATED,
                            f"{path}: {lo + got} payload bytes, {hi} wanted")
    return sum(e.nbytes for e in header.parts if names is None or e.name in names)


def verify_payload(path: Path, header: LinkFileHeader, buf: torch.Tensor, key: LinkKey,
                   names: Collection[str] | None = None) -> None:
    """Every part's (`names`: these parts') CRC-32 and MAC over its bytes in `buf`, as
    `read_payload` left them; LinkFileError (`checksum`, `unauthenticated`) at the first that
    differs. Only reads `buf`: it may run on another thread while the next file is read, as
    long as `buf` is not handed back before it returns."""
    mv = memoryview(buf.numpy()).cast("B")
    for e in header.parts:
        if names is not None and e.name not in names:
            continue
        check_part(path, e, mv[e.offset:e.offset + e.nbytes], key, header.mac_alg)


def read_in_place(path: Path, header: LinkFileHeader, base: int, buf: torch.Tensor,
                  direct: bool, names: Collection[str] | None = None, *, key: LinkKey,
                  root: Path | None = None) -> int:
    """`read_payload` then `verify_payload`: the payload (`names`: the span holding these
    parts) read into `buf` and every part read checked. Returns the bytes of the parts read;
    raises LinkFileError (`truncated`, `checksum`, `unauthenticated`: `buf` then holds bytes
    that must not be used) or OSError."""
    n = read_payload(path, header, base, buf, direct, names, root)
    verify_payload(path, header, buf, key, names)
    return n
