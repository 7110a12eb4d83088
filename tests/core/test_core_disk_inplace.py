"""A disk hit's read into reused page-aligned buffers (slabs.PagePool, store page-aligned links,
core/linkformat/inplace.py): the pool reuses, aligns and stays bounded, concurrent readers never
share a buffer, a failed read hands its buffers back; one read per file lands every part where
the store looks for it, bit for bit, and is verified as strictly as the per-part reads (a
flipped byte, a file cut short, stale bytes of an earlier link in a reused buffer); direct I/O
is used where the file system takes it and a refusal falls back to the page cache, logged."""

from __future__ import annotations

import errno
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.keys import TEST_KEY
from vllm_hybridcache.core import LinkRef, LinkStore, SectionSpec, StateLayout, ViewSpec
from vllm_hybridcache.core.linkformat import inplace, reader
from vllm_hybridcache.core.linkformat.linkfile import (
    LinkFileError,
    LinkFileProblem,
    read_header,
    write_link_file,
)
from vllm_hybridcache.core.linkformat.reader import DiskReadError, stage_chain
from vllm_hybridcache.core.slabs import PAGE, PagePool, size_class

FP = b"p" * 32
# sizes that are no multiple of a page, so parts start at padded offsets and files end
# inside a page
LAYOUT = StateLayout(
    sections=(SectionSpec("gdn", (3, 1001), "float32"), SectionSpec("conv", (3, 5), "bfloat16")),
    views=(ViewSpec("k", (37,), "float32"), ViewSpec("v", (5,), "float16")),
)
ROWS = 96  # tokens per link


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _write_chain(folder: Path, links: int, seed: int = 0, order=None) -> tuple[
        list[LinkRef], list[str], list[dict[str, torch.Tensor]]]:
    """`links` link files of random bytes on one chain; their refs, paths and parts. `order`:
    the parts' order in the files (default: the store's, sections then views)."""
    g = torch.Generator().manual_seed(seed)
    src = LinkStore(LAYOUT, pin_memory=False)
    refs, paths, parts = [], [], []
    for i in range(links):
        s, e = i * ROWS, (i + 1) * ROWS
        bufs = src.allocate(i, LAYOUT.view_rows(s, e))
        p = {**bufs.sections, **bufs.views}
        for t in p.values():
            _u8(t)[:] = torch.randint(0, 256, (_u8(t).numel(),), generator=g, dtype=torch.uint8)
        if order is not None:
            p = {k: p[k] for k in order}
        path = folder / f"{seed}-{i}.link"
        write_link_file(path, fingerprint=FP, domain=b"d" * 32, digest=bytes([i]) * 16,
                        parent_digest=bytes([i - 1]) * 16 if i else b"", start=s, end=e,
                        tokens=np.arange(s, e), rows=LAYOUT.view_rows(s, e), parts=p, key=TEST_KEY)
        refs.append(LinkRef(100 + i, s, e))
        paths.append(str(path))
        parts.append({k: v.clone() for k, v in p.items()})
    return refs, paths, parts


def _staged_bytes() -> int:
    """Host bytes of one staged (page-aligned) link of ROWS rows: its pool buffer."""
    one = LinkStore(LAYOUT, pin_memory=False)
    one.allocate(0, ROWS, page_aligned=True)
    return one.bytes_held


def _held(store: LinkStore, ref: LinkRef) -> dict[str, torch.Tensor]:
    b = store.buffers(ref.link_id)
    return {**b.sections, **b.views}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(_u8(a[k]), _u8(b[k])) for k in a)


@pytest.fixture(autouse=True)
def _fresh_fallback_log(monkeypatch):
    monkeypatch.setattr(inplace, "DIRECT_FALLBACKS", {})


# ------------------------------------------------------------------------------ the pool
def test_size_classes_cover_the_request_in_whole_pages_wasting_at_most_an_eighth():
    for n in (1, PAGE - 1, PAGE, PAGE + 1, 9 * PAGE, 37 << 20, (38 << 20) + 123, 1 << 30):
        c = size_class(n)
        assert c >= n and c % PAGE == 0
        assert c - n < PAGE or c <= n * 9 // 8 + PAGE
    assert size_class(8 << 20) == size_class((8 << 20) - 5000)  # near sizes share a class


def test_the_pool_hands_out_page_aligned_buffers_and_reuses_them():
    pool = PagePool(64 << 20)
    seen = []
    for n in (1, 5000, PAGE * 3, (3 << 20) + 17):
        b = pool.take(n)
        assert b.tensor.data_ptr() % PAGE == 0 and b.tensor.numel() == n and b.fresh
        assert b.whole.numel() == size_class(n)
        seen.append(b)
    ptrs = {b.cls: b.tensor.data_ptr() for b in seen}
    for b in seen:
        pool.give(b)
    assert pool.idle_bytes == sum(b.cls for b in seen)
    again = pool.take((3 << 20) + 1)  # another size of the same class: the same memory
    assert not again.fresh and again.tensor.data_ptr() == ptrs[again.cls]
    assert again.tensor.numel() == (3 << 20) + 1
    assert pool.idle_bytes == sum(b.cls for b in seen) - again.cls
    assert (pool.taken, pool.reused) == (5, 1)
    with pytest.raises(RuntimeError, match="twice"):
        pool.give(seen[0])  # still idle: a second give would hand it out twice


def test_the_pool_keeps_at_most_its_bound_idle_oldest_released_first():
    cls = size_class(1 << 20)
    pool = PagePool(3 * cls)
    blocks = [pool.take(1 << 20) for _ in range(5)]
    for b in blocks:
        pool.give(b)
        assert pool.idle_bytes <= 3 * cls
    assert pool.idle_bytes == 3 * cls
    kept = {pool.take(1 << 20).tensor.data_ptr() for _ in range(3)}
    assert kept == {b.tensor.data_ptr() for b in blocks[2:]}  # the newest three
    assert pool.take(1 << 20).fresh
    big = PagePool(cls // 2)  # a buffer larger than the bound is never kept
    big.give(big.take(1 << 20))
    assert big.idle_bytes == 0 and big.take(1 << 20).fresh



def _run_threads(worker, n: int, errors: list[str]) -> None:
    """Runs worker(0..n-1) on n threads and waits; a thread's exception becomes an entry of
    `errors` (so it fails the test instead of vanishing with its thread)."""
    def guarded(k: int) -> None:
        try:
            worker(k)
        except Exception as e:
            errors.append(f"thread {k}: {e!r}")

    threads = [threading.Thread(target=guarded, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

def test_concurrent_takers_never_share_a_buffer():
    pool = PagePool(8 << 20)
    errors: list[str] = []
    start = threading.Barrier(4)

    def worker(k: int) -> None:
        start.wait()
        for i in range(200):
            b = pool.take((1 << 16) * (1 + (i + k) % 3))
            b.tensor.fill_(k)
            os.sched_yield()
            if not bool((b.tensor == k).all()):
                errors.append(f"thread {k}: its buffer was written by another taker")
            pool.give(b)

    _run_threads(worker, 4, errors)
    assert not errors
    assert pool.reused > 0 and pool.idle_bytes <= 8 << 20


def test_concurrent_readers_each_get_their_own_files_bytes(tmp_path):
    """Four threads stage four chains into four stores sharing one pool, over and over: every
    staged link holds its own file's bytes."""
    pool = PagePool(32 << 20)
    chains = [_write_chain(tmp_path, 2, seed=s) for s in range(4)]
    errors: list[str] = []

    def worker(k: int) -> None:
        store = LinkStore(LAYOUT, pin_memory=False)
        store.pool = pool
        refs, paths, want = chains[k]
        for _ in range(15):
            stage_chain(store, refs, paths, FP, key=TEST_KEY)
            for ref, w in zip(refs, want, strict=True):
                if not _equal(_held(store, ref), w):
                    errors.append(f"reader {k}: link {ref.link_id} holds other bytes")
            store.drop([r.link_id for r in refs])

    _run_threads(worker, 4, errors)
    assert not errors
    assert pool.reused > 0


# ------------------------------------------------------------------------------ the store
def test_a_page_aligned_link_is_laid_out_as_its_file_and_restores_like_any_link(tmp_path):
    refs, paths, want = _write_chain(tmp_path, 2)
    store = LinkStore(LAYOUT, pin_memory=False)
    stage_chain(store, refs, paths, FP, key=TEST_KEY)
    header, _ = read_header(Path(paths[1]), FP, TEST_KEY)
    whole = store.payload(refs[1].link_id)
    assert whole.data_ptr() % PAGE == 0 and whole.numel() % PAGE == 0
    held = _held(store, refs[1])
    for e in header.parts:  # every part where the file puts it
        assert held[e.name].data_ptr() - whole.data_ptr() == e.offset
    # a chain mixing a captured (64-byte aligned) link and a staged one restores both
    ram = LinkStore(LAYOUT, pin_memory=False)
    bufs = ram.allocate(refs[0].link_id, ROWS)
    for k, t in {**bufs.sections, **bufs.views}.items():
        _u8(t)[:] = _u8(want[0][k])
    ram.seal(refs[0].link_id)
    staged = ram.allocate(refs[1].link_id, ROWS, page_aligned=True)
    for k, t in {**staged.sections, **staged.views}.items():
        _u8(t)[:] = _u8(want[1][k])
    ram.seal(refs[1].link_id)
    for s in (store, ram):
        secs = {x.name: torch.zeros(x.shape, dtype=getattr(torch, x.dtype))
                for x in LAYOUT.sections}
        views = {v.name: torch.zeros(2 * ROWS, *v.row_shape, dtype=getattr(torch, v.dtype))
                 for v in LAYOUT.views}
        s.restore(refs, secs, lambda *a: None)
        s.restore_views_into(refs, views)
        for name in secs:
            assert torch.equal(_u8(secs[name]), _u8(want[1][name]))
        for name in views:
            assert torch.equal(_u8(views[name][:ROWS]), _u8(want[0][name]))
            assert torch.equal(_u8(views[name][ROWS:]), _u8(want[1][name]))
    # dropped: the buffers go back to the pool, counted as reserved while idle
    held_before = store.bytes_held
    assert store.drop([r.link_id for r in refs]) == held_before
    assert store.bytes_held == 0 and store.pool.idle_bytes == held_before
    assert store.bytes_reserved == held_before
    stage_chain(store, refs, paths, FP, key=TEST_KEY)
    assert store.pool.reused == 2 and store.pool.idle_bytes == 0


# ------------------------------------------------------------------------------ the read
def test_one_read_per_file_lands_every_part_bit_for_bit(tmp_path, monkeypatch):
    refs, paths, want = _write_chain(tmp_path, 3)
    assert all(os.stat(p).st_size % PAGE for p in paths)  # files end inside a page
    reads: list[int] = []
    real = os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, at: reads.append(at) or real(fd, bufs, at))
    store = LinkStore(LAYOUT, pin_memory=False)
    assert stage_chain(store, refs, paths, FP, key=TEST_KEY) == sum(
        sum(t.numel() * t.element_size() for t in w.values()) for w in want)
    assert len(reads) == len(paths)  # one request per file
    for ref, w in zip(refs, want, strict=True):
        assert _equal(_held(store, ref), w)


def test_a_file_with_another_part_order_is_read_part_by_part(tmp_path, monkeypatch):
    refs, paths, want = _write_chain(tmp_path, 2, order=["v", "conv", "k", "gdn"])
    calls = []
    real = reader.read_verified
    monkeypatch.setattr(reader, "read_verified", lambda *a, **k: calls.append(1) or real(*a, **k))
    store = LinkStore(LAYOUT, pin_memory=False)
    stage_chain(store, refs, paths, FP, key=TEST_KEY)
    assert len(calls) == 2
    for ref, w in zip(refs, want, strict=True):
        assert _equal(_held(store, ref), {k: w[k] for k in _held(store, ref)})


@pytest.mark.parametrize("part", ["gdn", "conv", "k", "v"])
@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "direct"])
def test_a_flipped_byte_in_any_part_is_a_checksum_miss(tmp_path, part, direct):
    """In the middle file of three: its CRCs are checked while the next file is read, and the
    miss is charged to its link, not to the one read last."""
    refs, paths, _ = _write_chain(tmp_path, 3)
    path = Path(paths[1])
    header, base = read_header(path, FP, TEST_KEY)
    e = next(x for x in header.parts if x.name == part)
    raw = bytearray(path.read_bytes())
    raw[base + e.offset + e.nbytes - 1] ^= 0x01
    path.write_bytes(bytes(raw))
    store = LinkStore(LAYOUT, pin_memory=False)
    with pytest.raises(DiskReadError) as ex:
        stage_chain(store, refs, paths, FP, direct, key=TEST_KEY)
    assert ex.value.problem == "checksum" and ex.value.link_id == refs[1].link_id
    assert len(store) == 0 and store.bytes_held == 0
    assert store.pool.idle_bytes == 3 * _staged_bytes()  # every buffer back in the pool


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "direct"])
@pytest.mark.parametrize("cut", [1, PAGE - 1, PAGE + 1, 9000])
def test_a_file_cut_short_is_refused_even_over_stale_bytes_of_the_same_link(
        tmp_path, cut, direct):
    """The reused buffer still holds every byte an earlier read of the same file left there,
    so every CRC would pass over it: the read of the cut file must see it came up short."""
    refs, paths, _ = _write_chain(tmp_path, 1)
    path = Path(paths[0])
    header, base = read_header(path, FP, TEST_KEY)
    store = LinkStore(LAYOUT, pin_memory=False)
    stage_chain(store, refs, paths, FP, direct, key=TEST_KEY)
    store.drop([refs[0].link_id])
    os.truncate(path, path.stat().st_size - cut)  # cut after the lookup read its header
    bufs = store.allocate(refs[0].link_id, ROWS, page_aligned=True)
    assert store.pool.reused == 1  # the same buffer, the old payload in it
    buf = store.payload(refs[0].link_id)
    assert inplace.fits_in_place(header, buf, {**bufs.sections, **bufs.views})
    with pytest.raises(LinkFileError) as ex:
        inplace.read_in_place(path, header, base, buf, direct, key=TEST_KEY)
    assert ex.value.problem is LinkFileProblem.TRUNCATED
    store.drop([refs[0].link_id])
    with pytest.raises(DiskReadError) as ex2:  # and end to end: a counted miss
        stage_chain(store, refs, paths, FP, direct, key=TEST_KEY)
    assert ex2.value.problem == "truncated" and len(store) == 0


def test_a_fault_mid_read_fails_the_chain_and_returns_every_buffer(tmp_path, monkeypatch):
    refs, paths, _ = _write_chain(tmp_path, 3)
    store = LinkStore(LAYOUT, pin_memory=False)
    real = os.preadv

    def failing(fd, bufs, at):
        if os.readlink(f"/proc/self/fd/{fd}") == paths[1]:  # the second file's read
            raise OSError(errno.EIO, "I/O error")
        return real(fd, bufs, at)

    monkeypatch.setattr(os, "preadv", failing)
    with pytest.raises(DiskReadError) as ex:
        stage_chain(store, refs, paths, FP, direct=True, key=TEST_KEY)
    assert ex.value.problem == "io_error" and ex.value.link_id == refs[1].link_id
    assert len(store) == 0 and store.bytes_held == 0
    assert store.pool.idle_bytes == 3 * _staged_bytes()  # every staged buffer back
    monkeypatch.setattr(os, "preadv", real)
    stage_chain(store, refs, paths, FP, direct=True, key=TEST_KEY)  # every buffer reused
    assert store.pool.reused == 3


# ------------------------------------------------------------------------------ direct I/O
def _takes_direct_io(folder: Path) -> bool:
    probe = folder / "probe"
    probe.write_bytes(b"x" * PAGE)
    try:
        os.close(os.open(probe, os.O_RDONLY | getattr(os, "O_DIRECT", 0)))
        return hasattr(os, "O_DIRECT")
    except OSError:
        return False
    finally:
        probe.unlink()


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "direct"])
def test_direct_io_is_asked_for_exactly_when_the_setting_says(tmp_path, monkeypatch, direct):
    if direct and not _takes_direct_io(tmp_path):
        # e.g. tmpfs: O_DIRECT is refused at open, so the direct arm cannot be observed here;
        # the refusal itself (fallback to the page cache) is the next test's subject
        pytest.skip(f"{tmp_path} does not take direct I/O")
    refs, paths, want = _write_chain(tmp_path, 2)
    flags: list[int] = []
    real = os.open
    monkeypatch.setattr(os, "open",
                        lambda p, f, *a, **k: flags.append(f) or real(p, f, *a, **k))
    store = LinkStore(LAYOUT, pin_memory=False)
    stage_chain(store, refs, paths, FP, direct, key=TEST_KEY)
    payload_opens = [f for f in flags if f & os.O_DIRECT]
    assert len(payload_opens) == (len(paths) if direct else 0)
    assert inplace.DIRECT_FALLBACKS == {}
    for ref, w in zip(refs, want, strict=True):
        assert _equal(_held(store, ref), w)


@pytest.mark.parametrize("where", ["open", "read"])
def test_a_refusal_of_direct_io_falls_back_to_the_page_cache_logged_once(
        tmp_path, monkeypatch, caplog, where):
    """EINVAL for O_DIRECT (as tmpfs answers at open; some file systems at the read) reads the
    file through the page cache: the same bytes, verified the same, the reason logged once."""
    refs, paths, want = _write_chain(tmp_path, 2)
    real_open, real_read = os.open, os.preadv
    direct_fds: set[int] = set()

    def fake_open(p, f, *a, **k):
        if f & getattr(os, "O_DIRECT", 0) and where == "open":
            raise OSError(errno.EINVAL, "Invalid argument")
        fd = real_open(p, f, *a, **k)
        if f & getattr(os, "O_DIRECT", 0):
            direct_fds.add(fd)
        else:
            direct_fds.discard(fd)  # a number an earlier direct open had
        return fd

    def fake_read(fd, bufs, at):
        if fd in direct_fds:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_read(fd, bufs, at)

    monkeypatch.setattr(inplace, "_O_DIRECT", inplace._O_DIRECT or 0x4000)
    monkeypatch.setattr(os, "open", fake_open)
    monkeypatch.setattr(os, "preadv", fake_read)
    store = LinkStore(LAYOUT, pin_memory=False)
    with caplog.at_level(logging.WARNING, logger="vllm_hybridcache"):
        stage_chain(store, refs, paths, FP, direct=True, key=TEST_KEY)
    for ref, w in zip(refs, want, strict=True):
        assert _equal(_held(store, ref), w)
    notes = [r for r in caplog.records if "direct I/O unavailable" in r.getMessage()]
    assert len(notes) == 1 and f"{where} with O_DIRECT" in notes[0].getMessage()
    assert list(inplace.DIRECT_FALLBACKS.values()) == [f"{where} with O_DIRECT: "
                                                       f"{os.strerror(errno.EINVAL)}"]
    # the fallback verifies as strictly: a flipped byte is still a checksum miss
    store.drop([r.link_id for r in refs])
    path = Path(paths[0])
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0x80
    path.write_bytes(bytes(raw))
    with pytest.raises(DiskReadError) as ex:
        stage_chain(store, refs, paths, FP, direct=True, key=TEST_KEY)
    assert ex.value.problem == "checksum" and len(store) == 0


@pytest.mark.parametrize("helpers", ["running", "busy"])
def test_a_chain_failing_in_two_files_is_charged_to_the_first(tmp_path, monkeypatch, helpers):
    """The second file is still being read and checked on a helper thread (`busy`: its read
    has not even started) when the fourth file's header is refused on the caller's: the miss
    names the second (the scheduler then deletes it and every longer link), and every buffer
    is back in the pool."""
    if helpers == "busy":
        gate = threading.Event()
        pool = ThreadPoolExecutor(1)
        pool.submit(gate.wait)  # the helper is busy until the chain has failed on the caller
        monkeypatch.setattr(reader, "helper", lambda: pool)
        settle = reader._settle
        monkeypatch.setattr(reader, "_settle", lambda *a: gate.set() or settle(*a))
    refs, paths, _ = _write_chain(tmp_path, 4)
    p1 = Path(paths[1])
    raw = bytearray(p1.read_bytes())
    raw[-1] ^= 0x01  # the last byte of its last part
    p1.write_bytes(bytes(raw))
    p3 = Path(paths[3])
    raw = bytearray(p3.read_bytes())
    raw[20] ^= 0x01  # inside its header
    p3.write_bytes(bytes(raw))
    store = LinkStore(LAYOUT, pin_memory=False)
    with pytest.raises(DiskReadError) as ex:
        stage_chain(store, refs, paths, FP, direct=True, key=TEST_KEY)
    assert ex.value.link_id == refs[1].link_id and ex.value.problem == "checksum"
    assert len(store) == 0 and store.pool.idle_bytes == 3 * _staged_bytes()


def test_a_slab_store_carves_staged_links_out_of_its_slabs_and_gets_them_back(tmp_path):
    """A pinned store (here the same code unpinned) takes staged links' buffers from its slabs
    (torch's pinned allocator would round each up to a power of two); the pool's bound hands
    them back to the arena, and a clear leaves nothing behind."""
    refs, paths, want = _write_chain(tmp_path, 3)
    one = _staged_bytes()
    store = LinkStore(LAYOUT, pin_memory=False, slab_bytes=1 << 20, pool_bytes=2 * one)
    arena = store._arena
    stage_chain(store, refs, paths, FP, key=TEST_KEY)
    assert arena.slabs == 1 and arena.used_bytes == 3 * (one + PAGE)
    for ref, w in zip(refs, want, strict=True):
        whole = store.payload(ref.link_id)
        assert whole.data_ptr() % PAGE == 0 and _equal(_held(store, ref), w)
    assert store.bytes_reserved == 1 << 20
    store.drop([r.link_id for r in refs])  # two kept idle (the bound), one back to the arena
    assert store.pool.idle_bytes == 2 * one and arena.used_bytes == 2 * (one + PAGE)
    stage_chain(store, refs, paths, FP, key=TEST_KEY)
    assert store.pool.reused == 2 and arena.used_bytes == 3 * (one + PAGE)
    store.drop([r.link_id for r in refs])
    store.clear()
    assert store.pool.idle_bytes == 0 and arena.slabs == 0 and store.bytes_reserved == 0


def test_prewarm_fills_the_pool_with_touched_buffers_of_the_wanted_classes():
    """PagePool.prewarm: one idle buffer per wanted size, in that size's class, within the
    idle bound (a size that would exceed it is passed over, a later one that fits is not);
    a later take of such a size reuses one (no fresh pages during the read)."""
    small, big = 5000, 3 << 20
    pool = PagePool(2 * size_class(big) + size_class(small))
    got = pool.prewarm([big, big, big, small])
    assert got == 2 * size_class(big) + size_class(small) == pool.warmed == pool.idle_bytes
    b = pool.take(big)
    assert not b.fresh and pool.reused == 1 and b.tensor.data_ptr() % PAGE == 0
    assert int(b.whole.max()) == 0  # touched by writing zeros
    s = pool.take(small)
    assert not s.fresh and pool.reused == 2
    assert pool.take(big).fresh is False and pool.take(big).fresh  # two warmed, then fresh


def test_prewarm_stops_when_asked_and_leaves_arenas_alone():
    import threading

    from vllm_hybridcache.core.slabs import SlabArena

    stop = threading.Event()
    stop.set()
    pool = PagePool(64 << 20)
    assert pool.prewarm([1 << 20] * 4, stop) == 0 and pool.idle_bytes == 0
    carved = PagePool(64 << 20, arena=SlabArena(8 << 20, False))
    assert carved.prewarm([1 << 20] * 4) == 0 and carved.idle_bytes == 0


# ----------------------------------------------------------------- sections read later
def _restored(store: LinkStore, refs: list[LinkRef]) -> dict[str, torch.Tensor]:
    secs = {x.name: torch.zeros(x.shape, dtype=getattr(torch, x.dtype)) for x in LAYOUT.sections}
    views = {v.name: torch.zeros(len(refs) * ROWS, *v.row_shape, dtype=getattr(torch, v.dtype))
             for v in LAYOUT.views}
    store.restore(refs, secs, lambda *a: None)
    store.restore_views_into(refs, views)
    return {**secs, **views}


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "direct"])
def test_deferred_sections_restore_the_same_bits_and_are_read_when_first_needed(
        tmp_path, monkeypatch, direct):
    """`defer_sections`: every link but the deepest is staged with its views only (one
    request each, the byte range after its sections); the restore of the chain equals the
    restore of the whole files; a link's sections are read (one more request) and checked
    when they are first asked for, once, and then equal the file's."""
    refs, paths, want = _write_chain(tmp_path, 3)
    whole = LinkStore(LAYOUT, pin_memory=False)
    stage_chain(whole, refs, paths, FP, direct, key=TEST_KEY)
    reads: list[int] = []
    real = os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, at: reads.append(at) or real(fd, bufs, at))
    lazy = LinkStore(LAYOUT, pin_memory=False)
    for ref in refs:  # stale bytes where the sections will go: a buffer reused from the pool
        lazy.allocate(ref.link_id, ROWS, page_aligned=True)
        lazy.payload(ref.link_id).fill_(0xEE)
    lazy.drop([r.link_id for r in refs])
    got = stage_chain(lazy, refs, paths, FP, direct, defer_sections=True, key=TEST_KEY)
    secs = sum(x.nbytes for x in LAYOUT.sections)
    assert got == sum(sum(t.numel() * t.element_size() for t in w.values()) for w in want) \
        - 2 * secs
    assert len(reads) == 3
    assert [lazy.sections_pending(r.link_id) for r in refs] == [True, True, False]
    assert _equal(_restored(lazy, refs), _restored(whole, refs))
    assert len(reads) == 3  # the restore read no section of the links before the deepest
    assert _equal(_held(lazy, refs[0]), want[0])  # read now, whole
    assert len(reads) == 4 and not lazy.sections_pending(refs[0].link_id)
    _held(lazy, refs[0])
    assert len(reads) == 4  # once
    # a restore that ends at a link with deferred sections reads them first
    assert _equal(_restored(lazy, refs[:2]), _restored(whole, refs[:2]))
    assert len(reads) == 5 and not lazy.sections_pending(refs[1].link_id)


@pytest.mark.parametrize("part", ["gdn", "conv"])
def test_a_deferred_section_that_fails_its_checksum_is_never_handed_out(tmp_path, part):
    """The hit itself does not read the middle link's sections, so a flipped byte there does
    not fail it; when they are first needed the check fails: MissingLinkError naming the link,
    which stays unusable (no restore ends at it) until dropped. A flipped view byte of the
    same link still fails the hit."""
    from vllm_hybridcache.core import MissingLinkError

    refs, paths, _ = _write_chain(tmp_path, 3)
    path = Path(paths[1])
    header, base = read_header(path, FP, TEST_KEY)
    e = next(x for x in header.parts if x.name == part)
    raw = bytearray(path.read_bytes())
    raw[base + e.offset] ^= 0x01
    path.write_bytes(bytes(raw))
    store = LinkStore(LAYOUT, pin_memory=False)
    stage_chain(store, refs, paths, FP, defer_sections=True, key=TEST_KEY)
    _restored(store, refs)  # the deepest link's state and every row: all checked
    for _ in range(2):
        with pytest.raises(MissingLinkError) as ex:
            store.buffers(refs[1].link_id)
        assert ex.value.link_id == refs[1].link_id
    with pytest.raises(MissingLinkError):
        _restored(store, refs[:2])
    store.drop([r.link_id for r in refs])
    raw[base + e.offset] ^= 0x01  # mended; now a view byte is flipped
    k = next(x for x in header.parts if x.name == "k")
    raw[base + k.offset] ^= 0x01
    path.write_bytes(bytes(raw))
    with pytest.raises(DiskReadError) as err:
        stage_chain(store, refs, paths, FP, defer_sections=True, key=TEST_KEY)
    assert err.value.problem == "checksum" and err.value.link_id == refs[1].link_id


def test_sections_are_read_now_where_a_file_puts_them_after_its_views(tmp_path):
    refs, paths, want = _write_chain(tmp_path, 2, order=["k", "v", "gdn", "conv"])
    header, _ = read_header(Path(paths[0]), FP, TEST_KEY)
    assert inplace.split_point(header, {"gdn", "conv"}) is None
    store = LinkStore(LAYOUT, pin_memory=False)
    stage_chain(store, refs, paths, FP, defer_sections=True, key=TEST_KEY)
    assert not store.sections_pending(refs[0].link_id)
    assert _equal(_held(store, refs[0]), {k: want[0][k] for k in _held(store, refs[0])})
