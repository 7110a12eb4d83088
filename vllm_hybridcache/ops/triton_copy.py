"""The snapshot copy as a Triton kernel: the GPU fallback where the csrc build is missing.

Same segment table as ``csrc/snapshot_copy.h`` (one program per tile, one launch per table), so
the csrc kernel and this one are interchangeable; a per-tile row index, built on the host,
replaces the kernel's binary search. Addresses are raw integers turned into pointers in the
kernel, which lets one launch read every layer's KV tensor and write pinned host memory.
Imported lazily: ``@triton.jit`` reads ``TRITON_INTERPRET`` at definition time.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_hybridcache.ops.segments import SegmentTable

BLOCK = 1024  # elements per inner step of a program


@triton.jit
def _copy_kernel(table_ptr, tile_row_ptr, tile_words, WORD: tl.constexpr,
                 BLOCK: tl.constexpr):
    tile = tl.program_id(0).to(tl.int64)
    row = tl.load(tile_row_ptr + tile).to(tl.int64)
    src_i = tl.load(table_ptr + row * 4)
    dst_i = tl.load(table_ptr + row * 4 + 1)
    words = tl.load(table_ptr + row * 4 + 2)
    first = tl.load(table_ptr + row * 4 + 3)
    # A word of WORD bytes is WORD // ELEM elements of the element type below.
    if WORD >= 8:
        src = src_i.to(tl.pointer_type(tl.uint64))
        dst = dst_i.to(tl.pointer_type(tl.uint64))
        per = WORD // 8
    elif WORD == 4:
        src = src_i.to(tl.pointer_type(tl.uint32))
        dst = dst_i.to(tl.pointer_type(tl.uint32))
        per = 1
    else:
        src = src_i.to(tl.pointer_type(tl.uint8))
        dst = dst_i.to(tl.pointer_type(tl.uint8))
        per = 1
    begin = (tile - first) * tile_words * per
    end = tl.minimum(begin + tile_words * per, words * per)
    offs = tl.arange(0, BLOCK).to(tl.int64)
    for start in range(begin, end, BLOCK):
        idx = start + offs
        mask = idx < end
        tl.store(dst + idx, tl.load(src + idx, mask=mask), mask=mask)


def run(table: SegmentTable, device: torch.device) -> None:
    """Execute ``table`` in one launch on ``device`` (addresses: device or mapped pinned)."""
    if table.rows == 0:
        return
    t = table.table
    tiles_per_row = torch.diff(t[:, 3], append=torch.tensor([table.tiles], dtype=torch.int64))
    tile_row = torch.repeat_interleave(torch.arange(table.rows, dtype=torch.int32),
                                       tiles_per_row)
    t_dev = t.to(device, non_blocking=True)
    r_dev = tile_row.to(device, non_blocking=True)
    _copy_kernel[(table.tiles,)](t_dev, r_dev, table.tile_words, WORD=table.word_bytes,
                                 BLOCK=BLOCK)
