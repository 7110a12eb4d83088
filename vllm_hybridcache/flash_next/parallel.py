"""How Flash-Next's layers split over tensor parallel ranks, and which vLLM layer each is.

Why two kinds of layer: at TP = 1 without a quantization config every projection stays a plain
`nn.Linear` (and the token embedding / LM head plain torch modules): the arithmetic every
exactness, split-invariance and reference test of this model was measured on (the CPU backend
swaps in vLLM's CPU GEMM for bf16, ops/cpu.py). With a checkpoint quantization
(`vllm_config.quant_config`, e.g. compressed-tensors W8A8 from models/quantize.py) or TP > 1
they are vLLM's own layers, as vLLM's model files build them:

- `column()`: `ColumnParallelLinear` (or `MergedColumnParallelLinear` for a fused projection
  whose parts split separately, the GDN `in_proj_qkv`): this rank's output rows only;
- `row()`: `RowParallelLinear`: this rank's input columns, the partial sums all-reduced (or
  left to the caller to reduce once, the MoE block);
- `vocab_embedding()` / `lm_head()` + `logits_head()`: `VocabParallelEmbedding`,
  `ParallelLMHead` and vLLM's `LogitsProcessor` (which gathers the vocabulary shards).

The quantization config picks each layer's method (its targets and ignore list name the
checkpoint's modules by `prefix`); weights load through each parameter's `weight_loader`,
which takes this rank's slice of the checkpoint tensor.

The sharding follows the heads: GDN key/value heads and attention query heads split evenly
(ranks hold whole heads, so the recurrent state and the per-token rows of a layer are this
rank's heads only); attention kv heads split when there are at least as many as ranks and
are replicated otherwise (each rank holds the kv head its query heads read, as vLLM's
`QKVParallelLinear` does); the routed and shared experts split their intermediate size. The
indexer, the hyper-connections, the PLE and the router stay replicated: they are small, and
the indexer's token selection must be the same on every rank.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn


def tp_rank_world() -> tuple[int, int]:
    """(this rank, TP world size); (0, 1) outside a vLLM worker (tests, the reference)."""
    from vllm.distributed import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return 0, 1
    return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()


def config_world(vllm_config: Any) -> int:
    """The TP world size a config asks for (class methods run before any worker exists)."""
    return int(getattr(vllm_config.parallel_config, "tensor_parallel_size", 1) or 1)


def split_even(total: int, world: int, what: str) -> int:
    """`total / world`, refusing a split that would cut a head (or a row) in two."""
    if total % world:
        raise ValueError(f"Flash-Next at tensor parallel size {world}: {what} ({total}) must "
                         f"be divisible by it")
    return total // world


def kv_heads_per_rank(num_kv_heads: int, world: int) -> int:
    """Attention kv heads a rank holds: its share, or one replica when there are fewer kv
    heads than ranks (then `world` must be a multiple of them)."""
    if num_kv_heads >= world:
        return split_even(num_kv_heads, world, "num_key_value_heads")
    if world % num_kv_heads:
        raise ValueError(f"Flash-Next at tensor parallel size {world}: it must be a multiple "
                         f"of num_key_value_heads ({num_kv_heads}) to replicate them")
    return 1


def uses_vllm_layers(quant_config: Any) -> bool:
    """Whether this process builds vLLM's layers (module docstring)."""
    return quant_config is not None or tp_rank_world()[1] > 1


def refuse_cpu_expert_parallel(vllm_config: Any, is_cpu: bool | None = None) -> None:
    """Expert parallelism is refused on vLLM's CPU platform, at config time: vLLM 0.32's CPU
    fused-MoE kernels take global expert ids and ignore the expert map, so a rank holding
    half of the experts reads past its weights (the worker crashes). Tensor parallelism
    without it splits every expert's intermediate size instead (moe.py)."""
    if not getattr(vllm_config.parallel_config, "enable_expert_parallel", False):
        return
    if is_cpu is None:
        from vllm.platforms import current_platform

        is_cpu = current_platform.is_cpu()
    if is_cpu:
        raise ValueError(
            "Flash-Next (vllm-hybridcache): --enable-expert-parallel is not supported on the "
            "CPU platform (vLLM's CPU fused-MoE kernels ignore the expert map); without it "
            "tensor parallelism splits each expert's intermediate size over the ranks")


def column(in_features: int, out_features: int, *, bias: bool = False,
           quant_config: Any = None, prefix: str = "",
           parts: Sequence[int] | None = None, shard: tuple[int, int] | None = None,
           ) -> nn.Module:
    """A projection whose output rows split over ranks. `parts`: the sizes of a fused
    projection's parts (each split on its own). `shard`: (rank, world) of a split other than
    the TP group's (replicated kv heads: `kv_shard`)."""
    if not uses_vllm_layers(quant_config):
        return nn.Linear(in_features, out_features, bias=bias)
    from vllm.model_executor.layers.linear import (
        ColumnParallelLinear,
        MergedColumnParallelLinear,
    )

    if parts is not None:
        if sum(parts) != out_features:
            raise ValueError(f"{prefix}: parts {list(parts)} do not add up to {out_features}")
        return MergedColumnParallelLinear(in_features, list(parts), bias=bias,
                                          quant_config=quant_config, prefix=prefix,
                                          return_bias=False)
    rank, world = shard if shard is not None else tp_rank_world()
    return ColumnParallelLinear(in_features, out_features, bias=bias, quant_config=quant_config,
                                prefix=prefix, return_bias=False, tp_rank=rank, tp_size=world)


def row(in_features: int, out_features: int, *, bias: bool = False, quant_config: Any = None,
        prefix: str = "", reduce: bool = True) -> nn.Module:
    """A projection whose input columns split over ranks (the partial sums all-reduced, or,
    with `reduce=False`, left for the caller's one all-reduce: `all_reduce`)."""
    if not uses_vllm_layers(quant_config):
        return nn.Linear(in_features, out_features, bias=bias)
    from vllm.model_executor.layers.linear import RowParallelLinear

    return RowParallelLinear(in_features, out_features, bias=bias, input_is_parallel=True,
                             reduce_results=reduce, quant_config=quant_config, prefix=prefix,
                             return_bias=False)


def kv_shard(num_kv_heads: int) -> tuple[int, int]:
    """(rank, world) of the kv-head split: the TP group's when kv heads split evenly; else
    the replica this rank's query heads read (rank r of world W reads kv head r * Hkv / W)."""
    rank, world = tp_rank_world()
    if num_kv_heads >= world:
        return rank, world
    kv_heads_per_rank(num_kv_heads, world)  # the divisibility check
    return rank * num_kv_heads // world, num_kv_heads


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum of the ranks' partial results (identity at TP = 1)."""
    if tp_rank_world()[1] == 1:
        return x
    from vllm.distributed.communication_op import tensor_model_parallel_all_reduce

    return tensor_model_parallel_all_reduce(x)


def vocab_embedding(vocab: int, hidden: int) -> nn.Module:
    """The token embedding: `nn.Embedding`, or vLLM's `VocabParallelEmbedding` at TP > 1."""
    if tp_rank_world()[1] == 1:
        return nn.Embedding(vocab, hidden)
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    return VocabParallelEmbedding(vocab, hidden)


def lm_head(vocab: int, hidden: int, prefix: str = "lm_head") -> nn.Module:
    """The LM head: `nn.Linear`, or vLLM's `ParallelLMHead` at TP > 1 (its logits through
    `logits_head`)."""
    if tp_rank_world()[1] == 1:
        return nn.Linear(hidden, vocab, bias=False)
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    return ParallelLMHead(vocab, hidden, prefix=prefix)


def tie(head: nn.Module, embedding: nn.Module) -> None:
    """Share the embedding's weight with the LM head (tie_word_embeddings)."""
    if hasattr(head, "tie_weights"):
        head.tie_weights(embedding)
    else:
        head.weight = embedding.weight


def logits_head(vocab: int) -> Callable[[nn.Module, torch.Tensor], torch.Tensor]:
    """`(lm_head, hidden) -> logits` over the whole vocabulary on every rank."""
    if tp_rank_world()[1] == 1:
        return lambda head, hidden: head(hidden)
    from vllm.model_executor.layers.logits_processor import LogitsProcessor

    return LogitsProcessor(vocab)


def parts_loader(parts: Sequence[int], dim: int = 0) -> Callable[[torch.Tensor, torch.Tensor],
                                                                   None]:
    """A `weight_loader` for a plain parameter made of `parts` along `dim` (GDN conv weight:
    q, k, v channels; `dt_bias` / `A_log`: one part): copies this rank's slice of each part."""
    def load(param: torch.Tensor, full: torch.Tensor) -> None:
        with torch.no_grad():
            param.copy_(rank_slice(full, parts, dim))
    return load


def rank_slice(full: torch.Tensor, parts: Sequence[int], dim: int = 0) -> torch.Tensor:
    """This rank's slice of each of `full`'s `parts` along `dim`, concatenated."""
    rank, world = tp_rank_world()
    if world == 1:
        return full
    if sum(parts) != full.shape[dim]:
        raise ValueError(f"checkpoint tensor of {full.shape[dim]} along dim {dim}, expected "
                         f"parts {list(parts)}")
    out, start = [], 0
    for size in parts:
        per = split_even(size, world, "a sharded tensor's part")
        out.append(full.narrow(dim, start + rank * per, per))
        start += size
    return torch.cat(out, dim=dim)
