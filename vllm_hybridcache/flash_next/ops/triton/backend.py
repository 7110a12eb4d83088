"""``TritonBackend``: the Flash-Next op interface (``ops.interface.FlashNextOps``) on Triton.

The interface is functional (ops return new states and never modify their inputs); the kernels
are written for vLLM's in-place state pools (``[slots, ...]`` addressed by per-sequence slot
indices, read and written by the same launch). This adapter maps one onto the other without
copies: the caller's states are the read pool (slots ``0..N-1``, or ``-1`` for "no history"),
and a freshly allocated tensor is the write pool. A layer that keeps its states in vLLM's cache
can call the ``*_varlen`` kernel functions directly with the cache and its slot indices and
save the gather/scatter.

``hc_mix`` / ``hc_inject`` stay in torch, deliberately: ``hc_mix`` is three GEMMs (down, up,
inject projections over ``hc * hidden`` features) plus a grouped RMSNorm, and the GEMMs dominate;
hipBLASLt/cuBLAS are faster at those shapes than a hand-written Triton GEMM, and the elementwise
remainder is memory bound and already fused well enough by torch. ``hc_inject`` is a single
broadcasted multiply-add.
"""

from __future__ import annotations

import torch

from vllm_hybridcache.flash_next.ops.interface import FlashNextOps
from vllm_hybridcache.flash_next.ops.reference import ReferenceOps

from .conv import causal_conv1d_varlen
from .gdn import gdn_chunked_prefill_varlen, gdn_recurrent_varlen
from .indexer import indexer_topk_varlen
from .sparse_attn import sparse_attention_packed

_TORCH = ReferenceOps()


def _slots(n: int, present: bool, device: torch.device) -> torch.Tensor:
    """Slot ``i`` for sequence ``i``, or ``-1`` everywhere when there is no state to read."""
    if present:
        return torch.arange(n, dtype=torch.int32, device=device)
    return torch.full((n,), -1, dtype=torch.int32, device=device)


def _cu(cu_seqlens: torch.Tensor, device: torch.device) -> torch.Tensor:
    return cu_seqlens.to(device=device, dtype=torch.int32, non_blocking=True)


class TritonBackend(FlashNextOps):
    """Every Flash-Next op on Triton kernels, except the hyper-connection mixer (see module).

    ``split_invariant``: a token's arithmetic must not depend on its forward step (docs/
    split-invariance.md). The kernels already compute per token or per 64-token chunk counted
    from the step start; two launch choices follow the step and are pinned in this mode:
    attention rows are never split (the flash-decoding split count follows the step's token
    count) and the indexer scores with one fixed tile (the autotuned tile follows the step's
    group count). The projections, the MoE experts and ``hc_mix`` run torch's GEMM, whose
    kernel follows the row count, so this mode gives them the split-invariant forward's GEMM
    form too (``split_invariant.tile_linear_layers``: 64-row tiles off the CPU).
    """

    name = "triton"

    def __init__(self, split_invariant: bool = False) -> None:
        self.split_invariant = split_invariant
        if split_invariant:
            self.name = "triton+split_invariant"

    def prepare_model(self, model: torch.nn.Module) -> None:
        if self.split_invariant:
            from vllm_hybridcache.flash_next.ops.split_invariant import tile_linear_layers

            tile_linear_layers(model)

    # ---------------------------------------------------------------- GDN
    def gdn_chunked_prefill(self, q, k, v, g, beta, cu_seqlens, initial_state, *,
                            use_qk_l2norm=True, chunk_size=64):
        n = cu_seqlens.numel() - 1
        h, dk, dv = v.shape[1], k.shape[-1], v.shape[-1]
        new_state = torch.empty((n, h, dk, dv), dtype=torch.float32, device=q.device)
        src = (initial_state.to(torch.float32).contiguous() if initial_state is not None
               else new_state)
        out = gdn_chunked_prefill_varlen(
            q, k, v, g, beta, src, _cu(cu_seqlens, q.device),
            _slots(n, initial_state is not None, q.device),
            new_state=new_state, out_state_slots=_slots(n, True, q.device),
            use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size)
        return out, new_state

    def gdn_recurrent_step(self, q, k, v, g, beta, state, *, use_qk_l2norm=True):
        n = q.shape[0]
        src = state.to(torch.float32).contiguous()
        new_state = torch.empty_like(src)
        cu = torch.arange(n + 1, dtype=torch.int32, device=q.device)
        slots = _slots(n, True, q.device)
        out = gdn_recurrent_varlen(q, k, v, g, beta, src, cu, slots, new_state=new_state,
                                   out_state_slots=slots, use_qk_l2norm=use_qk_l2norm)
        return out, new_state

    # ---------------------------------------------------------------- conv
    def _conv(self, x, weight, cu, conv_state, dilation, activation):
        n = cu.numel() - 1
        c, kw = weight.shape
        new_state = torch.empty((n, c, (kw - 1) * dilation), dtype=x.dtype, device=x.device)
        # transformers concatenates the history in x.dtype: cast a differently typed state once.
        src = conv_state.to(x.dtype) if conv_state is not None else new_state
        y = causal_conv1d_varlen(
            x, weight, None, src, cu, _slots(n, conv_state is not None, x.device),
            dilation=dilation, activation=activation, new_state=new_state,
            new_state_slots=_slots(n, True, x.device))
        return y, new_state

    def causal_conv1d_prefill(self, x, weight, cu_seqlens, conv_state, activation="silu"):
        return self._conv(x, weight, _cu(cu_seqlens, x.device), conv_state, 1, activation)

    def causal_conv1d_update(self, x, weight, conv_state, activation="silu"):
        cu = torch.arange(x.shape[0] + 1, dtype=torch.int32, device=x.device)
        return self._conv(x, weight, cu, conv_state, 1, activation)

    def ple_conv(self, x, weight, dilation, cu_seqlens, conv_state):
        return self._conv(x, weight, _cu(cu_seqlens, x.device), conv_state, dilation, "silu")

    # ---------------------------------------------------------------- QSA
    def indexer_topk(self, q, raw_keys, key_cu_seqlens, query_seq_idx, query_pos,
                     k_norm_weight, cos, sin, *, budget, compress_ratio, eps):
        dev = q.device
        return indexer_topk_varlen(
            q, raw_keys, _cu(key_cu_seqlens, dev), _cu(query_seq_idx, dev),
            _cu(query_pos, dev), k_norm_weight, cos.contiguous(), sin.contiguous(),
            budget=budget, compress_ratio=compress_ratio, eps=eps,
            pinned_score_tile=self.split_invariant)

    def sparse_attention(self, q, k, v, key_cu_seqlens, query_seq_idx, indices, scale):
        dev = q.device
        return sparse_attention_packed(q, k, v, _cu(key_cu_seqlens, dev),
                                       _cu(query_seq_idx, dev), _cu(indices, dev), scale,
                                       splits=1 if self.split_invariant else None)

    # ---------------------------------------------------------------- hyper-connections
    def hc_mix(self, x, norm_weight, down_weight, up_weight, inject_weight, *, hc_count, eps):
        if self.split_invariant:
            from vllm_hybridcache.flash_next.ops.split_invariant import invariant_hc_mix

            return invariant_hc_mix(_TORCH.hc_mix, x, norm_weight, down_weight, up_weight,
                                    inject_weight, hc_count=hc_count, eps=eps)
        return _TORCH.hc_mix(x, norm_weight, down_weight, up_weight, inject_weight,
                             hc_count=hc_count, eps=eps)

    def hc_inject(self, streams, block_out, inject):
        return _TORCH.hc_inject(streams, block_out, inject)


# The name ``ops.get_backend`` imports.
TritonOps = TritonBackend
