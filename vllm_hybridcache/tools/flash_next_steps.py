"""Run the Flash-Next model in-process, one forward step at a time, without a vLLM engine.

Why: split invariance (does a token's arithmetic depend on where its forward step starts and
how many tokens it holds?) is a property of the model's forward, and checking it through an
engine costs minutes per step pattern. This driver builds `FlashNextForCausalLM` from a
checkpoint, gives every state layer a one-request cache of its own (a GDN section slot, a QSA
row table) and feeds the metadata vLLM would build for a single prefilling request, so one
prompt can be prefilled under any step pattern in seconds and every state part compared.

It drives the production model classes and kernel backends unchanged; only the engine around
them (scheduler, block allocation, sampler) is replaced by this loop.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

QSA_BLOCK = 64  # rows per block of the stand-in QSA row table


@dataclass
class PrefillResult:
    """Logits of every prompt position and every state part after the last step."""

    logits: torch.Tensor  # [N, vocab] float32
    sections: dict[str, tuple[torch.Tensor, ...]]  # GDN layer -> (conv, recurrent[, ple...])
    rows: dict[str, torch.Tensor]  # QSA layer -> [N, row width] rows of positions 0..N-1


def load_checkpoint(path: Path) -> list[tuple[str, torch.Tensor]]:
    """Every tensor of a safetensors checkpoint folder (one file or an index of shards)."""
    from safetensors.torch import load_file

    index = path / "model.safetensors.index.json"
    files = (sorted(set(json.loads(index.read_text())["weight_map"].values()))
             if index.exists() else ["model.safetensors"])
    out: list[tuple[str, torch.Tensor]] = []
    for name in files:
        out += list(load_file(str(path / name)).items())
    return out


class FlashNextStepper:
    """One Flash-Next model with the caches of one request; `prefill(ids, steps)`."""

    def __init__(self, path: Path, *, dtype: str = "float32", ops: str = "cpu",
                 max_len: int = 4096, split_invariant: bool | None = None) -> None:
        from vllm.config import CacheConfig, ModelConfig, VllmConfig, set_current_vllm_config
        from vllm.utils.torch_utils import set_default_torch_dtype

        from vllm_hybridcache.flash_next import registration
        from vllm_hybridcache.flash_next.ops import get_backend

        registration.register()
        mc = ModelConfig(model=str(path), dtype=dtype, max_model_len=max_len,
                         enforce_eager=True)
        self.vllm_config = VllmConfig(
            model_config=mc,
            cache_config=CacheConfig(enable_prefix_caching=False, mamba_cache_mode="none"))
        self.max_len = max_len
        # as vLLM's model loader does: parameters are created in the model dtype
        with set_current_vllm_config(self.vllm_config), set_default_torch_dtype(mc.dtype):
            from vllm_hybridcache.flash_next.model import FlashNextForCausalLM

            self.model = FlashNextForCausalLM(vllm_config=self.vllm_config)
        self.use_ops(get_backend(ops, split_invariant))
        with torch.no_grad():
            self.model.load_weights(load_checkpoint(Path(path)))
        self.model.eval()
        self._bind_caches()

    # ------------------------------------------------------------------ setup
    def use_ops(self, ops) -> None:
        """Make every module of the model call `ops` (they read `self.ops` at forward time)."""
        for module in self.model.modules():
            if hasattr(module, "ops"):
                module.ops = ops

    @property
    def ops(self):
        return self.model.ops

    def state_layers(self):
        from vllm_hybridcache.flash_next.gdn import GatedDeltaNet
        from vllm_hybridcache.flash_next.qsa import QSAAttention

        gdn = {m.prefix: m for m in self.model.modules() if isinstance(m, GatedDeltaNet)}
        qsa = {m.prefix: m for m in self.model.modules() if isinstance(m, QSAAttention)}
        return gdn, qsa

    def _bind_caches(self) -> None:
        gdn, qsa = self.state_layers()
        for layer in gdn.values():
            layer.kv_cache = tuple(torch.zeros(1, *shape, dtype=dt) for shape, dt in
                                   zip(layer.get_state_shape(), layer.get_state_dtype(),
                                       strict=True))
        blocks = math.ceil(self.max_len / QSA_BLOCK)
        for layer in qsa.values():
            layer.kv_cache = torch.zeros(blocks, 1, QSA_BLOCK, layer.width, dtype=layer.kv_dtype)

    def reset(self) -> None:
        gdn, qsa = self.state_layers()
        for layer in gdn.values():
            for t in layer.kv_cache:
                t.zero_()
        for layer in qsa.values():
            layer.kv_cache.zero_()

    # ------------------------------------------------------------------ stepping
    def _metadata(self, start: int, length: int) -> dict:
        """What vLLM builds for one prefilling request whose step covers [start, start+len)."""
        from vllm_hybridcache.flash_next.backend import QSARowsMetadata

        gdn, qsa = self.state_layers()
        section = SimpleNamespace(
            num_decodes=0, num_prefills=1, query_start_loc_d=None, num_accepted_tokens=None,
            query_start_loc_p=torch.tensor([0, length], dtype=torch.int32),
            state_indices_tensor_p=torch.tensor([0], dtype=torch.int32),
            has_initial_states_p=torch.tensor([start > 0]))
        blocks = math.ceil(self.max_len / QSA_BLOCK)
        rows = QSARowsMetadata(
            num_actual_tokens=length,
            query_start_loc_cpu=torch.tensor([0, length], dtype=torch.int32),
            seq_lens_cpu=torch.tensor([start + length], dtype=torch.int32),
            block_table=torch.arange(blocks, dtype=torch.int32)[None],
            slot_mapping=torch.arange(start, start + length),
            block_size=QSA_BLOCK)
        return {**{name: section for name in gdn}, **{name: rows for name in qsa}}

    @torch.no_grad()
    def step(self, ids: list[int], start: int, length: int) -> torch.Tensor:
        """Forward positions [start, start + length) of `ids`; returns their logits (fp32)."""
        from vllm.forward_context import set_forward_context

        tokens = torch.tensor(ids[start:start + length], dtype=torch.long)
        positions = torch.arange(start, start + length)
        with set_forward_context(self._metadata(start, length), self.vllm_config):
            hidden = self.model(tokens, positions)
        return self.model.compute_logits(hidden).float()

    def prefill(self, ids: list[int], steps: list[int]) -> PrefillResult:
        """Prefill `ids` from an empty state in steps of the given lengths (sum = len(ids))."""
        if sum(steps) != len(ids) or any(s <= 0 for s in steps):
            raise ValueError(f"steps {steps} do not partition {len(ids)} tokens")
        if len(ids) > self.max_len:
            raise ValueError(f"{len(ids)} tokens exceed max_len {self.max_len}")
        self.reset()
        logits, start = [], 0
        for length in steps:
            logits.append(self.step(ids, start, length))
            start += length
        gdn, qsa = self.state_layers()
        n = len(ids)
        return PrefillResult(
            logits=torch.cat(logits),
            sections={name: tuple(t[0].clone() for t in layer.kv_cache)
                      for name, layer in gdn.items()},
            rows={name: layer.kv_cache[:, 0].reshape(-1, layer.width)[:n].clone()
                  for name, layer in qsa.items()})


def steps_of(n: int, size: int, first: int | None = None) -> list[int]:
    """Step lengths covering n tokens: an optional first step, then steps of `size`."""
    out: list[int] = []
    done = 0
    if first:
        out.append(min(first, n))
        done = out[0]
    while done < n:
        out.append(min(size, n - done))
        done += out[-1]
    return out
