"""The huge-page hint the disk reader gives fresh store buffers (core/linkformat/hugepages.py): it
covers only the 2 MiB-aligned interior of the buffers' span, skips small or empty spans, and
a kernel that refuses it changes nothing about the read."""

from __future__ import annotations

import torch

from vllm_hybridcache.core.linkformat import hugepages
from vllm_hybridcache.core.linkformat.hugepages import HUGE, MIN_BYTES, advise_huge_pages


def _record(monkeypatch, rc: int = 0) -> list[tuple[int, int, int]]:
    calls: list[tuple[int, int, int]] = []

    def fake(addr: int, length: int, advice: int) -> int:
        calls.append((addr, length, advice))
        return rc

    monkeypatch.setattr(hugepages, "_MADVISE", fake)
    return calls


def test_the_hint_covers_the_aligned_interior_of_the_span(monkeypatch):
    calls = _record(monkeypatch)
    buf = torch.empty(MIN_BYTES + 3 * HUGE + 12345, dtype=torch.uint8)
    parts = [buf[100:5000], buf[5000:]]  # views of one allocation, as a link's parts are
    assert advise_huge_pages(parts) is True
    ((addr, length, advice),) = calls
    lo, hi = buf.data_ptr() + 100, buf.data_ptr() + buf.numel()
    assert advice == hugepages.MADV_HUGEPAGE
    assert addr % HUGE == 0 and length % HUGE == 0 and length >= MIN_BYTES
    assert lo <= addr < lo + HUGE and hi - HUGE < addr + length <= hi


def test_small_empty_and_refused_spans_are_left_alone(monkeypatch):
    calls = _record(monkeypatch)
    assert advise_huge_pages([]) is False
    assert advise_huge_pages([torch.empty(0)]) is False
    assert advise_huge_pages([torch.empty(MIN_BYTES // 2, dtype=torch.uint8)]) is False
    assert calls == []
    _record(monkeypatch, rc=-1)  # EINVAL: a kernel without THP
    assert advise_huge_pages([torch.empty(2 * MIN_BYTES, dtype=torch.uint8)]) is False


def test_the_real_hint_keeps_the_bytes():
    """On this host's kernel (hint taken or not), a buffer filled after the hint holds what
    was written to it."""
    buf = torch.empty(2 * MIN_BYTES, dtype=torch.uint8)
    advise_huge_pages([buf])
    src = torch.randint(0, 256, (buf.numel(),), dtype=torch.uint8)
    buf.copy_(src)
    assert torch.equal(buf, src)
