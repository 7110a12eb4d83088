"""Host buffers for the link store: SlabArena (links carved out of large slabs) and PagePool
(reused page-aligned buffers for links read from disk).

Why: torch's pinned host allocator rounds every block up to a power of two and caches freed
blocks, so a 38 MiB link would hold a 64 MiB pinned block. Allocating pinned memory in large
power-of-two slabs (no rounding loss) and sub-allocating link buffers from them keeps the pinned
footprint close to the payload. First fit over an offset-sorted free list with coalescing; a
link larger than a slab gets its own allocation. Empty slabs beyond `keep_free` are released.

A range is reused as soon as it is freed: nothing may still read or write a block (an
asynchronous device copy included) when it is freed. The tree never drops a link that an active
restore uses, and a capture's copy completes before its step ends, before any drop can arrive.

SlabArena is not thread-safe: owned by one LinkStore, called from one thread. PagePool (at
the end of this module) takes a lock.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

__all__ = ["PAGE", "Block", "PageBlock", "PagePool", "SlabArena", "size_class"]


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


class _Slab:
    __slots__ = ("buf", "free_offs", "free_sizes", "live", "size", "used")

    def __init__(self, size: int, pin_memory: bool) -> None:
        self.buf = torch.empty(size, dtype=torch.uint8, pin_memory=pin_memory)
        self.size = size
        self.used = 0
        self.free_offs: list[int] = [0]  # sorted, disjoint, never adjacent (coalesced)
        self.free_sizes: list[int] = [size]
        self.live: dict[int, int] = {}  # offset -> size of every block handed out

    def take(self, n: int) -> int | None:
        """First fit: the offset of n bytes, or None."""
        for i, sz in enumerate(self.free_sizes):
            if sz >= n:
                off = self.free_offs[i]
                if sz == n:
                    del self.free_offs[i]
                    del self.free_sizes[i]
                else:
                    self.free_offs[i] = off + n
                    self.free_sizes[i] = sz - n
                self.used += n
                self.live[off] = n
                return off
        return None

    def give(self, off: int, n: int) -> None:
        if self.live.get(off) != n:
            raise RuntimeError(f"double free or foreign block at offset {off} (+{n})")
        del self.live[off]
        offs, sizes = self.free_offs, self.free_sizes
        i = bisect.bisect_left(offs, off)
        overlap_prev = i > 0 and offs[i - 1] + sizes[i - 1] > off
        overlap_next = i < len(offs) and off + n > offs[i]
        if overlap_prev or overlap_next:
            raise RuntimeError(f"double free or overlap at offset {off} (+{n})")
        merge_prev = i > 0 and offs[i - 1] + sizes[i - 1] == off
        merge_next = i < len(offs) and off + n == offs[i]
        if merge_prev and merge_next:
            sizes[i - 1] += n + sizes[i]
            del offs[i]
            del sizes[i]
        elif merge_prev:
            sizes[i - 1] += n
        elif merge_next:
            offs[i] = off
            sizes[i] += n
        else:
            offs.insert(i, off)
            sizes.insert(i, n)
        self.used -= n


@dataclass(eq=False)
class Block:
    """One allocation: `tensor` is a uint8 view of `size` bytes (slab is None when dedicated)."""

    tensor: torch.Tensor
    size: int
    slab: _Slab | None
    offset: int
    reserved: int  # bytes taken from the slab (aligned) or held by the dedicated allocation


class SlabArena:
    """Sub-allocator over host slabs of `slab_bytes` (pinned when `pin_memory`)."""

    def __init__(
        self, slab_bytes: int, pin_memory: bool, align: int = 64, keep_free: int = 1
    ) -> None:
        if slab_bytes <= 0 or slab_bytes % align:
            raise ValueError("slab_bytes must be a positive multiple of the alignment")
        self.slab_bytes = slab_bytes
        self.pin_memory = pin_memory
        self.align = align
        self.keep_free = keep_free
        self._slabs: list[_Slab] = []
        self._dedicated = 0

    def alloc(self, n: int) -> Block:
        n = max(n, 1)
        need = _align(n, self.align)
        if need > self.slab_bytes:
            t = torch.empty(n, dtype=torch.uint8, pin_memory=self.pin_memory)
            self._dedicated += n
            return Block(t, n, None, 0, n)
        for slab in self._slabs:
            off = slab.take(need)
            if off is not None:
                return Block(slab.buf[off : off + n], n, slab, off, need)
        slab = _Slab(self.slab_bytes, self.pin_memory)
        self._slabs.append(slab)
        off = slab.take(need)
        assert off == 0
        return Block(slab.buf[:n], n, slab, 0, need)

    def free(self, block: Block) -> None:
        slab = block.slab
        if slab is None:
            self._dedicated -= block.reserved
            return
        slab.give(block.offset, block.reserved)
        if slab.used == 0:
            empty = [s for s in self._slabs if s.used == 0]
            if len(empty) > self.keep_free:
                self._slabs.remove(slab)

    def clear(self) -> None:
        """Forget every slab (callers must hold no Block any more)."""
        self._slabs.clear()
        self._dedicated = 0

    @property
    def reserved_bytes(self) -> int:
        """Host bytes this arena holds: all slabs plus dedicated allocations."""
        return len(self._slabs) * self.slab_bytes + self._dedicated

    @property
    def used_bytes(self) -> int:
        return sum(s.used for s in self._slabs) + self._dedicated

    @property
    def slabs(self) -> int:
        return len(self._slabs)


PAGE = 4096  # the page size direct I/O and the link file format align to


def size_class(n: int) -> int:
    """The pool class of an `n`-byte request: pages, rounded up to one of eight steps per
    power of two (at most 1/8 of a buffer wasted), so links of nearly one size share buffers."""
    pages = max(1, -(-n // PAGE))
    if pages <= 8:
        return pages * PAGE
    step = 1 << (pages.bit_length() - 4)  # 8 steps between 2^k and 2^(k+1) pages
    return -(-pages // step) * step * PAGE


@dataclass(eq=False)
class PageBlock:
    """A page-aligned buffer from a PagePool: `tensor` is a uint8 view of `size` bytes starting
    on a page boundary; `cls` its size class (the bytes it holds)."""

    tensor: torch.Tensor
    size: int
    cls: int
    whole: torch.Tensor  # the page-aligned `cls` bytes `tensor` starts (what is reused)
    fresh: bool  # allocated for this take (its pages not yet touched), not reused
    release: Callable[[], None] | None = None  # hands the memory back to where it came from


class PagePool:
    """Reused, page-aligned host buffers for a disk hit's read, kept by size class.

    Why: a disk hit reads each link file straight into the link's store buffer with one direct
    read, which needs the buffer page-aligned; and memory already mapped is what makes that read
    fast (a fresh buffer's pages are zeroed and faulted in during the read: on the CI VM that
    cost more than the copy it saves; docs/benchmarks/disk.md). So the buffers of staged links
    come from here and come back here when the store drops them, and `prewarm` fills the pool
    ahead of a restarted worker's first reads. Bounded: at most `max_idle`
    bytes wait idle (the oldest given back go first beyond that); buffers in use are the
    store's (its byte budget counts them). Thread-safe (one lock): readers on several threads
    may share one pool.

    Where fresh buffers come from: `arena` (a pinned store's SlabArena: torch's pinned
    allocator would round each buffer up to a power of two) when given, else one host
    allocation each; either way one page more than the class, so a page boundary lies inside.
    A buffer released beyond the bound goes back to the arena (which is then called from the
    pool's callers' thread: the store's).
    """

    def __init__(self, max_idle: int, pin_memory: bool = False,
                 arena: SlabArena | None = None) -> None:
        if max_idle < 0:
            raise ValueError("max_idle must be >= 0")
        self.max_idle = max_idle
        self.pin_memory = pin_memory
        self.arena = arena
        self._lock = threading.Lock()
        self._free: dict[int, list[PageBlock]] = {}
        self._order: list[PageBlock] = []  # idle blocks, oldest given back first
        self._idle = 0
        self.taken = 0  # blocks handed out (reused or fresh): counters for stats and tests
        self.reused = 0
        self.warmed = 0  # bytes `prewarm` added

    def take(self, n: int) -> PageBlock:
        """A page-aligned buffer of at least `n` bytes (`tensor` has exactly `n`): an idle one
        of its size class if any, else a fresh allocation."""
        cls = size_class(n)
        with self._lock:
            self.taken += 1
            free = self._free.get(cls)
            if free:
                b = free.pop()
                self._order.remove(b)
                self._idle -= cls
                self.reused += 1
                return PageBlock(b.whole[:n], n, cls, b.whole, False, b.release)
        return self._fresh(n, cls)

    def _fresh(self, n: int, cls: int) -> PageBlock:
        release = None
        if self.arena is not None:
            block = self.arena.alloc(cls + PAGE)
            backing = block.tensor
            release = lambda a=self.arena, blk=block: a.free(blk)  # noqa: E731
        else:
            backing = torch.empty(cls + PAGE, dtype=torch.uint8, pin_memory=self.pin_memory)
        off = -backing.data_ptr() % PAGE
        whole = backing[off:off + cls]
        return PageBlock(whole[:n], n, cls, whole, True, release)

    def prewarm(self, sizes: Iterable[int], stop: threading.Event | None = None) -> int:
        """Fill the pool ahead of the reads that will want it: for each request size in
        `sizes` (the most wanted first), a fresh buffer of its class with every page touched,
        kept idle, as long as the idle buffers stay within `max_idle` bytes (a size that would
        exceed it is passed over). Stops early when `stop` is set. Returns the bytes warmed
        (also added to `warmed`).

        Why: a buffer's first use pays for faulting in its pages, which on a VM costs more
        than the read that fills it (a restarted server's first disk hits of a 16K chain spent
        0.13-0.19 s staging into fresh buffers against 0.04 s into reused ones,
        docs/benchmarks/disk.md), and the first hits after a restart are the ones the tier is
        for. Meant for a background thread: the pool is locked, the pages are touched outside
        the lock. A pool carving its buffers out of an arena (a pinned store's) or allocating
        pinned memory warms nothing: the arena is not thread-safe, and pinned memory is
        faulted in when it is allocated."""
        if self.arena is not None or self.pin_memory:
            return 0
        done = 0
        for n in sizes:
            if stop is not None and stop.is_set():
                break
            cls = size_class(n)
            with self._lock:
                if self._idle + cls > self.max_idle:
                    continue
            b = self._fresh(cls, cls)
            b.whole.numpy().fill(0)  # every page faulted in here, not during a read
            self.give(b)
            done += cls
        with self._lock:
            self.warmed += done
        return done

    def _release(self, b: PageBlock) -> None:
        if b.release is not None:
            b.release()

    def give(self, b: PageBlock) -> None:
        """Hand a buffer back (nothing may read or write it any more): kept idle for the next
        take of its class, the oldest idle buffers released beyond `max_idle` bytes."""
        if b.cls > self.max_idle:
            self._release(b)
            return
        with self._lock:
            if any(x is b for x in self._order):
                raise RuntimeError("a pool buffer given back twice")
            self._free.setdefault(b.cls, []).append(b)
            self._order.append(b)
            self._idle += b.cls
            while self._idle > self.max_idle:
                old = self._order.pop(0)
                self._free[old.cls].remove(old)
                self._idle -= old.cls
                self._release(old)

    def clear(self) -> None:
        """Release every idle buffer."""
        with self._lock:
            for b in self._order:
                self._release(b)
            self._free.clear()
            self._order.clear()
            self._idle = 0

    @property
    def idle_bytes(self) -> int:
        """Host bytes held by idle buffers (what the pool keeps beyond the store's links)."""
        return self._idle
