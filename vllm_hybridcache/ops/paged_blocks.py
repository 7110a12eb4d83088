"""Whole KV blocks of one attention layer's paged tensor, copied to and from flat rows.

The copy primitive under every view a link stores (the adapter's captures and restores, the
link copies of ops/link_copy.py, the self-check). It lives in ops, beside the copy backends it
selects, so nothing below the adapter imports the adapter for it.
"""

from __future__ import annotations

import torch


class UnsupportedModel(Exception):
    """The model's KV-cache groups cannot be snapshotted exactly; the reason says why."""


class PagedBlocks:
    """Copies whole KV blocks of one attention layer's paged KV tensor.

    Views are copied a block at a time because backends pack tokens inside a block (vLLM's CPU
    attention stores keys in AMX/VNNI tiles, so a token's row is not a slice of the tensor).
    The block axis is found from the tensor's shape, so [blocks, heads, block, C] (CPU) and
    [2, blocks, block, heads, D] (GPU) layouts both work.

    The copy backend comes from ``ops.copy_select`` (csrc kernel / its CPU twin, Triton, or
    torch): every backend but torch runs all blocks of a call as one segment table (one launch
    or one C++ call) instead of one ``copy_`` per block; torch is also the fallback for buffers
    a kernel cannot address (non-contiguous rows, pageable host memory on a GPU).
    """

    def __init__(self, tensor: torch.Tensor, num_blocks: int, block_bytes: int):
        shape = tuple(tensor.shape)
        if num_blocks not in shape:
            raise UnsupportedModel(f"cannot find the block axis in KV tensor of shape {shape}")
        self.block_dim = shape.index(num_blocks)
        self.tensor = tensor
        self.block_bytes = block_bytes
        per_block = tensor.element_size() * tensor.numel() // num_blocks
        if per_block != block_bytes:
            raise UnsupportedModel(
                f"KV tensor has {per_block} bytes/block, spec says {block_bytes}")
        from vllm_hybridcache.ops import copy_select
        from vllm_hybridcache.ops.segments import BlockPieces

        self.backend, self._run = copy_select.select(tensor.device)
        self._tile_bytes = copy_select.tile_bytes(tensor.device)
        self._pieces = BlockPieces.of(tensor, self.block_dim) if self._run is not None else None
        if self._pieces is None:
            self.backend, self._run = "torch", None

    def block(self, block_id: int) -> torch.Tensor:
        return self.tensor.select(self.block_dim, block_id)

    def addressable(self, rows: torch.Tensor) -> bool:
        """Whether a kernel can read/write ``rows`` ([n, block_bytes] bytes) by address."""
        if (self._run is None or rows.dim() != 2 or rows.shape[1] != self.block_bytes
                or rows.stride(1) != 1 or rows.element_size() != 1):
            return False
        if self.tensor.device.type == "cpu":
            return rows.device.type == "cpu"
        return rows.device == self.tensor.device or rows.is_pinned()

    def table(self, block_ids: list[int], first: int, rows: torch.Tensor, gather: bool):
        """The segment table of a gather (blocks -> rows) or scatter (rows -> blocks), for
        callers that batch several layers into one launch (``ops.segments.concat``)."""
        from vllm_hybridcache.ops.segments import build

        ids = torch.tensor(block_ids[first:first + rows.shape[0]], dtype=torch.int64)
        blocks = self._pieces.addresses(ids)
        buf = self._pieces.row_addresses(rows)
        src, dst = (blocks, buf) if gather else (buf, blocks)
        return build(src, dst, torch.tensor(self._pieces.piece_bytes), self._tile_bytes)

    def gather(self, block_ids: list[int], first: int, out: torch.Tensor) -> None:
        """Copy the request's blocks [first, first + len(out)) into out ([n, block_bytes])."""
        if out.shape[0] and self.addressable(out):
            self._run(self.table(block_ids, first, out, gather=True))
            return
        for i in range(out.shape[0]):
            src = self.block(block_ids[first + i])
            out[i].view(src.dtype).view(src.shape).copy_(src)

    def scatter(self, block_ids: list[int], first: int, blocks: torch.Tensor) -> None:
        """Write stored blocks (uint8 [n, block_bytes]) into the request's blocks from `first`."""
        if blocks.shape[0] and self.addressable(blocks):
            self._run(self.table(block_ids, first, blocks, gather=False))
            return
        for i in range(blocks.shape[0]):
            dst = self.block(block_ids[first + i])
            dst.copy_(blocks[i].view(dst.dtype).view(dst.shape))
