"""Flash-Next (HF `qwen4_exp`) for vLLM: decoder, model, causal-LM head and weight loading.

Module and parameter names mirror transformers' `Qwen4ExpForCausalLM`, so the HF checkpoint
loads by name; the few layout differences (fused experts, the split n-gram embedding shards,
conv weights without the channel axis, the multimodal prefix) are handled in `load_weights`.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.models.interfaces import HasInnerState, IsHybrid
from vllm.sequence import IntermediateTensors
from vllm.v1.kv_cache_interface import MambaSpec

from vllm_hybridcache.config import FLASH_NEXT_SKIP_ENV
from vllm_hybridcache.flash_next.common import RopeTable
from vllm_hybridcache.flash_next.gdn import (
    GatedDeltaNet,
    gdn_state_shapes,
    ple_state_shapes,
    section_dtypes,
)
from vllm_hybridcache.flash_next.hyper import GatedResidual
from vllm_hybridcache.flash_next.moe import SparseMoE
from vllm_hybridcache.flash_next.ops import get_backend
from vllm_hybridcache.flash_next.ops.interface import FlashNextOps
from vllm_hybridcache.flash_next.parallel import (
    config_world,
    lm_head,
    logits_head,
    rank_slice,
    tie,
    vocab_embedding,
)
from vllm_hybridcache.flash_next.ple import PLE
from vllm_hybridcache.flash_next.qsa import QSAAttention

# Skip switch for the negative control test (a dropped component must fail the tolerance).
# Read once at model construction from VLLM_HYBRIDCACHE_FLASH_NEXT_SKIP (comma list; "ple");
# never set in production. (The indexer's negative control rewires the loaded model from the
# test instead: tests/flash_next/helpers.py.)
SKIP_ENV = FLASH_NEXT_SKIP_ENV
logger = logging.getLogger("vllm_hybridcache")


def _skips() -> set[str]:
    import os

    return {s for s in os.environ.get(SKIP_ENV, "").split(",") if s}


class DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, vllm_config: VllmConfig, ops: FlashNextOps,
                 rope: RopeTable, prefix: str,
                 attention_cls: type[QSAAttention] = QSAAttention,
                 quant_config: Any = None) -> None:
        """quant_config: the checkpoint's quantization (flash_next/parallel.py), given by the
        main model only (the MTP layer's checkpoint is not quantized)."""
        super().__init__()
        self.layer_type = config.layer_types[layer_idx]
        ple_ids = config.ple_layer_ids or []
        self.ple = (PLE(config, ple_ids.index(layer_idx + 1), ops)
                    if layer_idx + 1 in ple_ids else None)
        if self.layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(config, layer_idx, vllm_config,
                                             f"{prefix}.linear_attn", ops, self.ple,
                                             quant_config=quant_config)
        else:
            if self.ple is not None:
                raise ValueError("Flash-Next PLE is only defined on linear_attention layers")
            self.self_attn = attention_cls(config, layer_idx, vllm_config,
                                           f"{prefix}.self_attn", ops, rope,
                                           quant_config=quant_config)
        self.mlp = SparseMoE(config, quant_config, f"{prefix}.mlp")
        self.attn_hyper_connection = GatedResidual(config, ops)
        self.mlp_hyper_connection = GatedResidual(config, ops)
        self.ops = ops
        self.eos = int(config.eos_token_id[0] if isinstance(config.eos_token_id, list)
                       else config.eos_token_id)
        self.skip_ple = "ple" in _skips()

    def forward(self, h: torch.Tensor, positions: torch.Tensor,
                input_ids: torch.Tensor | None) -> torch.Tensor:
        batch = None
        if self.layer_type == "linear_attention":
            batch = self.linear_attn.batch(h.shape[0])
        if self.ple is not None and not self.skip_ple:
            if input_ids is None:
                raise ValueError("Flash-Next PLE needs token ids (inputs_embeds-only "
                                 "requests are not supported)")
            h = self._ple(h, input_ids, batch)
        mixed, inject = self.attn_hyper_connection(h)
        if self.layer_type == "linear_attention":
            t = batch.num_tokens
            out = self.linear_attn(mixed, batch)
            if t < h.shape[0]:
                out = torch.cat([out, out.new_zeros(h.shape[0] - t, out.shape[1])])
        else:
            out = self.self_attn(mixed, positions)
        h = self.ops.hc_inject(h, out, inject)
        mixed, inject = self.mlp_hyper_connection(h)
        return self.ops.hc_inject(h, self.mlp(mixed), inject)


    def _ple(self, h: torch.Tensor, input_ids: torch.Tensor, batch) -> torch.Tensor:
        """PLE with its sections (n-gram context = state 2, PLE conv = state 3 of the GDN
        layer): decodes token by token (speculative columns), prefills in one call."""
        gdn = self.linear_attn
        t, nd, n = batch.num_tokens, batch.num_decodes, batch.num_reqs
        ctx = gdn.ple_contexts(batch, self.ple.ple_embedding.context_len, self.eos, h.device)
        conv = gdn.load_states(batch, 3)
        if conv is None:
            conv = h.new_zeros(n, self.ple.hc_hidden, self.ple.state_len)
        out = h.new_zeros(t, h.shape[1])
        for j, rows, tok in gdn.decode_steps(batch):
            one = torch.arange(rows.numel() + 1)
            o, c2, k2 = self.ple(h[tok], input_ids[tok], one, ctx[rows], conv[rows])
            out[tok] = o
            ctx[rows], conv[rows] = c2, k2
            gdn.store_decode_step(batch, 2, rows, j, c2)
            gdn.store_decode_step(batch, 3, rows, j, k2)
        if n > nd and gdn.wants_inner(batch):
            self._ple_in_pieces(h, input_ids, batch, ctx, conv, out)
            gdn.store_prefill_states(batch, 2, ctx)
            gdn.store_prefill_states(batch, 3, conv)
        elif n > nd:
            t0 = int(batch.cu_seqlens[nd])
            cu = batch.cu_seqlens[nd:] - t0
            o, c2, k2 = self.ple(h[t0:t], input_ids[t0:t], cu, ctx[nd:], conv[nd:])
            out[t0:] = o
            ctx[nd:], conv[nd:] = c2, k2
            gdn.store_prefill_states(batch, 2, ctx)
            gdn.store_prefill_states(batch, 3, conv)
        return torch.cat([h[:t] + out, h[t:]]) if t < h.shape[0] else h + out

    def _ple_in_pieces(self, h, input_ids, batch, ctx, conv, out) -> None:
        """PLE of each prefilling request cut at its inner capture offsets (gdn.py, "Inner
        captures"); its sections after every inner piece go to the GDN layer's hook."""
        from vllm_hybridcache.inner_capture import capture_pieces

        gdn = self.linear_attn
        hook = gdn.inner_capture
        cu = batch.cu_seqlens.tolist()
        for i in range(batch.num_decodes, batch.num_reqs):
            slot, prev = int(batch.read_slots[i]), 0
            for end in capture_pieces(hook, slot, cu[i + 1] - cu[i]):
                lo, hi = cu[i] + prev, cu[i] + end
                o, c2, k2 = self.ple(h[lo:hi], input_ids[lo:hi], torch.tensor([0, hi - lo]),
                                     ctx[i:i + 1], conv[i:i + 1])
                out[lo:hi] = o
                ctx[i:i + 1], conv[i:i + 1] = c2, k2
                if end < cu[i + 1] - cu[i]:
                    dtypes = gdn.get_state_dtype()
                    hook.put(gdn.prefix, slot, end, 2, c2[0].to(dtypes[2]))
                    hook.put(gdn.prefix, slot, end, 3, k2[0].to(dtypes[3]))
                prev = end


class FlashNextModel(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "model",
                 ops: FlashNextOps, attention_cls: type[QSAAttention] = QSAAttention) -> None:
        super().__init__()
        config = vllm_config.model_config.hf_text_config
        self.config = config
        self.hc_count = config.hc_count
        self.embed_tokens = vocab_embedding(config.vocab_size, config.hidden_size)
        self.rope = RopeTable(config.head_dim, config.rope_parameters)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, vllm_config, ops, self.rope, f"{prefix}.layers.{i}",
                         attention_cls, quant_config=vllm_config.quant_config)
            for i in range(config.num_hidden_layers))
        self.hyper_connection_mixer = GatedResidual(config, ops, use_combine=False)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None,
                return_streams: bool = False) -> torch.Tensor | tuple[torch.Tensor,
                                                                     torch.Tensor]:
        h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        h = h.repeat(1, self.hc_count)
        for layer in self.layers:
            h = layer(h, positions, input_ids)
        mixed, _ = self.hyper_connection_mixer(h)
        return (mixed, h) if return_streams else mixed


_EXPERT_RE = re.compile(r"(.*\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_SHARD_RE = re.compile(r"(.*\.ngram_embedding)\.shard_(\d+)\.weight$")


def load_flash_next_weights(module: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                            *, split_parts: int, strip_prefixes: tuple[str, ...] = (),
                            rename: dict[str, str] | None = None,
                            skip_prefixes: tuple[str, ...] = ()) -> set[str]:
    """Load HF-layout tensors into `module` by name (see module docstring)."""
    params = dict(module.named_parameters())
    loaded: set[str] = set()
    rename = rename or {}
    for name, tensor in weights:
        if any(name.startswith(p) for p in skip_prefixes):
            continue
        for old, new in rename.items():
            if name.startswith(old):
                name = new + name[len(old):]
                break
        for p in strip_prefixes:
            if name.startswith(p):
                name = name[len(p):]
        if name.endswith(("layer_multipliers", "ngram_heads_vocab_sizes",
                          "ngram_heads_offsets")):
            buf = module.get_buffer(name)
            if not torch.equal(buf.cpu(), tensor.cpu().to(buf.dtype)):
                raise ValueError(f"{name} in the checkpoint differs from the config's hashing")
            continue
        if m := _EXPERT_RE.match(name):
            # this rank's share of the expert's intermediate size (moe.py)
            base, e, which = m.group(1), int(m.group(2)), m.group(3)
            if f"{base}.w13" not in params:  # vLLM's fused experts: its own mapping
                loaded.update(f"{base}.{n}" for n in
                              module.get_submodule(base).load_experts(e, which, tensor))
                continue
            if which == "down_proj":
                target, rows = params[f"{base}.w2"], None
                tensor = rank_slice(tensor, (tensor.shape[1],), dim=1)
            else:
                target = params[f"{base}.w13"]
                inter = target.shape[1] // 2
                rows = slice(0, inter) if which == "gate_proj" else slice(inter, 2 * inter)
                tensor = rank_slice(tensor, (tensor.shape[0],))
            with torch.no_grad():
                dst = target[e] if rows is None else target[e, rows]
                dst.copy_(tensor)
            loaded.add(f"{base}.w2" if rows is None else f"{base}.w13")
            continue
        if m := _SHARD_RE.match(name):
            target = params[f"{m.group(1)}.weight"]
            per = math.ceil(target.shape[0] / split_parts)
            start = int(m.group(2)) * per
            with torch.no_grad():
                target[start:start + tensor.shape[0]].copy_(tensor)
            loaded.add(f"{m.group(1)}.weight")
            continue
        name = name.replace(".linear_attn.conv1d.weight", ".linear_attn.conv_weight")
        name = name.replace(".ple.conv1d.weight", ".ple.conv_weight")
        if name not in params:
            raise KeyError(f"unexpected Flash-Next checkpoint tensor {name}")
        p = params[name]
        if tensor.dim() == 3 and p.dim() == 2:  # conv [C, 1, K] -> [C, K]
            tensor = tensor[:, 0]
        loader = getattr(p, "weight_loader", None)
        if loader is not None:  # a vLLM layer's parameter (quantized weights, their scales)
            loader(p, tensor)
        else:
            with torch.no_grad():
                p.copy_(tensor)
        loaded.add(name)
    return loaded


class FlashNextForCausalLM(nn.Module, HasInnerState, IsHybrid):
    """vLLM model for `Qwen4ExpForCausalLM` (and the language model of the multimodal class)."""

    # The QSA layer class: the multimodal class swaps in the M-RoPE variant (vision_qsa.py).
    attention_cls: type[QSAAttention] = QSAAttention

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_text_config
        if vllm_config.cache_config.mamba_cache_mode not in ("none", None):
            raise ValueError(
                "Flash-Next (vllm-hybridcache) keeps one recurrent state block per request; "
                "run with --no-enable-prefix-caching (the hybridcache connector is the prefix "
                f"cache), got mamba_cache_mode={vllm_config.cache_config.mamba_cache_mode!r}")
        self.config = config
        self.vllm_config = vllm_config
        self.ops = get_backend(None, vllm_config=vllm_config)
        logger.info("Flash-Next ops: %s (%s)", self.ops.name,
                    type(self).inner_capture_plan(vllm_config)[1])
        self.model = FlashNextModel(vllm_config=vllm_config, prefix="model", ops=self.ops,
                                    attention_cls=self.attention_cls)
        self.lm_head = lm_head(config.vocab_size, config.hidden_size)
        self.logits = logits_head(config.vocab_size)
        if config.tie_word_embeddings:
            tie(self.lm_head, self.model.embed_tokens)

    @classmethod
    def inner_capture_align(cls, vllm_config: Any = None) -> int:
        """64 when the engine (`vllm_config`) runs the split-invariant forward
        (`inner_capture_plan`), 0 otherwise. The adapter reads this to pick the segmentation
        mode; the model never talks to the cache."""
        return cls.inner_capture_plan(vllm_config)[0]

    @classmethod
    def inner_capture_plan(cls, vllm_config: Any = None) -> tuple[int, str]:
        """(alignment, why): 64 when this engine's kernel backend is split-invariant at
        64-aligned positions (`split_invariant.plan`: auto by default, or
        VLLM_HYBRIDCACHE_FLASH_NEXT_SPLIT_INVARIANT), so states at those positions inside a
        step can be handed to an injected capture hook (gdn.py); 0 otherwise. Also 0 for an
        engine whose projections are vLLM's layers, a quantized checkpoint or TP > 1
        (parallel.py): the split-invariant forward replaces `nn.Linear` only, so states inside
        a step are not known to equal a step ending there."""
        from vllm_hybridcache.flash_next.ops import split_invariant
        from vllm_hybridcache.inner_capture import INNER_ALIGN

        if vllm_config is not None and getattr(vllm_config, "quant_config", None) is not None:
            return 0, "a quantized checkpoint runs vLLM's linear layers"
        if (vllm_config is not None and hasattr(vllm_config, "parallel_config")
                and config_world(vllm_config) > 1):
            return 0, "TP > 1 runs vLLM's linear layers"
        on, why = split_invariant.plan(vllm_config)
        return (INNER_ALIGN if on else 0), f"split-invariant forward {'on' if on else 'off'}: {why}"

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None = None,
                inputs_embeds: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        return self.model(input_ids, positions, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.logits(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = load_flash_next_weights(
            self, weights, split_parts=int(getattr(self.config, "split_ngram_parts", 1) or 1),
            rename={"model.language_model.": "model.", "language_model.": "model."},
            skip_prefixes=("mtp.", "model.visual.", "visual.", "model.mtp."))
        self.ops.prepare_model(self)
        return loaded

    # ------------------------------------------------------------------ IsHybrid
    @classmethod
    def _sections(cls, vllm_config: VllmConfig) -> list[tuple[tuple, tuple]]:
        config = vllm_config.model_config.hf_text_config
        dtype = vllm_config.model_config.dtype
        gdn = gdn_state_shapes(config, config_world(vllm_config))  # one rank's heads
        out = [(tuple(gdn), section_dtypes(dtype, False))]
        if config.ple_layer_ids:
            out.append((tuple(gdn + ple_state_shapes(config)),
                        section_dtypes(dtype, True)))
        return out

    @classmethod
    def get_mamba_specs_from_config(cls, vllm_config: VllmConfig) -> tuple[MambaSpec, ...]:
        """Every section layout of the model (vLLM sizes the shared page from the largest)."""
        return tuple(MambaSpec(shapes=s, dtypes=d, block_size=-1)
                     for s, d in cls._sections(vllm_config))

    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: VllmConfig):
        return max(cls._sections(vllm_config),
                   key=lambda sd: MambaSpec(shapes=sd[0], dtypes=sd[1],
                                            block_size=-1).page_size_bytes)[0]

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig):
        return max(cls._sections(vllm_config),
                   key=lambda sd: MambaSpec(shapes=sd[0], dtypes=sd[1],
                                            block_size=-1).page_size_bytes)[1]

    @classmethod
    def get_mamba_state_copy_func(cls):
        from vllm.model_executor.layers.mamba.mamba_utils import MambaStateCopyFuncCalculator

        return MambaStateCopyFuncCalculator.gated_delta_net_state_copy_func()

