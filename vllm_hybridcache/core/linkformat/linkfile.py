"""Link files: one snapshot link as a self-contained, authenticated file (the disk tier's format,
and the cluster tier's payload).

A link file holds everything a restore needs without the engine that wrote it: the format
version, the fingerprint of the engine that computed the state (weights by content, dtypes,
state layout, kernel backend, ISA, versions, segmentation), the link's domain, its key digest
and its parent's, the token ids of its own segment [start, end), its draft tag on a speculative
(MTP) route (tags.py: which prompts its draft rows fit), and its parts (every section at `end`,
the view rows since the parent), each with a CRC-32 and a MAC. On Flash-Next's MTP route one
section is the target's hidden row at the boundary (adapter/draft_rows.py), checked like the
others.

Authentication (format 3): the header carries a MAC (HMAC-SHA256 or keyed BLAKE2b, whichever is
faster on the writing CPU: core/auth.py `MacAlgorithm`, named by the magic's last byte and
again in the header) over the prelude and the header bytes, and each part entry the MAC of that
part's bytes, keyed by the secret of the tier that wrote it (the disk key, or the cluster
secret). A CRC-32 only catches corruption: anyone can compute one, so a forged file with valid
CRCs was once served as cold-exact. Now a reader checks the header's CRC (fast corruption
check), then its MAC, before it decodes the header; and each part's CRC, then its MAC, before
any byte of it may reach the engine. A file that fails a MAC is `unauthenticated` (a counted
miss; the file is deleted). A file of an older format (2 had no MACs) is refused as `format`,
never read.

Layout (little endian):

    magic  b"HCLINK\\x00" + MAC algorithm  8 bytes (\\x02 BLAKE2b, \\x03 HMAC-SHA256;
                                          \\x01: formats 1-2, refused)
    header length, header CRC-32          2 x u32
    header MAC                            32 bytes, over magic, length and header
    header                                msgpack (LinkFileHeader)
    zero padding to a multiple of ALIGN
    parts                                 each at header.parts[i].offset (ALIGN-aligned),
                                          relative to the end of the padded header

Why this shape: a reader learns from the first few KiB whether the file is one it may read at
all (magic, MAC, format, fingerprint, domain, tokens) before it touches payload bytes, and
every part is verified on its own, so a flipped byte anywhere is found before any byte reaches
the engine, and a part read later (a deferred section) is checked then. Files are created
0600 under a temporary name in the same folder (opened without following a symlink below the
cache folder: safeio.py), fsynced, renamed over the final name and the folder fsynced: a reader
(or a crash) never sees a torn file under a final name.
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

from ..auth import MAC_BYTES, PREFERRED_MAC, LinkKey, MacAlgorithm
from .crc import crc32
from .safeio import SymlinkRefused, dir_fd, open_below, relative_parts
from .tags import EncodedTag

__all__ = [
    "ALIGN",
    "FORMAT_VERSION",
    "MAGIC",
    "TMP_PREFIX",
    "LinkFileError",
    "LinkFileHeader",
    "LinkFileProblem",
    "PartEntry",
    "check_part",
    "open_link",
    "read_header",
    "read_parts",
    "write_link_file",
]

_MAGIC_FAMILY = b"HCLINK\x00"  # then one byte: 1 formats 1-2 (refused), else a MacAlgorithm


def magic(alg: MacAlgorithm) -> bytes:
    """The magic of a file whose MACs are computed with `alg`."""
    return _MAGIC_FAMILY + bytes([int(alg)])


MAGIC = magic(PREFERRED_MAC)  # what this process writes
_ALGS = frozenset(int(a) for a in MacAlgorithm)
FORMAT_VERSION = 3  # 2: the draft tag (MTP route); 3: MACs over the header and every part
ALIGN = 4096  # page aligned parts: direct I/O and mmap friendly
# the largest header a reader reads: its token ids are 8 bytes each, so 16 MiB allows a link of
# about 2M tokens, far past any context; a longer length is refused before it is read
HEADER_MAX = 16 << 20
TMP_PREFIX = ".tmp-"
_PRE = struct.Struct(f"<8sII{MAC_BYTES}s")
_PRE_MACED = struct.Struct("<8sII")  # the part of the prelude its MAC covers


class LinkFileProblem(StrEnum):
    """Why a link file was refused (each a counted miss; the file is never read further)."""

    NOT_A_LINK = "not_a_link"  # no magic: an unrelated file
    FORMAT = "format"  # another format version
    FOREIGN = "foreign"  # another engine fingerprint
    TRUNCATED = "truncated"  # shorter than its header says
    CHECKSUM = "checksum"  # a header or part CRC-32 does not match
    UNAUTHENTICATED = "unauthenticated"  # a header or part MAC does not match: another key
    MISMATCH = "mismatch"  # the header does not describe what the reader asked for
    SYMLINK = "symlink"  # a symlink (or not a regular file) where a link file or folder was


class LinkFileError(Exception):
    """A link file that must not be used; `problem` says why."""

    def __init__(self, problem: LinkFileProblem, detail: str) -> None:
        super().__init__(f"{problem.value}: {detail}")
        self.problem = problem


class PartEntry(msgspec.Struct, frozen=True, array_like=True):
    """One part's place in the payload, its CRC-32 and its MAC (LinkKey.part_mac)."""

    name: str
    offset: int
    nbytes: int
    crc32: int
    mac: bytes


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
    # how the MACs are computed (a MacAlgorithm; equal to the magic's last byte)
    mac_alg: int = int(MacAlgorithm.BLAKE2B)
    # which tensor-parallel rank's shard of the link the payload is ("rank/world", shard.py),
    # "" with one worker: a reader takes only its own rank's (another rank's file is foreign)
    shard: str = ""

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


def check_part(path: Path, entry: PartEntry, data: memoryview, key: LinkKey, alg: int,
               crc: int | None = None, mac: bytes | None = None) -> None:
    """Verify one part's bytes (`data`, as the engine will get them): CRC-32 first (a cheap
    corruption check), then the MAC (`alg`: the header's `mac_alg`). `crc`/`mac`: already
    computed while the bytes streamed in (direct reads). Raises LinkFileError (`checksum`,
    `unauthenticated`)."""
    if (crc32(data) if crc is None else crc) != entry.crc32:
        raise LinkFileError(LinkFileProblem.CHECKSUM, f"{path}: part {entry.name}")
    if mac is None:
        h = key.part_mac(MacAlgorithm(alg))
        h.update(data)
        mac = h.digest()
    if not LinkKey.equal(mac, entry.mac):
        raise LinkFileError(LinkFileProblem.UNAUTHENTICATED, f"{path}: part {entry.name}")


def open_link(path: Path, root: Path | None = None, flags: int = os.O_RDONLY,
              mode: int = 0o600) -> int:
    """A descriptor of the link file `path`, never through a symlink below `root` (default:
    its own folder, so only the file itself is checked); LinkFileError `symlink` for one."""
    try:
        return open_below(Path(root) if root is not None else Path(path).parent, Path(path),
                          flags, mode)
    except SymlinkRefused as e:
        raise LinkFileError(LinkFileProblem.SYMLINK, str(path)) from e


def write_link_file(
    path: Path,
    *,
    key: LinkKey,
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
    root: Path | None = None,
    shard: str = "",
) -> int:
    """Write one link atomically at `path` (mode 0600), authenticated with `key`; returns the
    bytes written.

    `tokens` are the link's own token ids [start, end); `parts` maps part names to contiguous
    tensors (sections at `end`, view rows since the parent), written in the mapping's order;
    `tag`: the link's encoded draft tag (tags.py), None off a speculative route; `root`: the
    cache folder `path` lies below (no symlink below it is followed; default its own folder);
    `shard`: the rank's shard the parts are at TP > 1 (shard.py `Shard.tag`), "" otherwise.
    """
    toks = np.ascontiguousarray(tokens, dtype=np.int64)
    if not 0 <= start < end or toks.shape != (end - start,):
        raise ValueError(f"tokens {toks.shape} do not cover the segment [{start}, {end})")
    if (start == 0) != (parent_digest == b""):
        raise ValueError("a root link (start 0) has no parent digest, every other link has one")
    alg = PREFERRED_MAC
    views = {name: _as_bytes_view(t) for name, t in parts.items()}
    entries: list[PartEntry] = []
    offset = 0
    for name, mv in views.items():
        h = key.part_mac(alg)
        h.update(mv)
        entries.append(PartEntry(name, offset, mv.nbytes, crc32(mv), h.digest()))
        offset = _round_up(offset + mv.nbytes)
    header = msgspec.msgpack.encode(LinkFileHeader(
        FORMAT_VERSION, fingerprint, domain, digest, parent_digest, start, end, toks.tobytes(),
        rows, tuple(entries), created, kind, tag, int(alg), shard))
    maced = _PRE_MACED.pack(magic(alg), len(header), crc32(header))
    head = maced + key.mac(maced, header, alg=alg) + header
    head += b"\0" * (_round_up(len(head)) - len(head))
    path = Path(path)
    root = Path(root) if root is not None else path.parent
    folder = relative_parts(root, path)[:-1]
    tmp_name = f"{TMP_PREFIX}{os.getpid()}-{uuid.uuid4().hex}-{path.name}"
    tmp = path.with_name(tmp_name)
    written = 0
    fd = open_link(tmp, root, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
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
        with dir_fd(root, *folder) as d:
            os.replace(tmp_name, path.name, src_dir_fd=d, dst_dir_fd=d)
            os.fsync(d)
    except BaseException:
        try:
            with dir_fd(root, *folder) as d:
                os.unlink(tmp_name, dir_fd=d)
        except OSError:
            pass
        raise
    return written


def read_header(path: Path, fingerprint: bytes, key: LinkKey,
                root: Path | None = None, shard: str = "") -> tuple[LinkFileHeader, int]:
    """The verified header of a link file and the payload's offset in the file.

    Checks, in order: the magic, the header's CRC-32 and MAC (before its bytes are decoded),
    the format, the fingerprint and the shard. Raises LinkFileError for anything but a complete
    link file of this format, fingerprint and shard (`write_link_file`) written with `key`;
    OSError passes through (a file removed by a concurrent sweep is the caller's miss). `root`:
    as for `write_link_file`.
    """
    fd = open_link(path, root)
    with os.fdopen(fd, "rb") as f:
        pre = f.read(_PRE.size)
        if len(pre) < 8 or pre[:7] != _MAGIC_FAMILY:
            raise LinkFileError(LinkFileProblem.NOT_A_LINK, str(path))
        if pre[7] not in _ALGS:
            raise LinkFileError(LinkFileProblem.FORMAT, f"{path}: an earlier format")
        alg = MacAlgorithm(pre[7])
        if len(pre) < _PRE.size:
            raise LinkFileError(LinkFileProblem.TRUNCATED, f"{path}: prelude cut short")
        _, hlen, hcrc, hmac = _PRE.unpack(pre)
        if hlen > HEADER_MAX:  # never read a planted length's worth before the MAC check
            raise LinkFileError(LinkFileProblem.FORMAT, f"{path}: a {hlen}-byte header")
        raw = f.read(hlen)
        size = os.fstat(f.fileno()).st_size
    if len(raw) < hlen:
        raise LinkFileError(LinkFileProblem.TRUNCATED, f"{path}: header cut short")
    if crc32(raw) != hcrc:
        raise LinkFileError(LinkFileProblem.CHECKSUM, f"{path}: header")
    if not LinkKey.equal(key.mac(pre[:_PRE_MACED.size], raw, alg=alg), hmac):
        raise LinkFileError(LinkFileProblem.UNAUTHENTICATED, f"{path}: header")
    try:
        header = msgspec.msgpack.decode(raw, type=LinkFileHeader)
    except msgspec.DecodeError as e:
        raise LinkFileError(LinkFileProblem.FORMAT, f"{path}: {e}") from e
    if header.format != FORMAT_VERSION or header.mac_alg != alg:
        raise LinkFileError(LinkFileProblem.FORMAT, f"{path}: format {header.format}")
    if header.fingerprint != fingerprint:
        raise LinkFileError(LinkFileProblem.FOREIGN, str(path))
    if header.shard != shard:  # another rank's shard of the link (TP): foreign to this one
        raise LinkFileError(LinkFileProblem.FOREIGN, f"{path}: shard {header.shard!r}")
    base = _round_up(_PRE.size + hlen)
    end = max((e.offset + e.nbytes for e in header.parts), default=0)
    if size < base + end:
        raise LinkFileError(LinkFileProblem.TRUNCATED, f"{path}: {size} < {base + end} bytes")
    return header, base


def read_parts(
    path: Path, header: LinkFileHeader, base: int, dst: Mapping[str, torch.Tensor],
    key: LinkKey, root: Path | None = None,
) -> int:
    """Read every part named in `dst` into it (same byte size) and verify its CRC-32 and MAC.

    On any mismatch raises LinkFileError; the destination may then hold partial bytes, so the
    caller must not use it. Returns the bytes read.
    """
    entries = {e.name: e for e in header.parts}
    if set(dst) != set(entries):
        raise LinkFileError(LinkFileProblem.MISMATCH,
                            f"{path}: parts {sorted(entries)} != {sorted(dst)}")
    n = 0
    fd = open_link(path, root)
    with os.fdopen(fd, "rb", buffering=0) as f:
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
            check_part(path, e, out, key, header.mac_alg)
            n += got
    return n


def _as_writable_bytes(t: torch.Tensor) -> memoryview:
    if not t.is_contiguous():
        raise ValueError("destination parts must be contiguous")
    return memoryview(t.view(torch.uint8).numpy()).cast("B")


