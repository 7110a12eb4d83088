"""Ask the kernel for huge pages under buffers a disk read is about to fill.

Why: a disk hit is read into freshly allocated store buffers. An unpinned store allocates each
link anew (malloc hands large blocks out as fresh anonymous mappings), so the read faults in
every 4 KiB page of the destination one by one; on a VM each fault is expensive, and the
copy out of the page cache ran at about half the speed it reaches in memory already touched
(docs/benchmarks/disk.md). With transparent huge pages in `madvise` mode (a common default),
`madvise(MADV_HUGEPAGE)` on the buffer's 2 MiB-aligned interior makes those faults take 2 MiB
pages: 512 times fewer faults. It is a hint: with THP `always` or `never`, on pinned or
already touched memory, or off Linux, it changes nothing, and any failure is ignored (the read
is correct either way).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from collections.abc import Iterable

import torch

__all__ = ["advise_huge_pages"]

MADV_HUGEPAGE = 14  # Linux
HUGE = 2 << 20  # x86-64 and arm64 (4 KiB base pages) PMD size
MIN_BYTES = 4 * HUGE  # below this the hint buys little


def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    fn.restype = ctypes.c_int
    return fn


_MADVISE = _madvise()


def advise_huge_pages(parts: Iterable[torch.Tensor]) -> bool:
    """Hint huge pages for the span the CPU tensors `parts` cover (views of one allocation, as
    a link's buffers are). True when the kernel took the hint for a non-empty range."""
    spans = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
             for t in parts if t.device.type == "cpu" and t.numel()]
    if _MADVISE is None or not spans:
        return False
    lo = min(s for s, _ in spans)
    hi = max(e for _, e in spans)
    start = (lo + HUGE - 1) // HUGE * HUGE
    end = hi // HUGE * HUGE
    if end - start < MIN_BYTES:
        return False
    return _MADVISE(start, end - start, MADV_HUGEPAGE) == 0
