"""Huge-page buffers of the disk read's pool (slabs.PagePool with `huge_pages` advice): a fresh
unpinned buffer of at least 2 MiB is an anonymous mapping of its own starting on a 2 MiB
boundary, its whole 2 MiB pages advised as huge and its tail not, so it never holds more than
its size class; it is reused like any pool buffer, the bound still holds, and a buffer let go
is really unmapped (once its last view is gone). Where the advice is missing or refused the
pool falls back to torch's allocation for good. A chain read into such buffers lands and
verifies bit for bit as into torch's (the same checks catch a flipped byte and a short file)."""

from __future__ import annotations

import errno
import gc
import mmap
import sys
import weakref
from pathlib import Path

import pytest
import torch

from tests.core.test_core_disk_inplace import _u8
from tests.core.test_core_disk_inplace import _write_chain as write_chain
from vllm_hybridcache.core import LinkStore, SectionSpec, StateLayout, ViewSpec
from vllm_hybridcache.core.disk.reader import DiskReadError, stage_chain
from vllm_hybridcache.core.slabs import (
    HUGE,
    HUGE_PAGES,
    PAGE,
    PagePool,
    SlabArena,
    default_huge_advice,
    size_class,
    thp_mode,
)

LINUX = sys.platform.startswith("linux")


class Advice:
    """A recording huge-page advice: every call, and a weak reference to each mapping it saw
    (dead once the mapping is unmapped). `fail`: raise that error instead of advising."""

    def __init__(self, fail: Exception | None = None, real: bool = False) -> None:
        self.calls: list[tuple[int, int, int, bool]] = []  # (mapping address, off, len, huge)
        self.maps: list[weakref.ref] = []  # one per buffer, in allocation order
        self.fail = fail
        self.real = real

    def __call__(self, mm: mmap.mmap, offset: int, length: int, huge: bool) -> None:
        assert isinstance(mm, mmap.mmap)
        if self.fail is not None:
            raise self.fail
        at = torch.frombuffer(mm, dtype=torch.uint8).data_ptr()
        self.calls.append((at, offset, length, huge))
        if huge:  # one call per buffer
            self.maps.append(weakref.ref(mm))
        if self.real:
            mm.madvise(mmap.MADV_HUGEPAGE if huge else mmap.MADV_NOHUGEPAGE, offset, length)


def _vma(addr: int) -> dict[str, str] | None:
    """This process's smaps entry of the mapping holding `addr` (its fields), None if none."""
    entry: dict[str, str] | None = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            if entry is not None:
                return entry
            entry = {} if lo <= addr < hi else None
        elif entry is not None:
            key, _, value = line.partition(":")
            entry[key] = value.strip()
    return entry


# ------------------------------------------------------------------------------ allocation
@pytest.mark.parametrize("n", [HUGE, 3 * HUGE + 5, (9 << 20) - 123, (38 << 20) + 17])
def test_a_fresh_large_buffer_is_2mib_aligned_and_advised_whole_huge_pages_only(n):
    advice = Advice()
    pool = PagePool(64 << 20, huge_pages=advice)
    b = pool.take(n)
    cls = size_class(n)
    assert b.fresh and b.tensor.numel() == n and b.whole.numel() == cls
    assert b.tensor.data_ptr() == b.whole.data_ptr()
    assert b.whole.data_ptr() % HUGE == 0 and b.whole.data_ptr() % PAGE == 0
    body = cls // HUGE * HUGE
    at, off, length, huge = advice.calls[0]
    assert (at + off, length, huge) == (b.whole.data_ptr(), body, True)
    if cls > body:  # the tail: 4 KiB pages, so the buffer never holds more than its class
        assert advice.calls[1:] == [(at, off + body, cls - body, False)]
    else:
        assert advice.calls[1:] == []
    assert pool.huge == 1
    b.whole.fill_(7)  # the whole buffer is writable memory
    assert int(b.whole.sum()) == 7 * cls


def test_small_pinned_and_arena_buffers_keep_their_allocation():
    advice = Advice()
    pool = PagePool(64 << 20, huge_pages=advice)
    small = pool.take(HUGE // 2 + 1)  # its class is under 2 MiB: no huge page to be had
    assert small.cls < HUGE
    assert small.tensor.data_ptr() % PAGE == 0 and advice.calls == [] and pool.huge == 0
    assert PagePool(64 << 20, pin_memory=True, huge_pages=advice).huge_pages is None
    arena = SlabArena(64 << 20, pin_memory=False, align=64)
    from_arena = PagePool(64 << 20, arena=arena, huge_pages=advice)
    b = from_arena.take(3 * HUGE)
    assert from_arena.huge_pages is None and advice.calls == [] and arena.used_bytes > 0
    assert b.tensor.data_ptr() % PAGE == 0 and b.release is not None


@pytest.mark.parametrize("fail", [OSError(errno.EINVAL, "Invalid argument"),
                                  ValueError("madvise unsupported")])
def test_refused_advice_falls_back_to_torch_allocation_for_good(fail):
    advice = Advice(fail=fail)
    pool = PagePool(64 << 20, huge_pages=advice)
    b = pool.take(3 * HUGE)
    assert b.fresh and b.tensor.numel() == 3 * HUGE and b.tensor.data_ptr() % PAGE == 0
    assert pool.huge_pages is None and pool.huge == 0
    b.tensor.fill_(1)
    assert int(b.tensor.sum()) == 3 * HUGE
    advice.fail = None
    pool.take(3 * HUGE)
    assert advice.calls == []  # never asked again


def test_no_advice_is_torch_allocation():
    pool = PagePool(64 << 20, huge_pages=None)
    b = pool.take(5 * HUGE)
    assert b.tensor.data_ptr() % PAGE == 0 and b.whole.numel() == size_class(5 * HUGE)
    assert pool.huge == 0


def test_the_thp_mode_decides_the_default_advice(tmp_path):
    f = tmp_path / "enabled"
    for text, mode in (("always [madvise] never\n", "madvise"),
                       ("[always] madvise never", "always"),
                       ("always madvise [never]\n", "never"), ("garbage", None)):
        f.write_text(text)
        assert thp_mode(f) == mode
    assert thp_mode(tmp_path / "absent") is None
    assert default_huge_advice("never") is None
    assert default_huge_advice("absent-mode") is None
    if hasattr(mmap, "MADV_HUGEPAGE"):
        assert default_huge_advice("madvise") is not None
        assert default_huge_advice("always") is not None
    assert (HUGE_PAGES is None) == (default_huge_advice() is None)


# ------------------------------------------------------------------ reuse, bound, release
def test_huge_buffers_are_reused_and_bounded_and_unmapped_when_let_go():
    advice = Advice()
    cls = size_class(3 * HUGE)
    pool = PagePool(2 * cls, huge_pages=advice)
    blocks = [pool.take(3 * HUGE) for _ in range(3)]
    addrs = [b.whole.data_ptr() for b in blocks]
    assert len(set(addrs)) == 3 and [m() is not None for m in advice.maps] == [True] * 3
    for b in blocks:
        pool.give(b)
    assert pool.idle_bytes == 2 * cls  # the oldest given back is released beyond the bound
    del blocks, b
    gc.collect()
    assert [m() is not None for m in advice.maps] == [False, True, True]  # released: unmapped
    if LINUX:
        assert _vma(addrs[0]) is None and _vma(addrs[1]) is not None
    again = pool.take(3 * HUGE - 1)
    assert not again.fresh and again.whole.data_ptr() == addrs[2]  # the newest idle
    assert (pool.taken, pool.reused, pool.huge) == (4, 1, 3)
    pool.clear()
    assert pool.idle_bytes == 0
    gc.collect()
    assert [m() is not None for m in advice.maps] == [False, False, True]  # `again` is in use
    view = again.tensor[PAGE:2 * PAGE]  # a link's part, say: it keeps the mapping alive
    del again
    gc.collect()
    assert advice.maps[2]() is not None
    view.fill_(3)
    del view
    gc.collect()
    assert advice.maps[2]() is None
    if LINUX:
        assert _vma(addrs[1]) is None and _vma(addrs[2]) is None


@pytest.mark.skipif(not LINUX or HUGE_PAGES is None, reason="needs THP madvise/always")
def test_the_kernel_marks_the_body_huge_and_the_tail_not():
    """With this host's real advice: the body's mapping carries the `hg` flag (MADV_HUGEPAGE)
    and the tail's `nh` (MADV_NOHUGEPAGE); bytes written are the bytes read."""
    advice = Advice(real=True)
    pool = PagePool(64 << 20, huge_pages=advice)
    b = pool.take((9 << 20) - 123)  # class 9 MiB: 8 MiB of huge pages and a 1 MiB tail
    at = b.whole.data_ptr()
    assert "hg" in _vma(at)["VmFlags"].split()
    assert "nh" in _vma(at + (8 << 20))["VmFlags"].split()
    src = torch.randint(0, 256, (b.tensor.numel(),), dtype=torch.uint8,
                        generator=torch.Generator().manual_seed(1))
    b.tensor.copy_(src)
    assert torch.equal(b.tensor, src)


# ------------------------------------------------------------------------------ reads
FP = b"h" * 32
BIG = StateLayout(  # ~2.6 MiB per link: staged links take huge-page buffers
    sections=(SectionSpec("gdn", (2, 330_001), "float32"), SectionSpec("conv", (3, 5), "bfloat16")),
    views=(ViewSpec("k", (37,), "float32"), ViewSpec("v", (5,), "float16")),
)
ROWS = 64


def _write_chain(folder: Path, links: int):
    return write_chain(folder, links, seed=3, layout=BIG, rows=ROWS, fp=FP)


def _store(huge_pages) -> LinkStore:
    store = LinkStore(BIG, pin_memory=False)
    store.pool = PagePool(64 << 20, huge_pages=huge_pages)
    return store


@pytest.mark.parametrize("direct", [False, True])
def test_a_chain_read_into_huge_buffers_lands_bit_for_bit_as_into_torch_buffers(tmp_path,
                                                                                direct):
    refs, paths, want = _write_chain(tmp_path, 3)
    advice = Advice(real=HUGE_PAGES is not None)
    huge, plain = _store(advice), _store(None)
    for store in (huge, plain):
        for _ in range(2):  # fresh buffers, then the same buffers reused
            assert stage_chain(store, refs, paths, FP, direct=direct) > 0
            for ref, w in zip(refs, want, strict=True):
                b = store.buffers(ref.link_id)
                got = {**b.sections, **b.views}
                assert got.keys() == w.keys()
                assert all(torch.equal(_u8(got[k]), _u8(w[k])) for k in w)
                if store is huge:
                    assert store.payload(ref.link_id).data_ptr() % HUGE == 0
            store.drop([r.link_id for r in refs])
    assert huge.pool.huge == 3 and plain.pool.huge == 0
    assert huge.pool.reused == 3 and plain.pool.reused == 3


def test_huge_buffers_are_verified_as_strictly(tmp_path):
    refs, paths, _ = _write_chain(tmp_path, 3)
    store = _store(Advice(real=HUGE_PAGES is not None))
    raw = bytearray(Path(paths[1]).read_bytes())
    raw[-100] ^= 0x40  # a byte of the payload's last part
    Path(paths[1]).write_bytes(raw)
    with pytest.raises(DiskReadError) as e:
        stage_chain(store, refs, paths, FP)
    assert e.value.problem == "checksum" and e.value.link_id == refs[1].link_id
    assert not any(store.has(r.link_id) for r in refs)
    Path(paths[1]).write_bytes(raw[:len(raw) // 2])
    with pytest.raises(DiskReadError) as e:
        stage_chain(store, refs, paths, FP)
    assert e.value.problem == "truncated" and e.value.link_id == refs[1].link_id
    assert store.pool.huge >= 1 and store.pool.idle_bytes > 0  # the buffers came back
    assert store.bytes_held == 0 and store.bytes_reserved == store.pool.idle_bytes
