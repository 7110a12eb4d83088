"""Sparse MoE with a gated shared expert (transformers' `Qwen4ExpTextSparseMoeBlock`).

Written in torch (per-expert gather/scatter) so it runs in float32 as well as bf16; routing
arithmetic (fp32 softmax, renormalised top-k, cast back) follows the reference exactly.

Two builds of the routed experts, on the same rule as the projections (parallel.py,
`uses_vllm_layers`):
- TP = 1 without a checkpoint quantization: `w13` / `w2` parameters and the per-expert GEMMs
  below, the arithmetic every exactness, split-invariance and reference test was measured on;
- TP > 1 or a quantized checkpoint: vLLM's fused MoE (`FusedMoEFactory`), as vLLM's own model
  files build it: the checkpoint's quantization picks the experts' method (an ignored
  `mlp.experts` keeps them in the float dtype), expert parallelism follows vLLM's
  `--enable-expert-parallel` (each rank holds whole experts instead of a slice of every one),
  and the experts load through vLLM's expert parameter mapping (`load_experts`).

At tensor parallel size N every rank routes every token (the router is replicated) and holds
1/N of each expert's intermediate size (or, with expert parallelism, 1/N of the experts) and
of the shared expert's; the block's partial output is all-reduced once.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vllm_hybridcache.flash_next.parallel import (
    all_reduce,
    column,
    row,
    split_even,
    tp_rank_world,
    uses_vllm_layers,
)


class SharedExpertMLP(nn.Module):
    def __init__(self, hidden: int, inter: int, quant_config: Any = None,
                 prefix: str = "") -> None:
        super().__init__()
        """At TP > 1 `down_proj` leaves its partial sum to the MoE block's one all-reduce."""
        qc = quant_config
        self.gate_proj = column(hidden, inter, quant_config=qc, prefix=f"{prefix}.gate_proj")
        self.up_proj = column(hidden, inter, quant_config=qc, prefix=f"{prefix}.up_proj")
        self.down_proj = row(inter, hidden, quant_config=qc, prefix=f"{prefix}.down_proj",
                             reduce=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(config.num_experts, config.hidden_size))


def fused_experts(config, quant_config: Any, prefix: str) -> nn.Module:
    """vLLM's fused MoE for the routed experts (module docstring): softmax routing over the
    router's logits, top-k renormalised as `norm_topk_prob` says, SiLU-gated experts; the
    output left un-reduced where vLLM allows it (`SparseMoE` then reduces once)."""
    from vllm.model_executor.layers.fused_moe import FusedMoEFactory

    return FusedMoEFactory(
        num_experts=config.num_experts, top_k=config.num_experts_per_tok,
        hidden_size=config.hidden_size, intermediate_size=config.moe_intermediate_size,
        renormalize=bool(config.norm_topk_prob), scoring_func="softmax",
        quant_config=quant_config, reduce_results=False, prefix=prefix)


class SparseMoE(nn.Module):
    """Plain build: experts stored fused, w13 [E, 2I, H] (gate rows then up rows), w2
    [E, H, I], with I this rank's share of `moe_intermediate_size`. vLLM build: `experts`,
    vLLM's fused MoE (module docstring)."""

    def __init__(self, config, quant_config: Any = None, prefix: str = "") -> None:
        """quant_config: the checkpoint's, for the shared expert (linear.py) and, in the vLLM
        build, the routed experts; the router and the shared-expert gate stay in the float
        dtype."""
        super().__init__()
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        _, world = tp_rank_world()
        self.reduce = world > 1  # the ranks' partial outputs are summed once (docstring)
        hidden = config.hidden_size
        self.gate = Router(config)
        self.experts: nn.Module | None = None
        # whether the fused experts all-reduce their own output (vLLM honours an un-reduced
        # output on its late all-reduce path only): then only the shared expert's is reduced
        self.routed_reduced = False
        if uses_vllm_layers(quant_config):
            self.experts = fused_experts(config, quant_config, f"{prefix}.experts")
            self.routed_reduced = not self.experts.moe_config.skip_final_all_reduce
        else:
            inter = split_even(config.moe_intermediate_size, world, "moe_intermediate_size")
            self.w13 = nn.Parameter(torch.empty(self.num_experts, 2 * inter, hidden))
            self.w2 = nn.Parameter(torch.empty(self.num_experts, hidden, inter))
        self.shared_expert = SharedExpertMLP(hidden, config.shared_expert_intermediate_size,
                                             quant_config, f"{prefix}.shared_expert")
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)
        # split-invariant mode (ops/split_invariant.py), one of two forms: `row_linear`, a
        # GEMM whose every row's arithmetic is its own, runs the router and expert GEMMs; or
        # `fixed_rows`: run on tiles of this many rows and pad every expert GEMM to it, so no
        # GEMM's shape follows the step
        self.row_linear: Any = None
        self.fixed_rows: int | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.experts is not None:
            return self._forward_fused(x)
        if self.fixed_rows:
            from vllm_hybridcache.flash_next.ops.split_invariant import row_tiles

            out = row_tiles(self._forward, x, tile=self.fixed_rows)
        else:
            out = self._forward(x)
        return all_reduce(out) if self.reduce else out

    def _forward_fused(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x, self.gate.weight)
        routed = self.experts(hidden_states=x, router_logits=logits)
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        if self.routed_reduced:
            return routed + (all_reduce(shared) if self.reduce else shared)
        out = routed + shared
        return all_reduce(out) if self.reduce else out

    def load_experts(self, expert: int, which: str, tensor: torch.Tensor) -> list[str]:
        """One checkpoint tensor of the vLLM build's routed experts (`experts.<e>.<which>.
        weight`, `which` gate_proj / up_proj / down_proj) through vLLM's expert mapping,
        which takes this rank's slice (or skips an expert another rank holds); the names of
        the parameters it loaded, relative to this block."""
        return [f"experts.{n}" for n in
                self.experts.load_weights([(f"{expert}.{which}.weight", tensor)])]

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        linear = self.row_linear or F.linear
        shared = self.shared_expert(x)
        logits = linear(x, self.gate.weight)
        probs = torch.softmax(logits, dtype=torch.float, dim=-1)
        top_w, top_i = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        top_w = top_w.to(logits.dtype)
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            tok, slot = torch.where(top_i == e)
            if tok.numel() == 0:
                continue
            rows = x[tok]
            if self.fixed_rows:  # pad to one GEMM shape (the tile's row count)
                rows = torch.cat([rows, rows.new_zeros(self.fixed_rows - tok.numel(),
                                                       rows.shape[1])])
            gate, up = linear(rows, self.w13[e]).chunk(2, dim=-1)
            h = linear(F.silu(gate) * up, self.w2[e])[: tok.numel()] * top_w[tok, slot, None]
            # a token picks an expert at most once, so rows are distinct: same sums as
            # transformers' index_add_ (expert order kept), without its slow CPU path
            out[tok] += h.to(out.dtype)
        return out + torch.sigmoid(self.shared_expert_gate(x)) * shared
