"""Segment tables: a link's scattered copies as one (src, dst, words, first_tile) table.

Why: a link's KV blocks sit at arbitrary block ids of every attention layer's paged tensor, and
on the GPU layout each block is two pieces (K and V halves), so a link is hundreds to thousands
of small copies. Describing them as rows of one int64 table lets a single kernel launch (or one
C++ call on the CPU) do all of them; this module builds such tables with tensor arithmetic, not
a Python loop per block, so building the table costs less than the copies it replaces.

Row layout matches ``csrc/snapshot_copy.h``: source address, destination address, length in
words, index of the row's first tile. The word is the widest of 16/8/4/1 bytes dividing every
address and length, so the kernels use 16-byte moves whenever the buffers allow.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

WORD_SIZES = (16, 8, 4, 1)
COLS = 4


@dataclass(frozen=True)
class SegmentTable:
    """A ready-to-run table; ``table`` is int64 [rows, 4] on the CPU."""

    table: torch.Tensor
    tiles: int
    tile_words: int
    word_bytes: int

    @property
    def rows(self) -> int:
        return int(self.table.shape[0])

    def nbytes(self) -> int:
        return int(self.table[:, 2].sum()) * self.word_bytes


def word_bytes_for(*columns: torch.Tensor) -> int:
    """The widest word size dividing every value of ``columns`` (addresses and byte lengths)."""
    for w in WORD_SIZES[:-1]:
        if all(not c.numel() or bool((c.remainder(w) == 0).all()) for c in columns):
            return w
    return 1


def build(src: torch.Tensor, dst: torch.Tensor, nbytes: torch.Tensor,
          tile_bytes: int) -> SegmentTable:
    """Table for copying ``nbytes[i]`` bytes from address ``src[i]`` to ``dst[i]`` (int64, 1-D).

    ``tile_bytes`` is the work of one GPU workgroup or one CPU task; it is rounded to whole
    words.
    """
    src = src.reshape(-1).to(torch.int64)
    dst = dst.reshape(-1).to(torch.int64)
    nbytes = nbytes.reshape(-1).to(torch.int64).expand(src.shape[0]).contiguous()
    w = word_bytes_for(src, dst, nbytes)
    words = nbytes // w
    tile_words = max(1, tile_bytes // w)
    tiles = torch.clamp((words + tile_words - 1) // tile_words, min=1)
    first = torch.cumsum(tiles, 0) - tiles
    table = torch.stack([src, dst, words, first], dim=1).contiguous()
    return SegmentTable(table=table, tiles=int(tiles.sum()) if tiles.numel() else 0,
                        tile_words=tile_words, word_bytes=w)


def concat(tables: list[SegmentTable], tile_bytes: int) -> SegmentTable:
    """One table for several (e.g. every layer and state slot of a link: one launch)."""
    if not tables:
        return build(torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64),
                     torch.empty(0, dtype=torch.int64), tile_bytes)
    rows = torch.cat([t.table for t in tables])
    return build(rows[:, 0], rows[:, 1], rows[:, 2] * torch.cat(
        [torch.full((t.rows,), t.word_bytes, dtype=torch.int64) for t in tables]), tile_bytes)


@dataclass(frozen=True)
class BlockPieces:
    """Where the contiguous pieces of one block of a paged tensor lie, in bytes.

    A block of a tensor whose block axis is ``d`` consists of ``prod(shape[:d])`` pieces (two on
    the GPU's [2, blocks, ...] layout, one on the CPU's [blocks, ...] layout), each the
    contiguous bytes of ``shape[d+1:]``. Stored rows are the block as ``tensor.select(d, b)``
    would copy it: pieces in order.
    """

    base: int
    block_stride: int
    piece_offsets: torch.Tensor  # int64 [P], relative to the block's first byte
    piece_bytes: int

    @classmethod
    def of(cls, tensor: torch.Tensor, block_dim: int) -> BlockPieces | None:
        """The pieces, or None when the block's trailing dims are not contiguous."""
        es = tensor.element_size()
        shape, stride = tensor.shape, tensor.stride()
        inner = 1
        for s in shape[block_dim + 1:]:
            inner *= int(s)
        expect = 1
        for dim in range(len(shape) - 1, block_dim, -1):
            if shape[dim] != 1 and stride[dim] != expect:
                return None
            expect *= int(shape[dim])
        offs = torch.zeros(1, dtype=torch.int64)
        for dim in range(block_dim):
            step = torch.arange(int(shape[dim]), dtype=torch.int64) * (stride[dim] * es)
            offs = (offs[:, None] + step[None, :]).reshape(-1)
        return cls(base=tensor.data_ptr(), block_stride=stride[block_dim] * es,
                   piece_offsets=offs, piece_bytes=inner * es)

    def addresses(self, block_ids: torch.Tensor) -> torch.Tensor:
        """int64 [n * P]: the address of every piece of the given blocks, block-major."""
        starts = self.base + block_ids.to(torch.int64) * self.block_stride
        return (starts[:, None] + self.piece_offsets[None, :]).reshape(-1)

    def row_addresses(self, rows: torch.Tensor) -> torch.Tensor:
        """int64 [n * P]: where each piece goes in a contiguous [n, block_bytes] buffer."""
        n = rows.shape[0]
        p = self.piece_offsets.shape[0]
        base = rows.data_ptr() + torch.arange(n, dtype=torch.int64) * rows.stride(0)
        return (base[:, None] + torch.arange(p, dtype=torch.int64)[None, :]
                * self.piece_bytes).reshape(-1)
