"""The direct-I/O read of link files (core/linkformat/direct.py): the bytes it hands over equal the
stored ones bit for bit, and everything the buffered read refuses it refuses too (a flipped
byte anywhere, a file cut short after its header was checked, other parts than stored); a file
system without direct I/O falls back to the buffered read, verified the same way."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch

from tests.keys import TEST_KEY
from vllm_hybridcache.core.linkformat import direct, reader
from vllm_hybridcache.core.linkformat.direct import DirectIOUnsupported, read_parts_direct
from vllm_hybridcache.core.linkformat.linkfile import (
    LinkFileError,
    LinkFileProblem,
    PartEntry,
    read_header,
    read_parts,
    write_link_file,
)

FP = b"f" * 32


def _parts(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "gdn.0#0": torch.randn(3, 1000, generator=g),                         # 12,000 bytes
        "gdn.0#1": torch.randn(3, 5, generator=g).to(torch.bfloat16),         # 30 bytes
        "attn.1": torch.randint(0, 255, (7, 5000), generator=g, dtype=torch.uint8),  # 35,000
        "empty": torch.empty(0, dtype=torch.float32),
    }


def _write(path: Path, parts: dict[str, torch.Tensor]) -> None:
    write_link_file(path, fingerprint=FP, domain=b"d" * 32, digest=b"k" * 16,
                    parent_digest=b"", start=0, end=64, tokens=np.arange(64), rows=7,
                    parts=parts, key=TEST_KEY)


def _empty_like(parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.full_like(v.view(torch.uint8), 0xAB).view(v.dtype).view(v.shape)
            for k, v in parts.items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)


@pytest.fixture(params=[(8192, 0), (8192, 2), (4096, 1), (direct.CHUNK, 2)],
                ids=["8k-sync", "8k-ahead2", "4k-ahead1", "default"])
def chunking(request, monkeypatch):
    """Small chunks make parts start, straddle and end inside chunks; AHEAD 0 reads on the
    calling thread, above 0 ahead on the helper thread."""
    chunk, ahead = request.param
    monkeypatch.setattr(direct, "CHUNK", chunk)
    monkeypatch.setattr(direct, "AHEAD", ahead)
    return request.param


@pytest.fixture
def link(tmp_path) -> tuple[Path, dict[str, torch.Tensor]]:
    path = tmp_path / "a.link"
    parts = _parts()
    _write(path, parts)
    header, base = read_header(path, FP, TEST_KEY)
    try:  # the property under test needs a file system that takes O_DIRECT
        read_parts_direct(path, header, base, _empty_like(parts), TEST_KEY)
    except DirectIOUnsupported:
        pytest.skip(f"{tmp_path} does not take direct I/O")
    return path, parts


def test_direct_read_is_bit_exact_and_equals_the_buffered_read(link, chunking):
    path, parts = link
    header, base = read_header(path, FP, TEST_KEY)
    out, buffered = _empty_like(parts), _empty_like(parts)
    n = read_parts_direct(path, header, base, out, TEST_KEY)
    assert n == sum(t.numel() * t.element_size() for t in parts.values())
    assert _same(out, parts)
    read_parts(path, header, base, buffered, TEST_KEY)
    assert _same(buffered, out)


@pytest.mark.parametrize("where", ["first", "chunk_edge", "last"])
def test_a_flipped_byte_in_any_part_is_caught(link, chunking, where):
    path, parts = link
    header, base = read_header(path, FP, TEST_KEY)
    for e in header.parts:
        if not e.nbytes:
            continue
        at = {"first": 0, "last": e.nbytes - 1,
              "chunk_edge": min(e.nbytes - 1, direct.CHUNK - e.offset % direct.CHUNK)}[where]
        raw = bytearray(path.read_bytes())
        raw[base + e.offset + at] ^= 0x10
        path.write_bytes(bytes(raw))
        with pytest.raises(LinkFileError) as ei:
            read_parts_direct(path, header, base, _empty_like(parts), TEST_KEY)
        assert ei.value.problem == LinkFileProblem.CHECKSUM and e.name in str(ei.value)
        raw[base + e.offset + at] ^= 0x10  # restored: the file reads cleanly again
        path.write_bytes(bytes(raw))
        read_parts_direct(path, header, base, _empty_like(parts), TEST_KEY)


@pytest.mark.parametrize("cut", [1, 4096, 30_000])
def test_a_file_cut_short_after_its_header_was_checked_is_refused(link, chunking, cut):
    path, parts = link
    header, base = read_header(path, FP, TEST_KEY)
    os.truncate(path, path.stat().st_size - cut)  # e.g. another engine rewriting it
    with pytest.raises(LinkFileError) as ei:
        read_parts_direct(path, header, base, _empty_like(parts), TEST_KEY)
    assert ei.value.problem == LinkFileProblem.TRUNCATED


def test_the_reader_must_ask_for_exactly_the_stored_parts(link):
    path, parts = link
    header, base = read_header(path, FP, TEST_KEY)
    fewer = _empty_like(parts)
    del fewer["attn.1"]
    with pytest.raises(LinkFileError) as ei:
        read_parts_direct(path, header, base, fewer, TEST_KEY)
    assert ei.value.problem == LinkFileProblem.MISMATCH
    other = _empty_like(parts)
    other["attn.1"] = torch.empty(6, 5000, dtype=torch.uint8)
    with pytest.raises(LinkFileError) as ei:
        read_parts_direct(path, header, base, other, TEST_KEY)
    assert ei.value.problem == LinkFileProblem.MISMATCH


def test_overlapping_parts_are_refused(link):
    """A header whose parts overlap (never written by the tier) is refused, not streamed: the
    direct read hands each byte to one part."""
    path, parts = link
    header, base = read_header(path, FP, TEST_KEY)
    bad = list(header.parts)
    a, b = bad[0], bad[1]
    bad[1] = PartEntry(b.name, a.offset + 4096, b.nbytes, b.crc32, b.mac)
    forged = msgspec.structs.replace(header, parts=tuple(bad))
    with pytest.raises(LinkFileError) as ei:
        read_parts_direct(path, forged, base, _empty_like(parts), TEST_KEY)
    assert ei.value.problem == LinkFileProblem.FORMAT


def test_without_direct_io_the_buffered_read_takes_over_verified(link, monkeypatch):
    """A file system refusing O_DIRECT (EINVAL at open, as tmpfs does) falls back to the
    buffered read, which checks the same: clean bytes come through, a flipped byte is caught."""
    path, parts = link
    header, base = read_header(path, FP, TEST_KEY)
    real_open, calls = os.open, []

    def no_direct(p, flags, *a, **kw):
        if flags & direct._O_DIRECT:
            calls.append(p)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(p, flags, *a, **kw)

    monkeypatch.setattr(direct.os, "open", no_direct)
    with pytest.raises(DirectIOUnsupported):
        read_parts_direct(path, header, base, _empty_like(parts), TEST_KEY)
    out = _empty_like(parts)
    assert reader.read_verified(path, header, base, out, direct=True, key=TEST_KEY) == sum(
        t.numel() * t.element_size() for t in parts.values())
    assert _same(out, parts) and len(calls) == 2
    raw = bytearray(path.read_bytes())
    raw[base + header.parts[0].offset + 7] ^= 1
    path.write_bytes(bytes(raw))
    with pytest.raises(LinkFileError) as ei:
        reader.read_verified(path, header, base, _empty_like(parts), direct=True, key=TEST_KEY)
    assert ei.value.problem == LinkFileProblem.CHECKSUM


def test_a_failed_read_mid_file_surfaces_and_returns_the_buffers(link, monkeypatch):
    """An I/O error on a later chunk fails the read (the stage counts it as io_error) and the
    bounce buffers come back to the pool only once no read fills them."""
    path, parts = link
    header, base = read_header(path, FP, TEST_KEY)
    monkeypatch.setattr(direct, "CHUNK", 8192)
    monkeypatch.setattr(direct, "AHEAD", 2)
    real, n = os.preadv, []

    def flaky(fd, bufs, off):
        n.append(off)
        if len(n) == 3:
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, bufs, off)

    monkeypatch.setattr(direct.os, "preadv", flaky)
    with pytest.raises(OSError) as ei:
        read_parts_direct(path, header, base, _empty_like(parts), TEST_KEY)
    assert ei.value.errno == errno.EIO
    monkeypatch.setattr(direct.os, "preadv", real)
    out = _empty_like(parts)
    read_parts_direct(path, header, base, out, TEST_KEY)
    assert _same(out, parts)


def _read_in_child(path: str, want: dict[str, np.ndarray], conn) -> None:
    # numpy only in the child: torch's own thread pool is not fork-safe (its first parallel
    # op in a forked child can hang), which is not what this test is about
    header, base = read_header(Path(path), FP, TEST_KEY)
    out = {k: torch.from_numpy(np.zeros(v.nbytes, np.uint8)) for k, v in want.items()}
    read_parts_direct(Path(path), header, base, out, TEST_KEY)
    conn.send(all(np.array_equal(out[k].numpy(), v) for k, v in want.items()))


def test_a_forked_child_reads_with_its_own_read_ahead_thread(link, monkeypatch):
    """The parent's read-ahead thread does not exist in a forked child: the child must start
    its own (a pool inherited without its thread would never run a read: the child hung)."""
    import multiprocessing

    path, parts = link
    monkeypatch.setattr(direct, "AHEAD", 2)
    header, base = read_header(path, FP, TEST_KEY)
    # the parent's thread exists
    read_parts_direct(path, header, base, _empty_like(parts), TEST_KEY)
    want = {k: v.contiguous().view(torch.uint8).reshape(-1).numpy().copy()
            for k, v in parts.items()}
    ctx = multiprocessing.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_read_in_child, args=(str(path), want, send))
    child.start()
    ok = recv.poll(120) and recv.recv()  # a hang detector, not a speed limit
    child.join(5)
    if child.is_alive():
        child.kill()
    assert ok is True and child.exitcode == 0
