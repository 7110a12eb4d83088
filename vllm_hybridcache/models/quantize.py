"""Quantized twins of the embedded checkpoints, written from their float weights.

Why: R9700 owners serve models of this class quantized, and the cache must stay exact there
(its state parts are the model's own activations, so a quantized linear changes what a link
holds, never how it is captured or restored). vLLM's CPU backend runs one int8 format on every
x86 machine: compressed-tensors W8A8 int8 (weights int8 per output channel, activations int8
per token, quantized on the fly) through its oneDNN scaled-mm kernel. Its 4-bit WNA16 kernel
and its quantized fused-MoE kernel are missing from the AVX2 build (`_C_AVX2` has no
`cpu_gemm_wna16`, and quantized experts need AMX), so the routed experts stay in the float
dtype (`ignore`), as the small projections do (the router, the shared-expert gate, the GDN
`in_proj_ba` with its one column per value head).

Schemes exist for Qwen3-Next (vLLM's model) and Flash-Next's text model (this package's,
flash_next/parallel.py), by the config's `model_type`. Two checkpoints come from one float
model: the int8 one (`w8a8`) and its dequantized twin
(`w8a8-dequant`: every quantized weight replaced by `int8 * scale` in the float dtype, the
config without `quantization_config`), so a test can compare the quantized kernel against the
same weights in float and see only the activation quantization's error.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import NamedTuple

import torch


class Scheme(NamedTuple):
    """Which linears of one architecture W8A8 quantizes (checkpoint names), and what vLLM must
    leave in the float dtype (vLLM module names, the config's `ignore`)."""

    targets: re.Pattern[str]
    ignore: tuple[str, ...]


SCHEMES: dict[str, Scheme] = {
    # Qwen3-Next (vLLM's own model): every dense projection it builds with the model's
    # `quant_config`, less the ignored ones (its AVX2 CPU build runs no quantized MoE, and the
    # small projections gain nothing)
    "qwen3_next": Scheme(
        re.compile(r"\.(linear_attn\.(in_proj_qkvz|out_proj)"
                   r"|self_attn\.(q_proj|k_proj|v_proj|o_proj)"
                   r"|mlp\.shared_expert\.(gate_proj|up_proj|down_proj))\.weight$"),
        ("lm_head", "re:.*\\.mlp\\.experts.*", "re:.*\\.mlp\\.gate$",
         "re:.*\\.shared_expert_gate$", "re:.*\\.in_proj_ba$")),
    # Flash-Next (this package's model, flash_next/parallel.py): the projections it builds with
    # the checkpoint's `quant_config`, in the main model's layers (the MTP layer and the vision
    # tower stay in the float dtype)
    "qwen4_exp_text": Scheme(
        re.compile(r"^model\.layers\.\d+\.(linear_attn\.(in_proj_qkv|in_proj_z|out_proj)"
                   r"|self_attn\.(q_proj|k_proj|v_proj|o_proj)"
                   r"|mlp\.shared_expert\.(gate_proj|up_proj|down_proj))\.weight$"),
        ("lm_head", "re:.*\\.mlp\\.experts.*")),
}

MODES = ("w8a8", "w8a8-dequant")


def quantization_config(ignore: tuple[str, ...] = SCHEMES["qwen3_next"].ignore) -> dict:
    """compressed-tensors' description of W8A8 int8: symmetric int8 weights per output
    channel (static), symmetric int8 activations per token (dynamic); `ignore`: the layers
    vLLM leaves in the float dtype."""
    return {
        "quant_method": "compressed-tensors",
        "format": "int-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "int", "symmetric": True,
                        "strategy": "channel", "dynamic": False, "observer": "minmax"},
            "input_activations": {"num_bits": 8, "type": "int", "symmetric": True,
                                  "strategy": "token", "dynamic": True, "observer": None},
            "output_activations": None,
        }},
        "ignore": list(ignore),
        "kv_cache_scheme": None,
    }


def int8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output channel: (int8 [out, in], float32 scale [out, 1]) with
    `q * scale` the nearest grid point to each weight (a zero row keeps scale 1)."""
    w = weight.float()
    absmax = w.abs().amax(dim=1, keepdim=True)
    scale = torch.where(absmax > 0, absmax / 127.0, torch.ones_like(absmax))
    q = torch.clamp(torch.round(w / scale), -127, 127).to(torch.int8)
    return q, scale


def quantize_checkpoint(folder: Path, mode: str) -> int:
    """Rewrite the float checkpoint in `folder` in place as `mode` (module docstring); the
    number of weights quantized. Every safetensors file of the folder is rewritten, the index
    (if any) follows the new tensor names."""
    from safetensors.torch import load_file, save_file

    if mode not in MODES:
        raise ValueError(f"unknown quantization mode {mode!r}; known: {', '.join(MODES)}")
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    model_type = config.get("model_type", "")
    if model_type not in SCHEMES:
        raise ValueError(f"no W8A8 scheme for model type {model_type!r}; known: "
                         f"{', '.join(SCHEMES)}")
    scheme = SCHEMES[model_type]
    count = 0
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text()) if index_path.exists() else None
    for path in sorted(folder.glob("*.safetensors")):
        tensors = load_file(str(path))
        out: dict[str, torch.Tensor] = {}
        for name, t in tensors.items():
            if t.dim() != 2 or not scheme.targets.search(name):
                out[name] = t
                continue
            q, scale = int8_per_channel(t)
            count += 1
            if mode == "w8a8":
                out[name] = q
                out[name.removesuffix("weight") + "weight_scale"] = scale
                if index is not None:
                    index["weight_map"][name.removesuffix("weight") + "weight_scale"] = path.name
            else:
                out[name] = (q.float() * scale).to(t.dtype)
        save_file(out, str(path), metadata={"format": "pt"})
    if index is not None:
        index["weight_map"] = dict(sorted(index["weight_map"].items()))
        index_path.write_text(json.dumps(index, indent=2) + "\n")
    if count == 0:
        raise ValueError(f"no weight of {folder} matches the W8A8 targets")
    if mode == "w8a8":
        config["quantization_config"] = quantization_config(scheme.ignore)
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return count
