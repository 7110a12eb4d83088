"""Sparse MoE with a gated shared expert (transformers' `Qwen4ExpTextSparseMoeBlock`).

Written in torch (per-expert gather/scatter) so it runs in float32 as well as bf16; routing
arithmetic (fp32 softmax, renormalised top-k, cast back) follows the reference exactly.

At tensor parallel size N every rank routes every token (the router is replicated) and holds
1/N of each expert's intermediate size (routed and shared experts alike: the split vLLM's
`FusedMoE` makes without expert parallelism); the block's partial output is all-reduced once.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vllm_hybridcache.flash_next.parallel import all_reduce, column, row, split_even, tp_rank_world


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


class SparseMoE(nn.Module):
    """Experts are stored fused: w13 [E, 2I, H] (gate rows then up rows), w2 [E, H, I], with
    I this rank's share of `moe_intermediate_size` (module docstring)."""

    def __init__(self, config, quant_config: Any = None, prefix: str = "") -> None:
        """quant_config: the checkpoint's, for the shared expert (linear.py); the routed
        experts, the router and the shared-expert gate stay in the float dtype."""
        super().__init__()
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        _, world = tp_rank_world()
        self.reduce = world > 1  # the ranks' partial outputs are summed once (docstring)
        inter = split_even(config.moe_intermediate_size, world, "moe_intermediate_size")
        hidden = config.hidden_size
        self.gate = Router(config)
        self.w13 = nn.Parameter(torch.empty(self.num_experts, 2 * inter, hidden))
        self.w2 = nn.Parameter(torch.empty(self.num_experts, hidden, inter))
        self.shared_expert = SharedExpertMLP(hidden, config.shared_expert_intermediate_size,
                                             quant_config, f"{prefix}.shared_expert")
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)
        # split-invariant mode (ops/split_invariant.py): run on tiles of this many rows and
        # pad every expert GEMM to it, so no GEMM's shape follows the step
        self.fixed_rows: int | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fixed_rows:
            from vllm_hybridcache.flash_next.ops.split_invariant import row_tiles

            out = row_tiles(self._forward, x, tile=self.fixed_rows)
        else:
            out = self._forward(x)
        return all_reduce(out) if self.reduce else out

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = self.shared_expert(x)
        logits = F.linear(x, self.gate.weight)
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
            gate, up = F.linear(rows, self.w13[e]).chunk(2, dim=-1)
            h = F.linear(F.silu(gate) * up, self.w2[e])[: tok.numel()] * top_w[tok, slot, None]
            # a token picks an expert at most once, so rows are distinct: same sums as
            # transformers' index_add_ (expert order kept), without its slow CPU path
            out[tok] += h.to(out.dtype)
        return out + torch.sigmoid(self.shared_expert_gate(x)) * shared
