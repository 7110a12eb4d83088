"""Link files round-trip bit for bit, and every kind of damage is refused before use."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.keys import TEST_KEY
from vllm_hybridcache.core.linkformat.linkfile import (
    ALIGN,
    LinkFileError,
    LinkFileProblem,
    read_header,
    read_parts,
    write_link_file,
)

FP = b"f" * 32
DOMAIN = b"d" * 32


def _parts(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "gdn.0#0": torch.randn(4, 8, 8, generator=g),                        # a section
        "gdn.0#1": torch.randn(3, 5, generator=g).to(torch.bfloat16),        # odd-sized section
        "attn.1": torch.randint(0, 255, (3, 1000), generator=g, dtype=torch.uint8),  # view rows
    }


def _write(path: Path, parts=None, start: int = 64, end: int = 128, **kw) -> dict:
    args = dict(fingerprint=FP, domain=DOMAIN, digest=b"k" * 16,
                parent_digest=b"p" * 16 if start else b"", start=start, end=end,
                tokens=np.arange(start, end), rows=3, parts=parts or _parts(), created=1.5)
    args.update(kw)
    write_link_file(path, **args, key=TEST_KEY)
    return args


def _empty_like(parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.empty_like(v) for k, v in parts.items()}


def test_round_trip_is_bit_exact(tmp_path):
    path = tmp_path / "a.link"
    parts = _parts()
    _write(path, parts)
    header, base = read_header(path, FP, TEST_KEY)
    assert (header.start, header.end, header.rows) == (64, 128, 3)
    assert header.domain == DOMAIN and header.parent_digest == b"p" * 16
    assert header.token_ids().tolist() == list(range(64, 128))
    assert base % ALIGN == 0 and all(e.offset % ALIGN == 0 for e in header.parts)
    out = _empty_like(parts)
    n = read_parts(path, header, base, out, TEST_KEY)
    assert n == sum(t.numel() * t.element_size() for t in parts.values())
    for k, v in parts.items():
        assert torch.equal(out[k].view(torch.uint8), v.view(torch.uint8)), k
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def test_root_link_has_no_parent_digest(tmp_path):
    _write(tmp_path / "r.link", start=0, end=64)
    with pytest.raises(ValueError):
        _write(tmp_path / "bad.link", start=0, end=64, parent_digest=b"p" * 16)


@pytest.mark.parametrize("part", ["gdn.0#0", "gdn.0#1", "attn.1"])
def test_a_flipped_byte_in_any_part_is_caught(tmp_path, part):
    path = tmp_path / "a.link"
    parts = _parts()
    _write(path, parts)
    header, base = read_header(path, FP, TEST_KEY)
    entry = next(e for e in header.parts if e.name == part)
    with open(path, "r+b") as f:
        f.seek(base + entry.offset + entry.nbytes // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x01]))
    with pytest.raises(LinkFileError) as e:
        read_parts(path, header, base, _empty_like(parts), TEST_KEY)
    assert e.value.problem is LinkFileProblem.CHECKSUM and part in str(e.value)


def test_a_flipped_header_byte_is_caught(tmp_path):
    path = tmp_path / "a.link"
    _write(path)
    with open(path, "r+b") as f:
        f.seek(60)
        b = f.read(1)
        f.seek(60)
        f.write(bytes([b[0] ^ 0x80]))
    with pytest.raises(LinkFileError) as e:
        read_header(path, FP, TEST_KEY)
    assert e.value.problem is LinkFileProblem.CHECKSUM


def test_truncated_file_is_refused(tmp_path):
    path = tmp_path / "a.link"
    _write(path)
    size = path.stat().st_size
    os.truncate(path, size - 10)
    with pytest.raises(LinkFileError) as e:
        read_header(path, FP, TEST_KEY)
    assert e.value.problem is LinkFileProblem.TRUNCATED
    os.truncate(path, 20)
    with pytest.raises(LinkFileError) as e:
        read_header(path, FP, TEST_KEY)
    assert e.value.problem is LinkFileProblem.TRUNCATED


def test_foreign_fingerprint_and_unrelated_files_are_refused(tmp_path):
    path = tmp_path / "a.link"
    _write(path)
    with pytest.raises(LinkFileError) as e:
        read_header(path, b"g" * 32, TEST_KEY)
    assert e.value.problem is LinkFileProblem.FOREIGN
    other = tmp_path / "notes.txt"
    other.write_bytes(b"hello, not a link file at all")
    with pytest.raises(LinkFileError) as e:
        read_header(other, FP, TEST_KEY)
    assert e.value.problem is LinkFileProblem.NOT_A_LINK


def test_reader_must_ask_for_exactly_the_stored_parts(tmp_path):
    path = tmp_path / "a.link"
    parts = _parts()
    _write(path, parts)
    header, base = read_header(path, FP, TEST_KEY)
    fewer = _empty_like(parts)
    fewer.pop("attn.1")
    with pytest.raises(LinkFileError) as e:
        read_parts(path, header, base, fewer, TEST_KEY)
    assert e.value.problem is LinkFileProblem.MISMATCH
    wrong = _empty_like(parts)
    wrong["attn.1"] = torch.empty(2, 1000, dtype=torch.uint8)
    with pytest.raises(LinkFileError) as e:
        read_parts(path, header, base, wrong, TEST_KEY)
    assert e.value.problem is LinkFileProblem.MISMATCH


def test_a_failed_write_leaves_neither_a_final_nor_a_temporary_file(tmp_path, monkeypatch):
    path = tmp_path / "a.link"
    with pytest.raises(ValueError):
        _write(path, tokens=np.arange(3))  # tokens do not cover the segment
    with pytest.raises(TypeError):
        _write(path, {"x": object()})  # type: ignore[dict-item]
    assert list(tmp_path.iterdir()) == []

    def full_disk(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)  # fails after the payload was written
    with pytest.raises(OSError):
        _write(path)
    assert list(tmp_path.iterdir()) == []


def test_rewrite_replaces_atomically(tmp_path):
    path = tmp_path / "a.link"
    _write(path, _parts(0))
    parts1 = _parts(1)
    _write(path, parts1)
    header, base = read_header(path, FP, TEST_KEY)
    out = _empty_like(parts1)
    read_parts(path, header, base, out, TEST_KEY)
    assert all(torch.equal(out[k].view(torch.uint8), v.view(torch.uint8))
               for k, v in parts1.items())


def test_the_crc_of_link_files_is_zlibs_crc32(tmp_path):
    """core/linkformat/crc.py picks ISA-L's CRC-32 when installed (a dependency:
    pyproject.toml); it must give zlib's values, so files written by either verify with the
    other."""
    import zlib

    from vllm_hybridcache.core.linkformat import crc

    pytest.importorskip("isal")
    assert crc.BACKEND == "isal"
    rng = np.random.default_rng(0)
    for n in (0, 1, 7, 4096, 1 << 20, (1 << 20) + 13):
        buf = memoryview(rng.integers(0, 256, n, dtype=np.uint8).tobytes())
        assert crc.crc32(buf) == zlib.crc32(buf)
    p = tmp_path / "x.link"
    _write(p)
    h, base = read_header(p, FP, TEST_KEY)
    raw = p.read_bytes()
    for e in h.parts:
        assert zlib.crc32(raw[base + e.offset:base + e.offset + e.nbytes]) == e.crc32
