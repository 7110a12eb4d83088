"""Hyper-connections: `hc_count` residual streams, mixed into one block input and re-injected."""

from __future__ import annotations

import torch
from torch import nn

from vllm_hybridcache.flash_next.common import Qwen4RMSNorm
from vllm_hybridcache.flash_next.ops.interface import FlashNextOps


class GatedResidual(nn.Module):
    """transformers' `Qwen4ExpTextGatedResidual` (same parameter names), through `ops.hc_mix`."""

    def __init__(self, config, ops: FlashNextOps, use_combine: bool = True) -> None:
        super().__init__()
        self.ops = ops
        self.hc_count = config.hc_count
        hc_hidden = config.hc_count * config.hidden_size
        self.eps = config.rms_norm_eps
        self.hc_norm = Qwen4RMSNorm(hc_hidden, config.rms_norm_eps, group_size=config.hidden_size)
        self.input_mix_weight_down = nn.Linear(hc_hidden, config.hc_lowrank, bias=False)
        self.input_mix_weight_up = nn.Linear(config.hc_lowrank, hc_hidden, bias=False)
        self.block_inject_weight = (nn.Linear(hc_hidden, config.hc_count, bias=False)
                                    if use_combine else None)

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.ops.hc_mix(
            streams, self.hc_norm.weight, self.input_mix_weight_down.weight,
            self.input_mix_weight_up.weight,
            None if self.block_inject_weight is None else self.block_inject_weight.weight,
            hc_count=self.hc_count, eps=self.eps)
