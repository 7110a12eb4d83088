"""PLE: hashed n-gram embeddings, gated per stream, plus a dilated depthwise conv.

Per sequence PLE carries two pieces of state across steps: the last `ngram_size - 1` token ids
(the n-gram context, EOS-filled at the start) and the last `(kernel - 1) * ngram_size` inputs
of its conv. Both are sections of the GDN layer that hosts the PLE (see gdn.py), because vLLM
binds one cache per decoder-layer index.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from transformers.models.qwen4_exp.modeling_qwen4_exp import (
    _build_layer_multipliers,
    _find_nth_prime_after,
)

from vllm_hybridcache.flash_next.common import Qwen4RMSNorm
from vllm_hybridcache.flash_next.ops.interface import FlashNextOps


class NGramEmbedding(nn.Module):
    """transformers' `Qwen4ExpTextNGramEmbedding`, stateless: context comes in, goes out."""

    def __init__(self, config, embedding_dim: int, ple_layer_index: int) -> None:
        super().__init__()
        self.ngram_size = config.ngram_size
        self.context_len = self.ngram_size - 1
        self.heads_per_ngram = config.heads_per_ngram
        self.ngram_heads = (self.ngram_size - 1) * self.heads_per_ngram
        eos = config.eos_token_id
        self.eos_token_id = int(eos[0] if isinstance(eos, list) else eos)
        sizes, offsets, total = [], [], 0
        for head in range(self.ngram_heads):
            size = _find_nth_prime_after(config.ngram_vocab_size_base - 1,
                                         ple_layer_index * self.ngram_heads + head + 1)
            sizes.append(size)
            offsets.append(total)
            total += size
        self.register_buffer("layer_multipliers", _build_layer_multipliers(
            config.vocab_size, self.ngram_size, ple_layer_index, config.seed), persistent=False)
        self.register_buffer("ngram_heads_vocab_sizes", torch.tensor(sizes, dtype=torch.long),
                             persistent=False)
        self.register_buffer("ngram_heads_offsets", torch.tensor(offsets, dtype=torch.long),
                             persistent=False)
        div = config.make_ngram_vocab_size_divisible_by
        self.padded_vocab = math.ceil(total / div) * div
        self.ngram_embedding = nn.Embedding(self.padded_vocab, embedding_dim // self.ngram_heads)

    def shifted(self, history: torch.Tensor, num_new: int) -> list[torch.Tensor]:
        """Token `shift` places back for each of the last `num_new` positions of `history`,
        EOS when an EOS lies in between (transformers' `_shift_right_ignore_eos`)."""
        n = history.shape[0]
        pos = torch.arange(n - num_new, n, device=history.device)
        is_eos = history == self.eos_token_id
        out = [history[pos]]
        blocked = torch.zeros(num_new, dtype=torch.bool, device=history.device)
        for shift in range(1, self.ngram_size):
            if shift > 1:
                blocked = blocked | is_eos[pos - shift + 1]
            src = history[pos - shift]
            out.append(torch.where(blocked, torch.full_like(src, self.eos_token_id), src))
        return out

    def forward(self, ids: torch.Tensor, context: torch.Tensor) -> tuple[torch.Tensor,
                                                                         torch.Tensor]:
        """ids: [L] new tokens of one sequence; context: [ngram_size - 1] previous ids.

        Returns (embeddings [L, embedding_dim], new context)."""
        history = torch.cat([context.long(), ids.long()])
        shifted = self.shifted(history, ids.shape[0])
        blocks = []
        for ngram in range(2, self.ngram_size + 1):
            start = (ngram - 2) * self.heads_per_ngram
            mixed = shifted[0] * self.layer_multipliers[0]
            for position in range(1, ngram):
                term = shifted[position] * self.layer_multipliers[position]
                mixed = torch.bitwise_xor(mixed, term)
            sizes = self.ngram_heads_vocab_sizes[start:start + self.heads_per_ngram]
            offs = self.ngram_heads_offsets[start:start + self.heads_per_ngram]
            blocks.append(torch.remainder(mixed.unsqueeze(-1), sizes.view(1, -1))
                          + offs.view(1, -1))
        ngram_ids = torch.cat(blocks, dim=-1)
        emb = self.ngram_embedding(ngram_ids).flatten(-2)
        return emb, history[history.shape[0] - self.context_len:]


class PLE(nn.Module):
    """transformers' `Qwen4ExpTextPLELayer` with explicit state (parameter names kept)."""

    def __init__(self, config, ple_layer_index: int, ops: FlashNextOps) -> None:
        super().__init__()
        self.ops = ops
        self.hidden_size = config.hidden_size
        self.hc_count = config.hc_count
        hc_hidden = config.hidden_size * config.hc_count
        self.hc_hidden = hc_hidden
        self.ple_embedding = NGramEmbedding(config, config.ple_embed_dim, ple_layer_index)
        self.kernel = config.ple_conv_kernel_size
        self.dilation = config.ngram_size
        self.state_len = (self.kernel - 1) * self.dilation
        self.key_proj = nn.Linear(config.ple_embed_dim, hc_hidden, bias=False)
        self.value_proj = nn.Linear(config.ple_embed_dim, config.hidden_size, bias=False)
        eps = config.rms_norm_eps
        self.norm_key = Qwen4RMSNorm(hc_hidden, eps, group_size=config.hidden_size)
        self.norm_query = Qwen4RMSNorm(hc_hidden, eps, group_size=config.hidden_size)
        self.norm_conv = Qwen4RMSNorm(hc_hidden, eps, group_size=config.hidden_size)
        self.conv_weight = nn.Parameter(torch.zeros(hc_hidden, self.kernel))

    def forward(self, streams: torch.Tensor, ids: torch.Tensor, cu_seqlens: torch.Tensor,
                contexts: torch.Tensor, conv_states: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams: [T, hc*H]; ids: [T]; contexts: [N, ctx] int64; conv_states: [N, C, L].

        Returns (PLE output to add to the streams, new contexts, new conv states)."""
        embs, new_ctx = [], []
        cu = cu_seqlens.tolist()
        for n in range(len(cu) - 1):
            e, c = self.ple_embedding(ids[cu[n]:cu[n + 1]], contexts[n])
            embs.append(e)
            new_ctx.append(c)
        emb = torch.cat(embs).to(streams.dtype)
        key = self.norm_key(self.key_proj(emb)).unflatten(-1, (self.hc_count, self.hidden_size))
        value = self.value_proj(emb)
        query = self.norm_query(streams).unflatten(-1, (self.hc_count, self.hidden_size))
        gate = (key * query).sum(dim=-1, keepdim=True) / math.sqrt(self.hidden_size)
        gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()
        gated = torch.sigmoid(gate) * value.unsqueeze(-2)
        gated_normed = self.norm_conv(gated.flatten(-2))
        conv, new_conv = self.ops.ple_conv(gated_normed, self.conv_weight, self.dilation,
                                           cu_seqlens, conv_states)
        return gated.flatten(-2) + conv, torch.stack(new_ctx), new_conv
