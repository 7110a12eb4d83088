"""QSA attention under multimodal RoPE (the layer `Qwen4ExpForConditionalGeneration` uses).

With images in the prompt, a token's rotary position is a triple (t, h, w) (M-RoPE, computed
by `vision_model.mrope_positions`), no longer its index in the sequence. Two things follow for
QSA:

- the query, key and index query rotate by the step's M-RoPE positions (vLLM passes them as a
  `[3, T]` tensor), with transformers' interleaved layout: rotary frequency j takes its angle
  from the t, h or w row by `j mod 3` within `mrope_section`;
- the indexer rotates every pooled group key at the M-RoPE position of the group's first
  token, which may lie in an earlier step. So each token's row carries its rotary cos/sin
  (`R/2 + R/2` values, in the model dtype: exactly what transformers multiplies by) after
  `[K | V | index key]`; the history's table is read back from the rows, and the indexer
  runs per sequence with that sequence's own table.

The rotary values are part of the row, hence of the KV-cache state the snapshot cache saves
and restores: a resumed prefill reads the same table a cold one wrote. Causality and the
indexer's tail still count tokens by index in the sequence (as transformers' cache does).
"""

from __future__ import annotations

import torch
from vllm.config import VllmConfig
from vllm.v1.kv_cache_interface import FullAttentionSpec

from vllm_hybridcache.flash_next.backend import QSARowsBackend, row_width
from vllm_hybridcache.flash_next.common import RopeTable
from vllm_hybridcache.flash_next.ops.interface import FlashNextOps
from vllm_hybridcache.flash_next.parallel import tp_rank_world
from vllm_hybridcache.flash_next.qsa import QSAAttention


def mrope_section(text_config) -> list[int]:
    return list((text_config.rope_parameters or {}).get("mrope_section", [11, 11, 10]))


def mrope_cos_sin(rope: RopeTable, section: list[int], positions: torch.Tensor,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin `[T, R]` for M-RoPE positions `[3, T]` (transformers' recomposition: fp32
    angles, frequency j from row t/h/w by j mod 3 within the section, cast to `dtype`)."""
    inv = rope.inv_freq.to(positions.device)
    freqs = positions.long()[..., None].float() * inv  # [3, T, R/2]
    thw = freqs[0].clone()
    for axis in (1, 2):
        idx = slice(axis, section[axis] * 3, 3)
        thw[..., idx] = freqs[axis, ..., idx]
    emb = torch.cat((thw, thw), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


class MRopeQSAAttention(QSAAttention):
    """QSAAttention whose rows also carry each token's rotary cos/sin (module docstring)."""

    def __init__(self, config, layer_idx: int, vllm_config: VllmConfig, prefix: str,
                 ops: FlashNextOps, rope: RopeTable, quant_config=None) -> None:
        super().__init__(config, layer_idx, vllm_config, prefix, ops, rope, quant_config)
        self.base_width = row_width(config, tp_rank_world()[1])
        self.rot = rope.rotary_dim
        self.width = self.base_width + self.rot
        QSARowsBackend.row_elements = self.width
        self.section = mrope_section(config)

    def get_kv_cache_spec(self, vllm_config: VllmConfig):
        size = torch.empty((), dtype=self.kv_dtype).element_size()
        return FullAttentionSpec(block_size=vllm_config.cache_config.block_size,
                                 num_kv_heads=self.num_kv_heads,
                                 head_size=self.config.head_dim, dtype=self.kv_dtype,
                                 num_head_slots=1, state_content_bytes=self.width * size)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        meta = self._metadata()
        t = x.shape[0] if meta is None else meta.num_actual_tokens
        if positions.ndim == 1:  # text-only profiling paths: the three rows agree
            positions = positions[None].expand(3, -1)
        x_t = x[:t]
        d, hkv, half = self.head_dim, self.num_kv_heads, self.rot // 2
        cos_q, sin_q = mrope_cos_sin(self.rope, self.section, positions[:, :t], x.dtype)
        cos, sin = cos_q[:, None], sin_q[:, None]

        iq, raw_k, q, gate, k, v = self._project(x_t, cos, sin)
        rows_new = torch.cat([k.reshape(t, -1), v.reshape(t, -1), raw_k,
                              cos_q[:, :half], sin_q[:, :half]], dim=-1)

        if meta is None or self.kv_cache.numel() == 0:
            rows = rows_new
            key_cu = [0, t]
            q_cu = [0, t]
            qpos = torch.arange(t)
        else:
            flat = self.kv_cache[:, 0]
            bs = meta.block_size
            flat.view(-1, self.width)[meta.slot_mapping.long()] = rows_new.to(flat.dtype)
            seq_lens = meta.seq_lens_cpu.long()
            gathered = []
            for r, n in enumerate(seq_lens.tolist()):
                p = torch.arange(n)
                blocks = meta.block_table[r, p // bs].long()
                gathered.append(flat[blocks, p % bs])
            rows = torch.cat(gathered).to(x.dtype)
            key_cu = [0, *seq_lens.cumsum(0).tolist()]
            q_cu = meta.query_start_loc_cpu.long().tolist()
            # a query's index in its sequence: the step's tokens are the sequence's last ones
            qpos = torch.cat([torch.arange(int(n) - (b - a), int(n))
                              for a, b, n in zip(q_cu[:-1], q_cu[1:], seq_lens.tolist(),
                                                 strict=True)]) if t else torch.zeros(0)
        qpos = qpos.long()
        b = self.base_width
        keys = rows[:, : hkv * d].view(-1, hkv, d)
        values = rows[:, hkv * d: 2 * hkv * d].view(-1, hkv, d)
        raw_keys = rows[:, 2 * hkv * d: b]
        cos_hist = torch.cat([rows[:, b: b + half]] * 2, dim=-1)
        sin_hist = torch.cat([rows[:, b + half: b + 2 * half]] * 2, dim=-1)
        sels = []
        for n in range(len(q_cu) - 1):  # the indexer reads one sequence's table at a time
            qa, qb, ka, kb = q_cu[n], q_cu[n + 1], key_cu[n], key_cu[n + 1]
            if qa == qb:
                continue
            sels.append(self.ops.indexer_topk(
                iq[qa:qb], raw_keys[ka:kb], torch.tensor([0, kb - ka]),
                torch.zeros(qb - qa, dtype=torch.long), qpos[qa:qb],
                self.indexer.k_layernorm.weight, cos_hist[ka:kb], sin_hist[ka:kb],
                budget=self.indexer.budget, compress_ratio=self.indexer.ratio, eps=self.eps))
        sel = torch.cat(sels) if sels else torch.zeros(0, self.indexer.budget, dtype=torch.int32)
        seq_idx = torch.repeat_interleave(torch.arange(len(q_cu) - 1),
                                          torch.tensor(q_cu[1:]) - torch.tensor(q_cu[:-1]))
        attn = self.ops.sparse_attention(q, keys, values, torch.tensor(key_cu), seq_idx, sel,
                                         self.scaling)
        result = self.o_proj(attn.reshape(t, -1) * torch.sigmoid(gate))
        if t < x.shape[0]:
            result = torch.cat([result, result.new_zeros(x.shape[0] - t, result.shape[1])])
        return result
