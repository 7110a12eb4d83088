"""The writer of the embedded quantized checkpoints (`models/quantize.py`), without vLLM: the
int8 and float8 e4m3 grids per output channel, what it rewrites in a folder, and its refusals."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from vllm_hybridcache.models.quantize import (
    FP8_MAX,
    fp8_per_channel,
    int8_per_channel,
    quantize_checkpoint,
)


def _rows_with_a_zero_row() -> torch.Tensor:
    """Six seeded rows of 32 weights, row 3 all zeros (its scale must stay 1)."""
    w = torch.randn(6, 32, generator=torch.Generator().manual_seed(0))
    w[3] = 0.0
    return w


def test_int8_per_channel_is_the_nearest_grid_point_of_each_row():
    w = _rows_with_a_zero_row()
    q, scale = int8_per_channel(w)
    assert q.dtype == torch.int8 and scale.shape == (6, 1)
    err = (q.float() * scale - w).abs()
    assert bool((err <= scale / 2 + 1e-7).all())
    live = [0, 1, 2, 4, 5]
    assert q[live].abs().amax(dim=1).tolist() == [127] * 5       # each row's absmax on the grid
    assert scale[3].item() == 1.0 and not q[3].any()             # a zero row stays zero


def test_fp8_per_channel_rounds_each_row_to_the_nearest_e4m3_value():
    w = _rows_with_a_zero_row()
    q, scale = fp8_per_channel(w)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (6, 1)
    live = [0, 1, 2, 4, 5]
    assert q[live].float().abs().amax(dim=1).tolist() == [FP8_MAX] * 5  # absmax at e4m3's max
    assert scale[3].item() == 1.0 and not q[3].float().any()           # a zero row stays zero
    # nearest: within half of e4m3's spacing there (3 mantissa bits; subnormal below 2^-6)
    scaled = w / scale
    exponent = torch.floor(torch.log2(scaled.abs().clamp_min(2.0 ** -6)))
    half_step = torch.exp2(exponent - 3) / 2
    assert bool(((q.float() - scaled).abs() <= half_step).all())
    # negative control: truncation toward zero breaks that bound somewhere
    trunc = torch.sign(scaled) * torch.floor(scaled.abs() / (2 * half_step)) * (2 * half_step)
    assert not bool(((trunc - scaled).abs() <= half_step).all())


def test_fp8_writes_float8_weights_and_the_float_format(tmp_path):
    before = _folder(tmp_path)
    assert quantize_checkpoint(tmp_path, "fp8") == 1
    after = load_file(str(tmp_path / "model.safetensors"))
    name = "model.layers.0.linear_attn.in_proj_qkvz.weight"
    q, scale = fp8_per_channel(before[name])
    assert after[name].dtype == torch.float8_e4m3fn
    assert torch.equal(after[name].float(), q.float())
    assert torch.equal(after[name.replace("weight", "weight_scale")], scale)
    config = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert config["format"] == "float-quantized"
    group = config["config_groups"]["group_0"]
    assert group["weights"]["type"] == group["input_activations"]["type"] == "float"
    assert group["input_activations"]["dynamic"] is True
    assert "re:.*\\.mlp\\.experts.*" in config["ignore"]


def _folder(tmp_path):
    tensors = {
        "model.layers.0.linear_attn.in_proj_qkvz.weight": torch.randn(16, 8).bfloat16(),
        "model.layers.0.linear_attn.in_proj_ba.weight": torch.randn(4, 8).bfloat16(),
        "model.layers.0.mlp.experts.0.up_proj.weight": torch.randn(8, 8).bfloat16(),
        "model.layers.0.input_layernorm.weight": torch.randn(8).bfloat16(),
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_next"}))
    return tensors


def test_w8a8_rewrites_only_the_targets_and_names_the_format(tmp_path):
    before = _folder(tmp_path)
    assert quantize_checkpoint(tmp_path, "w8a8") == 1
    after = load_file(str(tmp_path / "model.safetensors"))
    name = "model.layers.0.linear_attn.in_proj_qkvz.weight"
    assert after[name].dtype == torch.int8
    assert after[name.replace("weight", "weight_scale")].shape == (16, 1)
    for kept in set(before) - {name}:
        assert torch.equal(after[kept], before[kept])
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "compressed-tensors"
    assert "re:.*\\.mlp\\.experts.*" in config["quantization_config"]["ignore"]


@pytest.mark.parametrize("fmt, grid", [("w8a8", int8_per_channel), ("fp8", fp8_per_channel)])
def test_the_dequantized_twin_holds_the_grid_in_the_float_dtype(tmp_path, fmt, grid):
    before = _folder(tmp_path)
    quantize_checkpoint(tmp_path, f"{fmt}-dequant")
    name = "model.layers.0.linear_attn.in_proj_qkvz.weight"
    after = load_file(str(tmp_path / "model.safetensors"))[name]
    q, scale = grid(before[name])
    assert after.dtype == torch.bfloat16
    assert torch.equal(after, (q.float() * scale).bfloat16())
    assert not torch.equal(after, before[name])                    # it did move the weights
    assert "quantization_config" not in json.loads((tmp_path / "config.json").read_text())


def test_refusals(tmp_path):
    _folder(tmp_path)
    with pytest.raises(ValueError, match="unknown quantization mode"):
        quantize_checkpoint(tmp_path, "int4")
    (tmp_path / "model.safetensors").unlink()
    save_file({"lm_head.weight": torch.zeros(4, 4)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="matches the W8A8 targets"):
        quantize_checkpoint(tmp_path, "w8a8")
