"""State parts from vLLM's KV-cache groups, never from model-specific code.

Mamba-like groups (fixed-size per-request state: GDN recurrent state, conv tails, PLE state)
become *sections*, copied whole. Full-attention-like groups (one row per token: K/V, index keys)
become *views* with a token axis, stored as whole KV blocks (ops/paged_blocks.py). Any other
group kind (sliding window, chunked local, cross attention, compressed rows) has semantics a prefix
snapshot cannot reproduce exactly, so the model is reported unsupported and the connector stays
out of the way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_hybridcache.core import SectionSpec, StateLayout, ViewSpec
from vllm_hybridcache.ops.paged_blocks import UnsupportedModel

__all__ = ["PartMap", "UnsupportedModel", "dtype_name", "part_map"]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class PartMap:
    """How the layout's parts map to vLLM KV-cache groups and layers."""

    layout: StateLayout
    sections: tuple[tuple[str, int, str, int], ...]   # (part name, gid, layer, state index)
    views: tuple[tuple[str, int, str], ...]           # (part name, gid, layer)
    block_bytes: dict[str, int]              # view part -> bytes of one KV block


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
