"""Copy a whole link (its recurrent-state slots and every layer's KV blocks) in one launch.

Why: ``PagedBlocks.gather`` already turns one layer's blocks into one launch, but a link spans
every attention layer plus one state slot per recurrent-state tensor, so a capture would still
be tens of launches (or, on the torch path, one copy per block and slot). Concatenating the
parts' segment tables runs the link as one launch (one C++ call on the CPU), which is what the
``twin/link`` column of ``benchmarks/copy_bench.py`` measures. Parts a kernel cannot address
(non-contiguous slots, pageable host memory on a GPU) keep their torch copies.
"""

from __future__ import annotations

import torch

from vllm_hybridcache.ops import segments
from vllm_hybridcache.ops.paged_blocks import PagedBlocks


def _slot_addressable(src: torch.Tensor, dst: torch.Tensor) -> bool:
    if not (src.is_contiguous() and dst.is_contiguous() and src.dtype == dst.dtype
            and src.shape == dst.shape):
        return False
    if src.device.type == "cpu":
        return dst.device.type == "cpu"
    return dst.device == src.device or (dst.device.type == "cpu" and dst.is_pinned())


def gather_link(sections: list[tuple[torch.Tensor, torch.Tensor]],
                views: list[tuple[PagedBlocks, list[int], int, torch.Tensor]]) -> int:
    """Copy state slots ``(src slot, dst buffer)`` and KV blocks ``(accessor, block ids, first
    block, rows)`` into a link's buffers. Returns how many launches the kernel path made (0: the
    torch path did everything)."""
    run = next((acc._run for acc, *_ in views if acc._run is not None), None)
    tables: list[segments.SegmentTable] = []
    tile = views[0][0]._tile_bytes if views else 0
    for src, dst in sections:
        if run is not None and _slot_addressable(src, dst):
            n = src.numel() * src.element_size()
            tables.append(segments.build(torch.tensor([src.data_ptr()]),
                                         torch.tensor([dst.data_ptr()]), torch.tensor(n), tile))
        else:
            dst.copy_(src)
    for acc, ids, first, rows in views:
        if run is not None and acc._run is run and rows.shape[0] and acc.addressable(rows):
            tables.append(acc.table(ids, first, rows, gather=True))
        else:
            acc.gather(ids, first, rows)
    if not tables:
        return 0
    run(segments.concat(tables, tile))
    return 1
