"""The per-token-rows attention backend of QSA layers, and the layout of one row.

A QSA layer keeps three things per token: its attention key and value (all kv heads) and its raw
indexer key. They are written and read together, so they live in ONE row of one vLLM KV-cache
group (a `FullAttentionSpec` whose page packs `[K | V | index key]` per token via vLLM's
`num_head_slots` / `state_content_bytes`). To vLLM and to the snapshot connector this is an
ordinary attention-like group with a token axis: blocks of `block_size` rows, addressed by the
block table, copied row ranges at a time with no model-specific code.

The backend only builds metadata (block table, slot mapping, query/sequence offsets); the
attention arithmetic is the layer's, through the kernel backend (`ops`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import torch
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)
from vllm.v1.kv_cache_interface import AttentionSpec, FullAttentionSpec

from vllm_hybridcache.flash_next.parallel import config_world, kv_heads_per_rank


def row_width(text_config, world: int = 1) -> int:
    """Elements per token row on one of `world` tensor parallel ranks: K and V of the kv heads
    that rank holds (flash_next/parallel.py), plus the raw index key (replicated)."""
    kv_heads = kv_heads_per_rank(text_config.num_key_value_heads, world)
    return 2 * kv_heads * text_config.head_dim + text_config.indexer_head_dim


def qsa_rows_spec(text_config, block_size: int, dtype: torch.dtype,
                  world: int = 1) -> FullAttentionSpec:
    """The KV-cache spec of one QSA layer on one of `world` ranks (see module docstring)."""
    width = row_width(text_config, world)
    return FullAttentionSpec(
        block_size=block_size,
        num_kv_heads=kv_heads_per_rank(text_config.num_key_value_heads, world),
        head_size=text_config.head_dim,
        dtype=dtype,
        num_head_slots=1,
        state_content_bytes=width * torch.empty((), dtype=dtype).element_size(),
    )


@dataclass
class QSARowsMetadata:
    """What a QSA layer needs to write its rows and gather each sequence's history."""

    num_actual_tokens: int
    query_start_loc_cpu: torch.Tensor  # [N + 1]
    seq_lens_cpu: torch.Tensor  # [N] tokens in the cache after this step (incl. this step)
    block_table: torch.Tensor  # [N, max_blocks]
    slot_mapping: torch.Tensor  # [T]
    block_size: int


class QSARowsMetadataBuilder(AttentionMetadataBuilder[QSARowsMetadata]):
    """Copies the common metadata; decode-first ordering like the state layers."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self._init_reorder_batch_threshold(1)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> QSARowsMetadata:
        m = common_attn_metadata
        qsl = m.query_start_loc_cpu[: m.num_reqs + 1].clone()
        if m.seq_lens_cpu_upper_bound is not None:
            seq_lens = m.seq_lens_cpu_upper_bound[: m.num_reqs].clone()
        else:
            seq_lens = m.seq_lens[: m.num_reqs].cpu()
        return QSARowsMetadata(
            num_actual_tokens=m.num_actual_tokens,
            query_start_loc_cpu=qsl,
            seq_lens_cpu=seq_lens,
            block_table=m.block_table_tensor[: m.num_reqs],
            slot_mapping=m.slot_mapping[: m.num_actual_tokens],
            block_size=self.kv_cache_spec.block_size,
        )


class QSARowsBackend(AttentionBackend):
    """Metadata-only attention backend of the Flash-Next QSA layers (any dtype, any block)."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16,
                                                     torch.float32]
    forward_includes_kv_cache_update: bool = True
    # Set by the QSA layers when they are built (vLLM may ask `customize_spec` outside of a
    # config context); one Flash-Next model (and its MTP draft, same config) per process.
    row_elements: ClassVar[int | None] = None

    @staticmethod
    def get_name() -> str:
        return "FLASH_NEXT_QSA_ROWS"

    @staticmethod
    def get_impl_cls():
        raise NotImplementedError("QSA rows are read and written by the layer through ops")

    @staticmethod
    def get_builder_cls() -> type[QSARowsMetadataBuilder]:
        return QSARowsMetadataBuilder

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        """Pack `[K | V | index key]` per token, so vLLM sizes hybrid pages from the real row.

        vLLM calls this with a spec built from the model config when it aligns the attention
        page with the (larger) recurrent-state page; the QSA layer builds the same spec.
        """
        width = cls.row_elements
        if width is None:
            from vllm.config import get_current_vllm_config

            cfg = get_current_vllm_config()
            width = row_width(cfg.model_config.hf_text_config, config_world(cfg))
        return replace(spec, num_head_slots=1,
                       state_content_bytes=width * torch.empty((), dtype=spec.dtype)
                       .element_size())
