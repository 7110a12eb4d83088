"""The sizing tool (vllm_hybridcache/tools/sizing.py, docs/deploy-rocm.md "Sizing") counts
what the embedded checkpoints hold, byte for byte, and what one request's state holds.

Checked without an engine: the parameters transformers builds on the meta device equal the
tensors of the written checkpoints (text, Flash-Next with its PLE buffers, a vision-language
model with its tower); the bytes of the W8A8 checkpoint (int8 projections with their float32
row scales, experts and small projections in bf16) equal the file's. The state a request holds
per rank is checked against the engine's own layout in tests/connector/test_tensor_parallel.py.
Negative controls: the text model alone misses the tower; quantizing the experts, which the
embedded recipe leaves in bf16, changes the bytes.
"""

from __future__ import annotations

import math

import pytest
from safetensors import safe_open

from vllm_hybridcache.tools import sizing

ITEMSIZE = {"BF16": 2, "F16": 2, "F32": 4, "F8_E4M3": 1, "I8": 1, "I64": 8, "I32": 4}


def checkpoint(folder) -> tuple[int, int]:
    """(elements, bytes) of a checkpoint's tensors, its MTP layer left out (transformers'
    classes do not build it)."""
    elements = nbytes = 0
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            for key in fh.keys():
                if key.startswith("mtp.") or ".mtp." in key:
                    continue
                sl = fh.get_slice(key)
                n = math.prod(sl.get_shape())
                elements += n
                nbytes += n * ITEMSIZE[sl.get_dtype()]
    return elements, nbytes


@pytest.mark.parametrize("name", ["qwen3-next-tiny", "flash-next-tiny", "qwen3.5-vl-tiny"])
def test_parameters_are_the_checkpoints_tensors(embedded_model, name):
    folder = embedded_model(name)
    groups = sizing.parameter_groups(sizing.load_config(str(folder)))
    elements, nbytes = checkpoint(folder)
    assert groups.total == elements
    # in bf16, nothing quantized: the file's bytes
    assert sizing.weight_bytes_per_rank(groups, sizing.QUANTS["bf16"], 1) == nbytes


def test_a_vision_language_model_counts_its_tower(embedded_model):
    """Negative control: the text model alone (what a causal-LM class builds) is short."""
    import torch
    from transformers import AutoModelForCausalLM

    folder = embedded_model("qwen3.5-vl-tiny")
    config = sizing.load_config(str(folder))
    with torch.device("meta"):
        text_only = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    assert text_only < checkpoint(folder)[0] == sizing.parameter_groups(config).total


def test_quantized_bytes_are_the_files(embedded_model):
    folder = embedded_model("qwen3-next-tiny-w8a8")
    groups = sizing.parameter_groups(sizing.load_config(str(folder)))
    _, nbytes = checkpoint(folder)
    w8a8 = sizing.QUANTS["w8a8"]
    # the embedded recipe keeps the routed experts in bf16 (models/quantize.py)
    assert sizing.weight_bytes_per_rank(groups, w8a8, 1, experts=False) == nbytes
    # negative control: quantizing them too is another size
    assert sizing.weight_bytes_per_rank(groups, w8a8, 1) < nbytes


def test_tensor_parallel_splits_projections_not_norms(embedded_model):
    groups = sizing.parameter_groups(sizing.load_config(str(embedded_model("qwen3-next-tiny"))))
    bf16 = sizing.QUANTS["bf16"]
    one, two = (sizing.weight_bytes_per_rank(groups, bf16, tp) for tp in (1, 2))
    kept = 2 * groups.other + groups.buffer_bytes       # on every rank
    assert two == (one - kept) / 2 + kept


def test_grouped_four_bit_bytes():
    q = sizing.QUANTS["w4a16"]
    # 256 x 256: half a byte a weight, 2 groups of 128 per row at 2.5 bytes each
    assert q.bytes_for(256, 256) == 256 * 256 / 2 + 256 * 2 * 2.5
    assert sizing.QUANTS["fp8"].bytes_for(8, 16) == 8 * 16 + 8 * 4


def test_qwen3_next_80b_preset_is_the_published_shape():
    config = sizing.load_config("preset:qwen3-next-80b-a3b")
    groups = sizing.parameter_groups(config)
    assert 79e9 < groups.total < 81e9           # Qwen3-Next-80B-A3B
    tp1, tp2 = sizing.state_bytes(config, 1), sizing.state_bytes(config, 2)
    # 12 full-attention layers, 2 kv heads of 256 in bf16: 24 KiB a token; at TP = 2 one kv
    # head a rank
    assert tp1.row == 12 * 2 * 2 * 256 * 2 and tp2.row == tp1.row // 2
    # 36 GDN layers: 32 value heads x 128 x 128 state and a conv tail of 3 x 8192, in bf16
    assert tp1.sections == 36 * (32 * 128 * 128 + 3 * 8192) * 2
    assert tp2.sections == tp1.sections // 2


def test_qwen3_5_35b_preset_and_unknown_presets():
    config = sizing.load_config("preset:qwen3.5-35b-a3b")
    assert 34.5e9 < sizing.parameter_groups(config).total < 35.5e9   # Qwen3.5-35B-A3B
    with pytest.raises(ValueError, match="unknown preset"):
        sizing.load_config("preset:nope")


def test_the_table_says_what_fits():
    config = sizing.load_config("preset:qwen3-next-80b-a3b")
    rows = sizing.table(config, [sizing.BOXES["r9700x2"]], [sizing.QUANTS["bf16"],
                                                           sizing.QUANTS["w4a16"]],
                        max_model_len=65536, max_num_seqs=8)
    fits = {(f.quant, f.tp): f for _, f in rows}
    assert not fits["bf16", 2].fits and fits["bf16", 2].kv_tokens == 0
    four = fits["w4a16", 2]
    assert four.fits and four.kv_tokens > 65536
    st = sizing.state_bytes(config, 2)
    link = 2 * (st.sections + 2048 * st.row)           # both ranks' parts of a grid link
    assert four.link_mib == link / 2 ** 20
    assert four.links == int(four.budget_gib * sizing.GIB // link) > 0
    assert four.session_gib == 32 * link / sizing.GIB   # 65536 tokens: 32 grid links
    text = sizing.render(rows, "t")
    assert "| R9700 x2 | w4a16 | 2 |" in text


def test_a_model_without_gdn_layers_is_refused():
    from transformers import LlamaConfig

    with pytest.raises(ValueError, match="linear_attention"):
        sizing.state_bytes(LlamaConfig(num_hidden_layers=2), 1)


def test_cli_reports_errors_and_the_table(capsys, tmp_path):
    assert sizing.main([str(tmp_path / "missing")]) == 2
    assert "no checkpoint folder or config.json" in capsys.readouterr().err
    (tmp_path / "config.json").write_text("{not json")
    assert sizing.main([str(tmp_path / "config.json")]) == 2
    assert "error" in capsys.readouterr().err
    assert sizing.main(["preset:qwen3-next-80b-a3b", "--box", "strix-halo-128",
                        "--quant", "fp8"]) == 0
    assert "| Strix Halo 128 GB | fp8 | 1 |" in capsys.readouterr().out


def test_the_package_command_runs_it(capsys):
    from vllm_hybridcache.cli.tools import main

    assert main(["sizing", "preset:qwen3-next-80b-a3b", "--box", "r9700", "--quant",
                 "w4a16"]) == 0
    # 4-bit Qwen3-Next-80B does not fit one 32 GB card
    assert "| R9700 x1 | w4a16 | 1 | 39.5 | no |" in capsys.readouterr().out
