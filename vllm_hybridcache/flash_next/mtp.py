"""The Flash-Next MTP draft layer (`Qwen4ExpMTP`) for vLLM's `--speculative-config
'{"method": "mtp", ...}'`.

There is no transformers reference for MTP; the layout and data flow follow vLLM's in-tree
Qwen4Exp MTP (checkpoint names `mtp.*`): the token embedding goes through
`pre_fc_norm_embedding` and `fc_embedding`; the target's pre-final-mixer hyper-connection
streams `[T, hc * H]` go through `pre_fc_norm_hidden` (one RMSNorm over all streams) and
`fc_hidden` (shared by the streams); the embedding is added to every stream; one QSA decoder
layer (attention + indexer, MoE, hyper-connections; no PLE) runs on them and
`mtp.hyper_connection_mixer` collapses them for the shared `lm_head`.

One deviation, forced by vLLM 0.32's CPU (V1) drafter: it hands the draft the target's
collapsed hidden state `[T, H]` (its buffer only widens to `hc * H` for DeepSeek-V4), while the
in-tree GPU path hands the pre-mixer streams. We take the collapsed state, repeated into the
`hc` streams (as the embedding is at the model input), and return the collapsed draft state,
which is also what the next draft step receives. Greedy outputs do not depend on the draft
(rejected drafts are discarded), only the acceptance rate does.

State: the MTP layer's QSA rows are one more attention-like KV-cache group (per-token rows),
registered under `mtp.layers.{num_hidden_layers}.self_attn`.

Rebuilding rows: the row the draft layer writes at position i depends only on the target's
hidden row at i, the token it is given there and i itself (K, V and the index key come from
the layer's input row; no row reads another before attention). `MTPModule.draft_rows` computes
those rows by the very code `forward` runs (`streams`, the layer's hyper-connection mix, the
attention layer's `_project`), so with inputs of the same shape it gives the same bits. The
module is registered in vLLM's static forward context as `DRAFT_HEAD` so that code outside the
model (the snapshot cache's adapter) can find it; the model itself never calls anyone.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable

import torch
from torch import nn
from vllm.config import VllmConfig

from vllm_hybridcache.compat import register_forward_layer
from vllm_hybridcache.flash_next.common import Qwen4RMSNorm, RopeTable
from vllm_hybridcache.flash_next.hyper import GatedResidual
from vllm_hybridcache.flash_next.model import DecoderLayer, load_flash_next_weights
from vllm_hybridcache.flash_next.ops import get_backend
from vllm_hybridcache.flash_next.parallel import lm_head, logits_head, tie, vocab_embedding

DRAFT_HEAD = "mtp.draft_head"  # the MTPModule's name in vLLM's static forward context


class MTPModule(nn.Module):
    def __init__(self, vllm_config: VllmConfig) -> None:
        super().__init__()
        config = vllm_config.model_config.hf_text_config
        self.config = config
        self.hidden = config.hidden_size
        self.hc_count = config.hc_count
        self.ops = get_backend(None, vllm_config=vllm_config)
        self.embed_tokens = vocab_embedding(config.vocab_size, config.hidden_size)
        self.fc_embedding = nn.Linear(self.hidden, self.hidden, bias=False)
        self.fc_hidden = nn.Linear(self.hidden, self.hidden, bias=False)
        self.pre_fc_norm_embedding = Qwen4RMSNorm(self.hidden, config.rms_norm_eps)
        self.pre_fc_norm_hidden = Qwen4RMSNorm(self.hidden * self.hc_count, config.rms_norm_eps)
        layer_cfg = copy.deepcopy(config)
        layer_cfg.layer_types = ["indexed_attention"]
        layer_cfg.ple_layer_ids = []
        self.start = config.num_hidden_layers
        self.rope = RopeTable(config.head_dim, config.rope_parameters)
        n = int(getattr(config, "mtp_num_hidden_layers", 1) or 1)
        self.layers = nn.ModuleList(
            DecoderLayer(layer_cfg, 0, vllm_config, self.ops, self.rope,
                         f"mtp.layers.{self.start + i}") for i in range(n))
        self.hyper_connection_mixer = GatedResidual(config, self.ops, use_combine=False)
        register_forward_layer(vllm_config, DRAFT_HEAD, self)

    def streams(self, input_ids, hidden_states, inputs_embeds=None) -> torch.Tensor:
        """The draft layer's input streams `[T, hc * H]`: the normed, projected token
        embedding added to every stream of the normed, projected target state."""
        e = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        e = self.fc_embedding(self.pre_fc_norm_embedding(e))
        t = e.shape[0]
        hs = hidden_states[:t].to(e.dtype)
        if hs.shape[-1] == self.hidden:  # collapsed target state (see module docstring)
            hs = hs.repeat(1, self.hc_count)
        hs = self.pre_fc_norm_hidden(hs)
        hs = self.fc_hidden(hs.view(t, self.hc_count, self.hidden))
        return (hs + e.unsqueeze(1)).flatten(1)

    def forward(self, input_ids, positions, hidden_states, inputs_embeds=None,
                spec_step_idx: int = 0) -> torch.Tensor:
        streams = self.streams(input_ids, hidden_states, inputs_embeds)
        layer = self.layers[spec_step_idx % len(self.layers)]
        mixed, _ = self.hyper_connection_mixer(layer(streams, positions, None))
        return mixed

    @torch.inference_mode()
    def draft_rows(self, input_ids: torch.Tensor, positions: torch.Tensor,
                   hidden_states: torch.Tensor) -> dict[str, torch.Tensor]:
        """The rows `[K | V | index key]` (`[T, width]`, activation dtype) that the draft layer
        of a first draft pass writes for these inputs, by attention layer name.

        Same code as `forward` up to the rows (a row depends only on its own inputs), so rows
        computed from inputs of the shape a forward had equal that forward's rows bit for bit.
        vLLM's drafter runs the first MTP layer on every pass (it passes no step index).
        """
        streams = self.streams(input_ids, hidden_states)
        layer = self.layers[0]
        mixed, _ = layer.attn_hyper_connection(streams)
        attn = layer.self_attn
        t, pos = mixed.shape[0], positions.long()
        cos_t, sin_t = attn.rope.tables(int(pos.max()) + 1, mixed.dtype, mixed.device)
        _, raw_k, _, _, k, v = attn._project(mixed, cos_t[pos][:, None], sin_t[pos][:, None])
        return {attn.prefix: torch.cat([k.reshape(t, -1), v.reshape(t, -1), raw_k], dim=-1)}


class FlashNextMTP(nn.Module):
    """vLLM draft model for `Qwen4ExpMTP` (see module docstring)."""

    has_own_embed_tokens = False
    has_own_lm_head = False

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_text_config
        self.config = config
        self.model = MTPModule(vllm_config)
        self.lm_head = lm_head(config.vocab_size, config.hidden_size)
        self.logits = logits_head(config.vocab_size)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                hidden_states: torch.Tensor | None = None, intermediate_tensors=None,
                inputs_embeds: torch.Tensor | None = None, spec_step_idx: int = 0,
                **kwargs) -> torch.Tensor:
        return self.model(input_ids, positions, hidden_states, inputs_embeds, spec_step_idx)

    def compute_logits(self, hidden_states: torch.Tensor, spec_step_idx: int = 0):
        return self.logits(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        start = self.model.start

        def select():
            for name, tensor in weights:
                for p in ("model.language_model.", "language_model."):
                    if name.startswith(p):
                        name = "model." + name[len(p):]
                if name.startswith("mtp.layers."):
                    idx, rest = name[len("mtp.layers."):].split(".", 1)
                    # checkpoints number MTP layers from 0 or from num_hidden_layers
                    i = int(idx) - start if int(idx) >= start else int(idx)
                    yield f"model.layers.{i}.{rest}", tensor
                elif name.startswith("mtp."):
                    yield "model." + name[len("mtp."):], tensor
                elif name in ("model.embed_tokens.weight", "lm_head.weight"):
                    yield name, tensor

        loaded = load_flash_next_weights(self, select(), split_parts=1)
        if "lm_head.weight" not in loaded and self.config.tie_word_embeddings:
            tie(self.lm_head, self.model.embed_tokens)
        self.model.ops.prepare_model(self)
        return loaded
