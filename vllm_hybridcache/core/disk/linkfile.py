"""Link files: one snapshot link as a self-contained, verifiable file (the disk tier's format).

A link file holds everything a restore needs without the engine that wrote it: the format
version, the fingerprint of the engine that computed the state (weights by content, dtypes,
state layout, kernel backend, ISA, versions, segmentation), the link's domain, its key digest
and its parent's, the token ids of its own segment [start, end), its draft tag on a speculative
(MTP) route (tags.py: which prompts its draft rows fit), and its parts (every section at `end`,
the view rows since the parent), each with a CRC-32. On Flash-Next's MTP route one section is
the target's hidden row at the boundary (adapter/draft_rows.py), checksummed like the others.

Format 2 added the draft tag; a file of format 1 is refused as `format` (a counted miss, the
file deleted), never read with a tag it does not have.

Layout (little endian):

    magic  b"HCLINK\\x00\\x01"            8 bytes
    header length, header CRC-32          2 x u32
    header                                msgpack (LinkFileHeader)
    zero padding to a multiple of ALIGN
    parts                                 each at header.parts[i].offset (ALIGN-aligned),
                                          relative to the end of the padded header

Why this shape: a reader learns from the first few KiB whether the file is one it may read at
all (magic, format, fingerprint, domain, tokens) before it touches payload bytes, and every part
is verified on its own, so a flipped byte anywhere is found before any byte reaches the engine.
Files are written under a temporary name in the same directory, fsynced, renamed over the final
name and the directory fsynced: a reader (or a crash) never sees a torn file under a final name.
"""

from __future__ import annotations

import os
import struct
import uuid
from collections.abc import Mapping
from enum import StrEnum
from pathlib import Path

import msgspec
import numpy as np
import torch

from .crc import crc32
from .tags import EncodedTag

__all__ = [
    "FORMAT_VERSION",
    "LinkFileError",
    "LinkFileHeader",
    "LinkFileProblem",
    "PartEntry",
    "fsync_dir",
    "read_header",
    "read_parts",
    "write_link_file",
]

MAGIC = b"HCLINK\x00\x01"
FORMAT_VERSION = 2  # 2: the draft tag (MTP route)
ALIGN = 4096  # page aligned parts: direct I/O and mmap friendly
TMP_PREFIX = ".tmp-"
_PRE = struct.Struct("<8sII")


class LinkFileProblem(StrEnum):
    """Why a link file was refused (each a counted miss; the file is never read further)."""

    NOT_A_LINK = "not_a_link"  # no magic: an unrelated file
    FORMAT = "format"  # another format version
    FOREIGN = "foreign"  # another engine fingerprint
    TRUNCATED = "truncated"  # shorter than its header says
    CHECKSUM = "checksum"  # a header or part CRC-32 does not match
    MISMATCH = "mismatch"  # the header does not describe what the reader asked for


class LinkFileError(Exception):
    """A link file that must not be used; `problem` says why."""

    def __init__(self, problem: LinkFileProblem, detail: str) -> None:
        super().__init__(f"{problem.value}: {detail}")
        self.problem = problem


class PartEntry(msgspec.Struct, frozen=True, array_like=True):
    """One part's place in the payload and its CRC-32."""

    name: str
    offset: int
    nbytes: int
    crc32: int


class LinkFileHeader(msgspec.Struct, frozen=True):
    """What a reader checks before it reads a payload byte.

    Invariants: 0 <= start < end; len(tokens) == 8 * (end - start) (int64 ids of the link's own
    segment); parts are sorted by offset, ALIGN-aligned and do not overlap; parent_digest is
    empty exactly when start == 0 (a root link).
    """

    format: int
    fingerprint: bytes
    domain: bytes
    digest: bytes
    parent_digest: bytes
    start: int
    end: int
    tokens: bytes
    rows: int  # view rows stored per view part
    parts: tuple[PartEntry, ...]
    created: float = 0.0
    # "tree" (a cold-exact link at a cut) or "anchor" (a spilled end anchor: session-exact,
    # the whole prefix [0, end) in one file). Kept apart on disk and checked at every read, so
    # a session's state can never serve as a shared tree link.
    kind: str = "tree"
    # the link's draft tag on a speculative route (tags.py), None elsewhere: a lookup applies
    # the same `fits` predicate to it as the RAM tiers do to their links' tags
    tag: EncodedTag | None = None

    def token_ids(self) -> np.ndarray:
        return np.frombuffer(self.tokens, dtype=np.int64)


def _as_bytes_view(t: torch.Tensor | np.ndarray) -> memoryview:
    if isinstance(t, torch.Tensor):
        t = t.detach().contiguous().view(torch.uint8).numpy()
    if not isinstance(t, np.ndarray) or t.dtype.hasobject:
        raise TypeError(f"a part must be a tensor or a numeric array, not {type(t).__name__}")
    return memoryview(np.ascontiguousarray(t)).cast("B")


def _round_up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def fsync_dir(path: Path) -> None:
    """Make a rename or unlink in `path` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_link_file(
    path: Path,
    *,
    fingerprint: bytes,
    domain: bytes,
    digest: bytes,
    parent_digest: bytes,
    start: int,
    end: int,
    tokens: np.ndarray,
    rows: int,
    parts: Mapping[str, torch.Tensor | np.ndarray],
    created: float = 0.0,
    kind: str = "tree",
    tag: EncodedTag | None = None,
) -> int:
    """Write one link atomically at `path`; returns the bytes written.

    `tokens` are the link's own token ids [start, end); `parts` maps part names to contiguous
    tensors (sections at `end`, view rows since the parent), written in the mapping's order;
    `tag`: the link's encoded draft tag (tags.py), None off a speculative route.
    """
    toks = np.ascontiguousarray(tokens, dtype=np.int64)
    if not 0 <= start < end or toks.shape != (end - start,):
        raise ValueError(f"tokens {toks.shape} do not cover the segment [{start}, {end})")
    if (start == 0) != (parent_digest == b""):
        raise ValueError("a root link (start 0) has no parent digest, every other link has one")
    views = {name: _as_bytes_view(t) for name, t in parts.items()}
    entries: list[PartEntry] = []
    offset = 0
    for name, mv in views.items():
        entries.append(PartEntry(name, offset, mv.nbytes, crc32(mv)))
        offset = _round_up(offset + mv.nbytes)
    header = msgspec.msgpack.encode(LinkFileHeader(
        FORMAT_VERSION, fingerprint, domain, digest, parent_digest, start, end, toks.tobytes(),
        rows, tuple(entries), created, kind, tag))
    pre = _PRE.pack(MAGIC, len(header), crc32(header))
    head = pre + header
    head += b"\0" * (_round_up(len(head)) - len(head))
    tmp = path.with_name(f"{TMP_PREFIX}{os.getpid()}-{uuid.uuid4().hex}-{path.name}")
    written = 0
    try:
        with open(tmp, "wb") as f:
            f.write(head)
            written = len(head)
            for entry, mv in zip(entries, views.values(), strict=True):
                pad = len(head) + entry.offset - written
                if pad:
                    f.write(b"\0" * pad)
                f.write(mv)
                written += pad + mv.nbytes
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return written


def read_header(path: Path, fingerprint: bytes) -> tuple[LinkFileHeader, int]:
    """The verified header of a link file and the payload's offset in the file.

    Raises LinkFileError for anything but a complete link file of this format and fingerprint;
    OSError passes through (a file removed by a concurrent sweep is the caller's miss).
    """
    with open(path, "rb") as f:
        pre = f.read(_PRE.size)
        if len(pre) < _PRE.size or pre[:8] != MAGIC:
            raise LinkFileError(LinkFileProblem.NOT_A_LINK, str(path))
        _, hlen, hcrc = _PRE.unpack(pre)
        raw = f.read(hlen)
        size = os.fstat(f.fileno()).st_size
    if len(raw) < hlen:
        raise LinkFileError(LinkFileProblem.TRUNCATED, f"{path}: header cut short")
    if crc32(raw) != hcrc:
        raise LinkFileError(LinkFileProblem.CHECKSUM, f"{path}: header")
    try:
        header = msgspec.msgpack.decode(raw, type=LinkFileHeader)
    except msgspec.DecodeError as e:
        raise LinkFileError(LinkFileProblem.FORMAT, f"{path}: {e}") from e
    if header.format != FORMAT_VERSION:
        raise LinkFileError(LinkFileProblem.FORMAT, f"{path}: format {header.format}")
    if header.fingerprint != fingerprint:
        raise LinkFileError(LinkFileProblem.FOREIGN, str(path))
    base = _round_up(_PRE.size + hlen)
    end = max((e.offset + e.nbytes for e in header.parts), default=0)
    if size < base + end:
        raise LinkFileError(LinkFileProblem.TRUNCATED, f"{path}: {size} < {base + end} bytes")
    return header, base


def read_parts(
    path: Path, header: LinkFileHeader, base: int, dst: Mapping[str, torch.Tensor]
) -> int:
    """Read every part named in `dst` into it (same byte size) and verify its CRC-32.

    On any mismatch raises LinkFileError; the destination may then hold partial bytes, so the
    caller must not use it. Returns the bytes read.
    """
    entries = {e.name: e for e in header.parts}
    if set(dst) != set(entries):
        raise LinkFileError(LinkFileProblem.MISMATCH,
                            f"{path}: parts {sorted(entries)} != {sorted(dst)}")
    n = 0
    with open(path, "rb", buffering=0) as f:
        for name, t in dst.items():
            e = entries[name]
            out = _as_writable_bytes(t)
            if out.nbytes != e.nbytes:
                raise LinkFileError(LinkFileProblem.MISMATCH,
                                    f"{path}: part {name} is {e.nbytes} bytes, {out.nbytes} wanted")
            f.seek(base + e.offset)
            got = f.readinto(out)
            if got != e.nbytes:
                raise LinkFileError(LinkFileProblem.TRUNCATED, f"{path}: part {name}")
            if crc32(out) != e.crc32:
                raise LinkFileError(LinkFileProblem.CHECKSUM, f"{path}: part {name}")
            n += got
    return n


def _as_writable_bytes(t: torch.Tensor) -> memoryview:
    if not t.is_contiguous():
        raise ValueError("destination parts must be contiguous")
    return memoryview(t.view(torch.uint8).numpy()).cast("B")
