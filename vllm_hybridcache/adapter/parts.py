"""State parts from vLLM's KV-cache groups, never from model-specific code.

Mamba-like groups (fixed-size per-request state: GDN recurrent state, conv tails, PLE state)
become *sections*, copied whole. Full-attention-like groups (one row per token: K/V, index keys)
become *views* with a token axis, stored as whole KV blocks (see PagedBlocks). Any other group
kind (sliding window, chunked local, cross attention, compressed rows) has semantics a prefix
snapshot cannot reproduce exactly, so the model is reported unsupported and the connector stays
out of the way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_hybridcache.core import SectionSpec, StateLayout, ViewSpec


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class PartMap:
    """How the layout's parts map to vLLM KV-cache groups and layers."""

    layout: StateLayout
    sections: tuple[tuple[str, int, str, int], ...]   # (part name, gid, layer, state index)
    views: tuple[tuple[str, int, str], ...]           # (part name, gid, layer)
    block_bytes: dict[str, int]              # view part -> bytes of one KV block


class UnsupportedModel(Exception):
    """The model's KV-cache groups cannot be snapshotted exactly; the reason says why."""


def part_map(kv_cache_config) -> PartMap:
    """Derive the state layout from a vLLM `KVCacheConfig` (identical in every process)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    sections: list[SectionSpec] = []
    views: list[ViewSpec] = []
    sec_map: list[tuple[str, int, str, int]] = []
    view_map: list[tuple[str, int, str]] = []
    has_sections = False
    block_sizes: dict[int, int] = {}
    block_bytes: dict[str, int] = {}
    for gid, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        if isinstance(spec, MambaSpec):
            if spec.mamba_cache_mode != "none":
                raise UnsupportedModel(
                    f"group {gid} uses mamba_cache_mode={spec.mamba_cache_mode!r}; the snapshot "
                    "cache replaces vLLM's prefix caching (run with --no-enable-prefix-caching)"
                )
            has_sections = True
            for layer in group.layer_names:
                for i, (shape, dtype) in enumerate(zip(spec.shapes, spec.dtypes, strict=True)):
                    name = f"{layer}#{i}"
                    sections.append(SectionSpec(name=name, shape=tuple(int(s) for s in shape),
                                                dtype=dtype_name(dtype)))
                    sec_map.append((name, gid, layer, i))
        elif type(spec).__name__ in ("FullAttentionSpec", "MLAAttentionSpec") and isinstance(
            spec, FullAttentionSpec
        ):
            if spec.tokens_per_state != 1:
                raise UnsupportedModel(f"group {gid} stores {spec.tokens_per_state} tokens/row")
            block_sizes[gid] = spec.block_size
            for layer in group.layer_names:
                views.append(ViewSpec(name=layer, row_shape=(spec.page_size_bytes,),
                                      dtype="uint8"))
                view_map.append((layer, gid, layer))
                block_bytes[layer] = spec.page_size_bytes
        else:
            raise UnsupportedModel(
                f"KV-cache group {gid} is {type(spec).__name__}; only Mamba-like state and full "
                "attention rows can be snapshotted exactly"
            )
    if not has_sections:
        raise UnsupportedModel("the model has no recurrent state (not a hybrid model)")
    if len(set(block_sizes.values())) > 1:
        raise UnsupportedModel(f"attention groups use different block sizes {block_sizes}")
    block_tokens = next(iter(block_sizes.values()), 1)
    return PartMap(
        layout=StateLayout(sections=tuple(sections), views=tuple(views),
                           view_block_tokens=block_tokens),
        sections=tuple(sec_map),
        views=tuple(view_map),
        block_bytes=block_bytes,
    )


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
