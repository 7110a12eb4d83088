"""CPU backend: the torch reference, with vLLM's CPU kernels where they fit.

vLLM's CPU GDN kernels (`chunk_gated_delta_rule_cpu`, `causal_conv1d_*_cpu`) assert bf16
activations and keep their own state layouts, and the float32 path (the one the correctness
tests use) must be exact, so the CPU backend keeps the reference arithmetic for every op and only
swaps in faster torch formulations that give the same result: a decode-only batch of the
conv ops is one batched call instead of a per-sequence loop.
"""

from __future__ import annotations

import torch

from vllm_hybridcache.flash_next.ops.reference import ReferenceOps


class CpuOps(ReferenceOps):
    """Reference semantics, tuned for the CPU (see module docstring)."""

    name = "cpu"

    def causal_conv1d_prefill(self, x, weight, cu_seqlens, conv_state, activation="silu"):
        n = cu_seqlens.numel() - 1
        if n > 0 and conv_state is not None and x.shape[0] == n:
            lengths = cu_seqlens[1:] - cu_seqlens[:-1]
            if bool((lengths == 1).all()):
                return self.causal_conv1d_update(x, weight, conv_state, activation)
        return super().causal_conv1d_prefill(x, weight, cu_seqlens, conv_state, activation)

    def ple_conv(self, x, weight, dilation, cu_seqlens, conv_state):
        n = cu_seqlens.numel() - 1
        if n > 0 and conv_state is not None and x.shape[0] == n:
            lengths = cu_seqlens[1:] - cu_seqlens[:-1]
            if bool((lengths == 1).all()):
                c, _kw = weight.shape
                seq = torch.cat([conv_state.to(x.dtype), x.unsqueeze(-1)], dim=-1)
                out = torch.nn.functional.conv1d(seq.to(weight.dtype), weight.unsqueeze(1),
                                                 None, groups=c, dilation=dilation)[..., -1]
                return torch.nn.functional.silu(out).to(x.dtype), seq[..., 1:]
        return super().ple_conv(x, weight, dilation, cu_seqlens, conv_state)
