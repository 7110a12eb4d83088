"""CPU backend: the torch reference, with vLLM's CPU kernels where they fit.

- GDN chunked prefill in bf16 runs vLLM's C++ `chunk_gated_delta_rule_cpu` (the kernel vLLM's
  own Qwen3-Next uses on CPU; ~15x the torch reference). It asserts bf16 activations, so
  float32 (the exact path the correctness tests use) keeps the reference. Its recurrent state
  layout is [N, H, Dk, Dv] float32, like ours, updated in place on a copy we own.
- The conv ops keep the reference arithmetic (cheap), batched for decode-only steps.
- bf16 `nn.Linear` layers run through vLLM's CPU GEMM dispatch (oneDNN / packed kernels,
  the path vLLM's own linear layers take on CPU); float32 keeps torch's linear.
- Everything else is the reference.
"""

from __future__ import annotations

import torch

from vllm_hybridcache.compat import vllm_cpu_gdn_prefill, vllm_cpu_linear
from vllm_hybridcache.flash_next.ops.reference import ReferenceOps


class CpuOps(ReferenceOps):
    """Reference semantics, tuned for the CPU (see module docstring)."""

    name = "cpu"

    def prepare_model(self, model: torch.nn.Module) -> None:
        for module in model.modules():
            if type(module) is torch.nn.Linear and module.weight.dtype == torch.bfloat16:
                module.forward = vllm_cpu_linear(module)

    def gdn_chunked_prefill(self, q, k, v, g, beta, cu_seqlens, initial_state, *,
                            use_qk_l2norm=True, chunk_size=64):
        kernel = vllm_cpu_gdn_prefill() if q.dtype == torch.bfloat16 and use_qk_l2norm else None
        if kernel is None:
            return super().gdn_chunked_prefill(q, k, v, g, beta, cu_seqlens, initial_state,
                                               use_qk_l2norm=use_qk_l2norm,
                                               chunk_size=chunk_size)
        n = cu_seqlens.numel() - 1
        if initial_state is None:
            state = torch.zeros(n, q.shape[1], k.shape[-1], v.shape[-1], dtype=torch.float32)
        else:
            state = initial_state.to(torch.float32).contiguous().clone()
        out, _ = kernel(
            q.contiguous()[None], k.contiguous()[None], v.contiguous()[None],
            g.to(torch.float32).contiguous()[None], beta.to(q.dtype).contiguous()[None],
            state, True, cu_seqlens.to(torch.int32), False, True,
            torch.arange(n, dtype=torch.int32), 1e-6)
        return out[0], state

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
