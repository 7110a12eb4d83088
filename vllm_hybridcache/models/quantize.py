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

The second format is the one RDNA4 owners run (the R9700 has FP8 units): compressed-tensors
FP8 "dynamic" (weights float8 e4m3 per output channel, activations float8 per token, on the
fly), the format llm-compressor's FP8_DYNAMIC preset writes. vLLM's CPU backend runs its dense
linears through torch's `_scaled_mm` on every x86 machine; its FP8 fused-MoE kernel needs AMX,
so here too the routed experts stay in the float dtype.

Schemes exist for Qwen3-Next (vLLM's model) and Flash-Next's text model (this package's,
flash_next/parallel.py), by the config's `model_type`; they name the same linears for both
formats. Two checkpoints come from one float model per format: the quantized one (`w8a8`,
`fp8`) and its dequantized twin (`w8a8-dequant`, `fp8-dequant`: every quantized weight
replaced by `q * scale` in the float dtype, the config without `quantization_config`), so a
test can compare the quantized kernel against the same weights in float and see only the
activation quantization's error.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
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

FP8_MAX = 448.0
"""The largest finite float8 e4m3 value."""


def int8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output channel: (int8 [out, in], float32 scale [out, 1]) with
    `q * scale` the nearest grid point to each weight (a zero row keeps scale 1)."""
    w = weight.float()
    absmax = w.abs().amax(dim=1, keepdim=True)
    scale = torch.where(absmax > 0, absmax / 127.0, torch.ones_like(absmax))
    q = torch.clamp(torch.round(w / scale), -127, 127).to(torch.int8)
    return q, scale


def fp8_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float8 e4m3 per output channel: (float8 [out, in], float32 scale [out, 1]), each row
    scaled so its largest magnitude is e4m3's largest finite value, then rounded to the
    nearest e4m3 value (a zero row keeps scale 1)."""
    w = weight.float()
    absmax = w.abs().amax(dim=1, keepdim=True)
    scale = torch.where(absmax > 0, absmax / FP8_MAX, torch.ones_like(absmax))
    q = torch.clamp(w / scale, -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


class Format(NamedTuple):
    """A compressed-tensors format: its numbers (`type`: int or float, 8 bits), its name in
    the config, and the per-channel quantizer of its weights."""

    type: str
    config_format: str
    quantize: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


FORMATS: dict[str, Format] = {
    "w8a8": Format("int", "int-quantized", int8_per_channel),
    "fp8": Format("float", "float-quantized", fp8_per_channel),
}

MODES = tuple(m for f in FORMATS for m in (f, f"{f}-dequant"))


def quantization_config(ignore: tuple[str, ...] = SCHEMES["qwen3_next"].ignore,
                        fmt: str = "w8a8") -> dict:
    """compressed-tensors' description of a W8A8 format (`fmt`, FORMATS): symmetric 8-bit
    weights per output channel (static), symmetric 8-bit activations per token (dynamic), as
    int8 or float8 e4m3; `ignore`: the layers vLLM leaves in the float dtype."""
    kind = FORMATS[fmt].type
    return {
        "quant_method": "compressed-tensors",
        "format": FORMATS[fmt].config_format,
        "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": kind, "symmetric": True,
                        "strategy": "channel", "dynamic": False, "observer": "minmax"},
            "input_activations": {"num_bits": 8, "type": kind, "symmetric": True,
                                  "strategy": "token", "dynamic": True, "observer": None},
            "output_activations": None,
        }},
        "ignore": list(ignore),
        "kv_cache_scheme": None,
    }


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
    fmt = mode.removesuffix("-dequant")
    quantized = mode == fmt  # else the dequantized twin
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
            q, scale = FORMATS[fmt].quantize(t)
            count += 1
            if quantized:
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
    if quantized:
        config["quantization_config"] = quantization_config(scheme.ignore, fmt)
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return count
