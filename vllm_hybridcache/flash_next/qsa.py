"""QSA attention (transformers' `Qwen4ExpTextAttention` + `Qwen4ExpTextQSAIndexer`).

Gated output (q_proj yields query and gate per head), q/k RMSNorm, partial RoPE, GQA, and the
indexer: raw index keys are cached per token; each query pools complete groups of
`indexer_compress_ratio` keys, scores them and attends only to the top `indexer_budget` tokens
plus the incomplete tail. The rows `[K | V | index key]` live in one attention-like KV-cache
group (backend.py); the layer writes this step's rows and gathers each sequence's history.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

from vllm_hybridcache.compat import layer_attn_metadata, register_forward_layer
from vllm_hybridcache.flash_next.backend import QSARowsBackend, qsa_rows_spec, row_width
from vllm_hybridcache.flash_next.common import Qwen4RMSNorm, RopeTable
from vllm_hybridcache.flash_next.ops.interface import FlashNextOps
from vllm_hybridcache.flash_next.ops.reference import apply_partial_rope
from vllm_hybridcache.flash_next.parallel import (
    column,
    kv_heads_per_rank,
    kv_shard,
    row,
    split_even,
    tp_rank_world,
)


class QSAIndexer(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.n_heads = config.indexer_n_heads
        self.head_dim = config.indexer_head_dim
        self.budget = config.indexer_budget
        self.ratio = config.indexer_compress_ratio
        self.index_qk_proj = nn.Linear(config.hidden_size, (self.n_heads + 1) * self.head_dim,
                                       bias=False)
        self.q_layernorm = Qwen4RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_layernorm = Qwen4RMSNorm(self.head_dim, config.rms_norm_eps)


class QSAAttention(nn.Module, AttentionLayerBase):
    """One QSA attention layer; its KV-cache spec is one row per token (see backend.py)."""

    supports_dcp = False

    def __init__(self, config, layer_idx: int, vllm_config: VllmConfig, prefix: str,
                 ops: FlashNextOps, rope: RopeTable, quant_config: Any = None) -> None:
        """quant_config: the checkpoint's, for q/k/v/o (parallel.py); the indexer's projection
        stays in the float dtype. At TP > 1 this rank holds its share of the query heads and
        the kv heads they read (split, or replicated when fewer than the ranks: parallel.py);
        the indexer is replicated, so every rank selects the same tokens."""
        super().__init__()
        self.ops = ops
        self.rope = rope
        self.prefix = prefix
        self.config = config
        self.vllm_config = vllm_config
        _, world = tp_rank_world()
        self.num_heads = split_even(config.num_attention_heads, world, "num_attention_heads")
        self.num_kv_heads = kv_heads_per_rank(config.num_key_value_heads, world)
        self.head_dim = config.head_dim
        self.scaling = self.head_dim ** -0.5
        self.eps = config.rms_norm_eps
        h, d = config.hidden_size, config.head_dim
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        qc, bias = quant_config, bool(config.attention_bias)
        # q_proj's rows are [query | gate] per head, so a split by rows is a split by heads
        self.q_proj = column(h, heads * d * 2, bias=bias, quant_config=qc,
                             prefix=f"{prefix}.q_proj")
        kv = kv_shard(kv_heads)
        self.k_proj = column(h, kv_heads * d, bias=bias, quant_config=qc, shard=kv,
                             prefix=f"{prefix}.k_proj")
        self.v_proj = column(h, kv_heads * d, bias=bias, quant_config=qc, shard=kv,
                             prefix=f"{prefix}.v_proj")
        self.o_proj = row(heads * d, h, bias=bias, quant_config=qc, prefix=f"{prefix}.o_proj")
        self.q_norm = Qwen4RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = Qwen4RMSNorm(self.head_dim, config.rms_norm_eps)
        self.indexer = QSAIndexer(config)
        self.width = row_width(config, world)
        QSARowsBackend.row_elements = self.width
        self.kv_dtype = vllm_config.model_config.dtype
        self.kv_cache = torch.tensor([])
        register_forward_layer(vllm_config, prefix, self)

    # ------------------------------------------------------------------ AttentionLayerBase
    def get_attn_backend(self):
        return QSARowsBackend

    def get_kv_cache_spec(self, vllm_config: VllmConfig):
        return qsa_rows_spec(self.config, vllm_config.cache_config.block_size, self.kv_dtype,
                             tp_rank_world()[1])

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        # vLLM's unified [blocks, heads=1, tokens, row] view; rows are [K | V | index key].
        if kv_cache.ndim != 4 or kv_cache.shape[1] != 1 or kv_cache.shape[3] != self.width:
            raise ValueError(f"unexpected QSA cache view {tuple(kv_cache.shape)}")
        self.kv_cache = kv_cache

    # ------------------------------------------------------------------ forward
    def _metadata(self):
        return layer_attn_metadata(self.prefix)

    def _project(self, x_t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """The step's projections, rotated by `cos`/`sin` (per token, broadcast over heads):
        indexer query and raw key; attention q with its output gate, k, v."""
        t, d, hkv, di = x_t.shape[0], self.head_dim, self.num_kv_heads, self.indexer.head_dim
        qk = self.indexer.index_qk_proj(x_t)
        iq = qk[:, : self.indexer.n_heads * di].view(t, self.indexer.n_heads, di)
        raw_k = qk[:, self.indexer.n_heads * di:]
        iq = apply_partial_rope(self.indexer.q_layernorm(iq), cos, sin)
        q, gate = torch.chunk(self.q_proj(x_t).view(t, -1, 2 * d), 2, dim=-1)
        gate = gate.reshape(t, -1)
        q = apply_partial_rope(self.q_norm(q), cos, sin)
        k = apply_partial_rope(self.k_norm(self.k_proj(x_t).view(t, hkv, d)), cos, sin)
        v = self.v_proj(x_t).view(t, hkv, d)
        return iq, raw_k, q, gate, k, v

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        meta = self._metadata()
        t = x.shape[0] if meta is None else meta.num_actual_tokens
        x_t, pos = x[:t], positions[:t].long()
        d, hkv = self.head_dim, self.num_kv_heads
        max_pos = int(pos.max()) + 1 if t else 1
        if meta is not None and meta.seq_lens_cpu.numel():
            max_pos = max(max_pos, int(meta.seq_lens_cpu.max()))
        cos_t, sin_t = self.rope.tables(max_pos, x.dtype, x.device)
        cos, sin = cos_t[pos][:, None], sin_t[pos][:, None]

        iq, raw_k, q, gate, k, v = self._project(x_t, cos, sin)
        rows_new = torch.cat([k.reshape(t, -1), v.reshape(t, -1), raw_k], dim=-1)

        if meta is None or self.kv_cache.numel() == 0:
            # profiling / dummy run: the step's own tokens are the whole history
            rows = rows_new
            key_cu = torch.tensor([0, t])
            seq_idx = torch.zeros(t, dtype=torch.long)
            qpos = torch.arange(t)
        else:
            flat = self.kv_cache[:, 0]  # [blocks, block_size, width]
            bs = meta.block_size
            slots = meta.slot_mapping.long()
            flat.view(-1, self.width)[slots] = rows_new.to(flat.dtype)
            seq_lens = meta.seq_lens_cpu.long()
            key_cu = torch.zeros(seq_lens.numel() + 1, dtype=torch.long)
            key_cu[1:] = seq_lens.cumsum(0)
            gathered = []
            for r, n in enumerate(seq_lens.tolist()):
                p = torch.arange(n)
                blocks = meta.block_table[r, p // bs].long()
                gathered.append(flat[blocks, p % bs])
            rows = torch.cat(gathered).to(x.dtype)
            qsl = meta.query_start_loc_cpu.long()
            seq_idx = torch.repeat_interleave(torch.arange(qsl.numel() - 1), qsl[1:] - qsl[:-1])
            qpos = pos
        keys = rows[:, : hkv * d].view(-1, hkv, d)
        values = rows[:, hkv * d: 2 * hkv * d].view(-1, hkv, d)
        raw_keys = rows[:, 2 * hkv * d:]
        sel = self.ops.indexer_topk(iq, raw_keys, key_cu, seq_idx, qpos,
                                    self.indexer.k_layernorm.weight, cos_t, sin_t,
                                    budget=self.indexer.budget,
                                    compress_ratio=self.indexer.ratio, eps=self.eps)
        attn = self.ops.sparse_attention(q, keys, values, key_cu, seq_idx, sel, self.scaling)
        out = attn.reshape(t, -1) * torch.sigmoid(gate)
        result = self.o_proj(out)
        if t < x.shape[0]:
            result = torch.cat([result, result.new_zeros(x.shape[0] - t, result.shape[1])])
        return result
