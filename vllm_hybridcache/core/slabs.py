"""SlabArena: link buffers carved out of large host slabs.

Why: torch's pinned host allocator rounds every block up to a power of two and caches freed
blocks, so a 38 MiB link would hold a 64 MiB pinned block. Allocating pinned memory in large
power-of-two slabs (no rounding loss) and sub-allocating link buffers from them keeps the pinned
footprint close to the payload. First fit over an offset-sorted free list with coalescing; a
link larger than a slab gets its own allocation. Empty slabs beyond `keep_free` are released.

A range is reused as soon as it is freed: nothing may still read or write a block (an
asynchronous device copy included) when it is freed. The tree never drops a link that an active
restore uses, and a capture's copy completes before its step ends, before any drop can arrive.

Not thread-safe: owned by one LinkStore, called from one thread.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

__all__ = ["Block", "SlabArena"]


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
