"""Flash-Next's dense projections, quantized when the checkpoint is (issue 30).

Why two kinds: without a quantization config a projection stays a plain `nn.Linear` (the
arithmetic every exactness and reference test of this model was measured on; the CPU backend
swaps in vLLM's CPU GEMM for bf16, ops/cpu.py). With one (`vllm_config.quant_config`, e.g. a
compressed-tensors W8A8 checkpoint from models/quantize.py) it is vLLM's `ReplicatedLinear`,
which asks the config for its quantization method: the layer then holds what the checkpoint
holds (int8 weights and their scales, loaded through the parameters' own `weight_loader`) and
runs vLLM's kernel for it (oneDNN int8 scaled-mm on CPU). A layer the config ignores gets
vLLM's unquantized method. Tensor parallel sharding of these layers is not built yet: the
model runs at TP = 1.
"""

from __future__ import annotations

from typing import Any

from torch import nn


def dense(in_features: int, out_features: int, *, bias: bool = False,
          quant_config: Any = None, prefix: str = "") -> nn.Module:
    """A projection `x -> x W^T (+ b)`: `nn.Linear`, or vLLM's `ReplicatedLinear` under
    `quant_config` (its checkpoint name `prefix`, which the config's targets and ignore list
    match)."""
    if quant_config is None:
        return nn.Linear(in_features, out_features, bias=bias)
    from vllm.model_executor.layers.linear import ReplicatedLinear

    return ReplicatedLinear(in_features, out_features, bias=bias, quant_config=quant_config,
                            prefix=prefix, return_bias=False)
