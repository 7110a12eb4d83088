"""Split-invariant paged attention over vLLM's CPU KV cache (csrc/split_attention_cpu.cpp).

Why our own kernel: fine segmentation needs every query's attention output to be the same
whatever prefill step computes it (docs/split-invariance.md). vLLM's CPU attention blocks a
query's softmax by key tiles whose size follows the query tile the step puts it in; pinning it
to one-round query tiles (`compat.pin_cpu_attention_split`) makes each tile read the request's
keys again. This kernel visits each request's keys once per 32-token query tile in key tiles
fixed from key 0, and computes each query's scores, softmax and P @ V in an order that only its
own position decides. It reads vLLM's `vec` layout (keys [head_dim, block_size], values
[block_size, head_dim] per block and KV head); bf16 or float32; head dims 64, 128, 256.

This module imports no vLLM: the bend that routes vLLM's CPU attention here is
`compat.install_split_invariant_cpu_attention`.
"""

from __future__ import annotations

import functools
import logging
from types import ModuleType

import torch

logger = logging.getLogger("vllm_hybridcache")

HEAD_DIMS: tuple[int, ...] = (64, 128, 256)
DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float32)
BLOCK_ALIGN = 32  # the kernel's key unit; vLLM's `vec` layout needs the same


@functools.cache
def _module() -> ModuleType | None:
    from vllm_hybridcache.ops.csrc_build import load_cpu_attention

    try:
        return load_cpu_attention()
    except Exception as e:  # no compiler, no csrc/: vLLM's attention stays, step mode
        logger.warning("hybridcache: the split-invariant CPU attention could not be built "
                       "(%s: %s); Qwen3-Next on CPU runs vLLM's attention in step mode",
                       type(e).__name__, e)
        return None


def available() -> bool:
    """Whether the kernel is built (compiled on first use, then cached) in this process."""
    return _module() is not None


def supports(dtype: torch.dtype, head_dim: int, block_size: int, kv_cache_dtype: str) -> str:
    """'' when the kernel computes attention of this shape, else why not."""
    if dtype not in DTYPES:
        return f"dtype {dtype} (bf16 or float32 only)"
    if head_dim not in HEAD_DIMS:
        return f"head_dim {head_dim} (64, 128 or 256 only)"
    if block_size % BLOCK_ALIGN:
        return f"block size {block_size} (a multiple of {BLOCK_ALIGN} only)"
    if kv_cache_dtype not in ("auto", "bfloat16", "float32"):
        return f"KV cache dtype {kv_cache_dtype} (the model's dtype only)"
    return ""


def split_invariant_attention(query: torch.Tensor, key_cache: torch.Tensor,
                              value_cache: torch.Tensor, output: torch.Tensor,
                              query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                              block_table: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of every request's queries (`query_start_loc`, the last of each
    request's `seq_lens` keys being its last query's) over its blocks (`block_table` rows),
    written into `output` ([tokens, heads, head_dim]); returns `output`."""
    mod = _module()
    if mod is None:
        raise RuntimeError("the split-invariant CPU attention is not built in this process")
    mod.split_invariant_attention(query, key_cache, value_cache, output, query_start_loc,
                                  seq_lens, block_table, float(scale))
    return output
