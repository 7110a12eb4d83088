"""Gated DeltaNet layer (transformers' `Qwen4ExpTextGatedDeltaNet`) as a vLLM state layer.

Its per-sequence state is a fixed-size section described by one vLLM `MambaSpec`:
(conv tail [conv_dim, K - 1] in the model dtype, recurrent state [Hv, Dk, Dv] in float32),
and, when the decoder layer has PLE, the PLE sections too: (n-gram context ids [ngram - 1]
int64, PLE conv inputs [hc * H, (K_ple - 1) * ngram] in the model dtype). vLLM allocates one
state block per request (`mamba_cache_mode="none"`) and hands us its index; the layer gathers
the states of the batch, runs the ops and scatters the new states back.

Inner captures (docs/split-invariance.md): when the kernel backend is split-invariant at
64-aligned positions, the adapter may inject an `InnerCapture` hook (inner_capture.py). For a
prefilling request whose state slot the hook names, the layer runs its conv and chunked GDN
ops piece by piece, cut at the hook's offsets (multiples of 64 from the step's start): the
same arithmetic a step ending there performs, since the chunks are counted from each call's
start. The state after each piece is handed to the hook; the layer never sees the cache.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

from vllm_hybridcache.compat import layer_attn_metadata, register_forward_layer
from vllm_hybridcache.flash_next.common import SectionBatch, section_batch
from vllm_hybridcache.flash_next.ops.interface import FlashNextOps
from vllm_hybridcache.flash_next.parallel import (
    column,
    parts_loader,
    row,
    split_even,
    tp_rank_world,
)
from vllm_hybridcache.flash_next.ple import PLE
from vllm_hybridcache.inner_capture import InnerCapture, capture_pieces


def gdn_heads(config, world: int = 1) -> tuple[int, int]:
    """(key heads, value heads) one of `world` tensor parallel ranks holds."""
    return (split_even(config.linear_num_key_heads, world, "linear_num_key_heads"),
            split_even(config.linear_num_value_heads, world, "linear_num_value_heads"))


def gdn_state_shapes(config, world: int = 1) -> list[tuple[int, ...]]:
    """One rank's GDN sections (conv tail, recurrent state): its heads only."""
    k_heads, v_heads = gdn_heads(config, world)
    key_dim = config.linear_key_head_dim * k_heads
    value_dim = config.linear_value_head_dim * v_heads
    conv_dim = 2 * key_dim + value_dim
    return [(conv_dim, config.linear_conv_kernel_dim - 1),
            (v_heads, config.linear_key_head_dim, config.linear_value_head_dim)]


def ple_state_shapes(config) -> list[tuple[int, ...]]:
    """The PLE sections (replicated on every tensor parallel rank, parallel.py)."""
    hc_hidden = config.hidden_size * config.hc_count
    return [(config.ngram_size - 1,),
            (hc_hidden, (config.ple_conv_kernel_size - 1) * config.ngram_size)]


def section_dtypes(model_dtype: torch.dtype, with_ple: bool) -> tuple[torch.dtype, ...]:
    """Conv tails keep the activation dtype (as transformers' cache does); the recurrent
    state is always float32; n-gram context ids are int64."""
    base = (model_dtype, torch.float32)
    return (*base, torch.int64, model_dtype) if with_ple else base


class GatedNormSigmoidOrSilu(nn.Module):
    """transformers' `Qwen4ExpTextRMSNormGated` (weight * norm(x), times act(gate) in fp32)."""

    def __init__(self, dim: int, eps: float, activation: str) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.activation = activation

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * xf.to(dtype)
        act = torch.sigmoid if self.activation == "sigmoid" else F.silu
        return (out * act(gate.float())).to(dtype)


class GatedDeltaNet(nn.Module, MambaBase):
    """One GDN mixer; owns the state sections of its decoder layer (GDN, and PLE if any)."""

    def __init__(self, config, layer_idx: int, vllm_config: VllmConfig, prefix: str,
                 ops: FlashNextOps, ple: PLE | None, quant_config: Any = None) -> None:
        """quant_config: the checkpoint's (parallel.py); the small gate projections
        (`in_proj_b`, `in_proj_a`: one column per value head) stay in the float dtype. At
        TP > 1 this rank holds its share of the key and value heads (parallel.py)."""
        super().__init__()
        self.ops = ops
        self.prefix = prefix
        self.layer_idx = layer_idx
        self.model_dtype = vllm_config.model_config.dtype
        self.cache_config = vllm_config.cache_config
        _, world = tp_rank_world()
        self.num_k_heads, self.num_v_heads = gdn_heads(config, world)
        self.head_k_dim = config.linear_key_head_dim
        self.head_v_dim = config.linear_value_head_dim
        self.key_dim = self.head_k_dim * self.num_k_heads
        self.value_dim = self.head_v_dim * self.num_v_heads
        self.conv_kernel = config.linear_conv_kernel_dim
        full_k = self.head_k_dim * config.linear_num_key_heads
        full_v = self.head_v_dim * config.linear_num_value_heads
        full_heads = config.linear_num_value_heads
        conv_parts = (full_k, full_k, full_v)
        qc, h = quant_config, config.hidden_size
        self.in_proj_qkv = column(h, sum(conv_parts), quant_config=qc, parts=conv_parts,
                                  prefix=f"{prefix}.in_proj_qkv")
        self.in_proj_z = column(h, full_v, quant_config=qc, prefix=f"{prefix}.in_proj_z")
        self.in_proj_b = column(h, full_heads, prefix=f"{prefix}.in_proj_b")
        self.in_proj_a = column(h, full_heads, prefix=f"{prefix}.in_proj_a")
        conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_weight = nn.Parameter(torch.zeros(conv_dim, self.conv_kernel))
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        if world > 1:  # the checkpoint holds every head: load this rank's
            self.conv_weight.weight_loader = parts_loader(conv_parts)
            self.dt_bias.weight_loader = parts_loader((full_heads,))
            self.A_log.weight_loader = parts_loader((full_heads,))
        self.norm = GatedNormSigmoidOrSilu(self.head_v_dim, config.rms_norm_eps,
                                           config.output_gate_type or config.hidden_act)
        self.out_proj = row(full_v, h, quant_config=qc, prefix=f"{prefix}.out_proj")
        # PLE runs before the mixer in the decoder layer, but its state lives here.
        self.ple_state_owner = ple is not None
        self._shapes = gdn_state_shapes(config, world) + (ple_state_shapes(config) if ple else [])
        self.kv_cache = (torch.tensor([]),)
        # injected by the adapter when the backend is split-invariant; None otherwise
        self.inner_capture: InnerCapture | None = None
        register_forward_layer(vllm_config, prefix, self)

    # ------------------------------------------------------------------ MambaBase
    @property
    def mamba_type(self) -> MambaAttentionBackendEnum:
        # The short-conv metadata (state slot, initial-state flag, query offsets per request)
        # is all a section layer needs; the arithmetic is ours.
        return MambaAttentionBackendEnum.SHORT_CONV

    def get_state_shape(self) -> list[tuple[int, ...]]:
        return self._shapes

    def get_state_dtype(self) -> tuple[torch.dtype, ...]:
        return section_dtypes(self.model_dtype, self.ple_state_owner)

    # ------------------------------------------------------------------ batch/state helpers
    def batch(self, num_tokens: int) -> SectionBatch:
        meta = layer_attn_metadata(self.prefix)
        b = section_batch(meta, num_tokens)
        if b is None:  # profiling / dummy run: one stateless sequence
            return SectionBatch(cu_seqlens=torch.tensor([0, num_tokens]),
                                read_slots=torch.zeros(1, dtype=torch.long),
                                has_state=torch.zeros(1, dtype=torch.bool), num_decodes=0,
                                dec_cols=torch.zeros(0, 1, dtype=torch.long),
                                num_tokens=num_tokens)
        return b

    def has_cache(self) -> bool:
        return len(self.kv_cache) >= 2 and self.kv_cache[0].numel() > 0

    def load_states(self, b: SectionBatch, idx: int) -> torch.Tensor | None:
        """Gather state `idx` of the batch's requests; zeros where a request starts fresh."""
        if not self.has_cache() or b.read_slots.numel() == 0:
            return None
        st = self.kv_cache[idx][b.read_slots].clone()
        fresh = ~b.has_state.to(st.device)
        if bool(fresh.any()):
            st[fresh] = 0
        return st

    def store_prefill_states(self, b: SectionBatch, idx: int, value: torch.Tensor) -> None:
        """Final states of the prefill requests (rows num_decodes.. of `value`)."""
        nd = b.num_decodes
        if self.has_cache() and b.num_reqs > nd:
            self.kv_cache[idx][b.read_slots[nd:]] = value[nd:].to(self.kv_cache[idx].dtype)

    def store_decode_step(self, b: SectionBatch, idx: int, rows: torch.Tensor, step: int,
                          value: torch.Tensor) -> None:
        """State of decode requests `rows` after their `step`-th token of this step."""
        if self.has_cache() and rows.numel():
            cache = self.kv_cache[idx]
            cache[b.dec_cols[rows, step]] = value.to(cache.dtype)

    @staticmethod
    def decode_steps(b: SectionBatch):
        """(step j, decode request rows with a j-th token, that token's index) tuples."""
        nd = b.num_decodes
        if nd == 0:
            return
        cu = b.cu_seqlens[: nd + 1]
        lens = cu[1:] - cu[:-1]
        for j in range(int(lens.max())):
            rows = torch.nonzero(lens > j).flatten()
            yield j, rows, cu[rows] + j

    def ple_contexts(self, b: SectionBatch, ctx_len: int, eos: int, device) -> torch.Tensor:
        st = self.load_states(b, 2)
        fresh = torch.full((b.num_reqs, ctx_len), eos, dtype=torch.long, device=device)
        if st is None:
            return fresh
        return torch.where(b.has_state.to(device)[:, None], st.long(), fresh)

    # ------------------------------------------------------------------ forward
    def _split_heads(self, mixed: torch.Tensor):
        t = mixed.shape[0]
        q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(t, self.num_k_heads, self.head_k_dim)
        k = k.reshape(t, self.num_k_heads, self.head_k_dim)
        v = v.reshape(t, self.num_v_heads, self.head_v_dim)
        rep = self.num_v_heads // self.num_k_heads
        if rep > 1:
            q = q.repeat_interleave(rep, dim=1)
            k = k.repeat_interleave(rep, dim=1)
        return q, k, v

    def forward(self, x: torch.Tensor, b: SectionBatch) -> torch.Tensor:
        t = b.num_tokens
        mixed = self.in_proj_qkv(x[:t])
        z = self.in_proj_z(x[:t])
        beta = self.in_proj_b(x[:t]).sigmoid()
        a = self.in_proj_a(x[:t])
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)

        nd, n = b.num_decodes, b.num_reqs
        conv_state = self.load_states(b, 0)
        ssm_state = self.load_states(b, 1)
        if conv_state is None:
            conv_state = mixed.new_zeros(n, mixed.shape[1], self.conv_kernel - 1)
            ssm_state = torch.zeros(n, self.num_v_heads, self.head_k_dim, self.head_v_dim,
                                    dtype=torch.float32, device=x.device)
        out = mixed.new_empty(t, self.num_v_heads, self.head_v_dim)
        # decodes (one token, or 1 + drafts with MTP): token by token, states per column
        for j, rows, tok in self.decode_steps(b):
            y, cs = self.ops.causal_conv1d_update(mixed[tok], self.conv_weight,
                                                  conv_state[rows], "silu")
            q, k, v = self._split_heads(y)
            o, ss = self.ops.gdn_recurrent_step(q, k, v, g[tok], beta[tok], ssm_state[rows])
            out[tok] = o
            conv_state[rows], ssm_state[rows] = cs, ss
            self.store_decode_step(b, 0, rows, j, cs)
            self.store_decode_step(b, 1, rows, j, ss)
        if n > nd and self.wants_inner(b):
            self._prefill_in_pieces(b, mixed, g, beta, conv_state, ssm_state, out)
            self.store_prefill_states(b, 0, conv_state)
            self.store_prefill_states(b, 1, ssm_state)
        elif n > nd:
            t0 = int(b.cu_seqlens[nd])
            cu = b.cu_seqlens[nd:] - t0
            y, cs = self.ops.causal_conv1d_prefill(mixed[t0:], self.conv_weight, cu,
                                                   conv_state[nd:], "silu")
            q, k, v = self._split_heads(y)
            o, ss = self.ops.gdn_chunked_prefill(q, k, v, g[t0:], beta[t0:], cu,
                                                 ssm_state[nd:])
            out[t0:] = o
            conv_state[nd:], ssm_state[nd:] = cs, ss
            self.store_prefill_states(b, 0, conv_state)
            self.store_prefill_states(b, 1, ssm_state)
        core = self.norm(out.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
        return self.out_proj(core.reshape(t, self.value_dim))

    # ------------------------------------------------------------------ inner captures
    def wants_inner(self, b: SectionBatch) -> bool:
        """Whether a prefilling request of this batch wants states inside the step."""
        if self.inner_capture is None or not self.has_cache():
            return False
        cu = b.cu_seqlens.tolist()
        return any(len(capture_pieces(self.inner_capture, int(b.read_slots[i]),
                                      cu[i + 1] - cu[i])) > 1
                   for i in range(b.num_decodes, b.num_reqs))

    def _prefill_in_pieces(self, b: SectionBatch, mixed, g, beta, conv_state, ssm_state,
                           out) -> None:
        """Prefill request by request, each cut at its wanted offsets; hand the states after
        every inner piece to the hook (module docstring)."""
        cu = b.cu_seqlens.tolist()
        for i in range(b.num_decodes, b.num_reqs):
            slot = int(b.read_slots[i])
            start = cu[i]
            prev = 0
            for end in capture_pieces(self.inner_capture, slot, cu[i + 1] - cu[i]):
                lo, hi = start + prev, start + end
                one = torch.tensor([0, hi - lo])
                y, cs = self.ops.causal_conv1d_prefill(mixed[lo:hi], self.conv_weight, one,
                                                       conv_state[i:i + 1], "silu")
                q, k, v = self._split_heads(y)
                o, ss = self.ops.gdn_chunked_prefill(q, k, v, g[lo:hi], beta[lo:hi], one,
                                                     ssm_state[i:i + 1])
                out[lo:hi] = o
                conv_state[i:i + 1], ssm_state[i:i + 1] = cs, ss
                if end < cu[i + 1] - cu[i]:
                    dtypes = self.get_state_dtype()
                    self.inner_capture.put(self.prefix, slot, end, 0, cs[0].to(dtypes[0]))
                    self.inner_capture.put(self.prefix, slot, end, 1, ss[0].to(dtypes[1]))
                prev = end
