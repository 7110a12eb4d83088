"""The embedded models: names, transformers configs and generation settings.

Dimensions are chosen for the real CPU kernels (vLLM's CPU GDN rejects head size 32; 64 and
128 work) and `initializer_range` is raised well above the 0.02 default so random weights give
peaked logits: a test comparing logprobs then has signal.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from transformers import PreTrainedConfig

VOCAB_SIZE = 4096


@dataclass(frozen=True)
class ModelSpec:
    """One embedded model: how to build its config, and what it is for."""

    name: str
    summary: str
    build_config: Callable[[dict[str, int]], PreTrainedConfig]
    seed: int = 0
    # Tensors transformers' class does not create but the real checkpoint has (the MTP layer).
    extra_weights: Callable[[PreTrainedConfig, int], dict] | None = None
    # In-place changes to transformers' random init before saving (seeded), for weights its
    # init leaves at a value that would hide a component (e.g. zero-initialised convs).
    adjust_weights: Callable[[object, int], None] | None = None
    # Bump when an entry's definition changes: it is part of the checkpoint folder name.
    revision: int = 0
    # The transformers class that builds the weights (a name in `transformers`).
    model_class: str = "AutoModelForCausalLM"
    # Vision-language: the tokenizer and chat template carry the vision tokens.
    vision: bool = False
    # Processor files the real checkpoint ships beside its weights (file name -> JSON), for
    # models whose vLLM front end loads transformers' processor (Qwen3.5's Qwen3VLProcessor).
    processor_files: Callable[[], dict[str, dict]] | None = None
    # A quantization mode of `models.quantize` applied to the float weights after they are
    # written (the same seed and config as the float entry give the same float weights).
    quantize: str | None = None


def _qwen3_next(special: dict[str, int], *, hidden: int, layers: int, heads: int,
                gdn_k_heads: int, gdn_v_heads: int, gdn_dim: int, head_dim: int,
                experts: int, moe_inter: int) -> PreTrainedConfig:
    from transformers import Qwen3NextConfig

    layer_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                   for i in range(layers)]
    return Qwen3NextConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 4),
        head_dim=head_dim,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=gdn_dim,
        linear_value_head_dim=gdn_dim,
        linear_num_key_heads=gdn_k_heads,
        linear_num_value_heads=gdn_v_heads,
        num_experts=experts,
        num_experts_per_tok=2,
        moe_intermediate_size=moe_inter,
        shared_expert_intermediate_size=moe_inter,
        decoder_sparse_step=1,
        layer_types=layer_types,
        max_position_embeddings=65536,
        initializer_range=0.08,
        tie_word_embeddings=False,
        bos_token_id=special["<|endoftext|>"],
        eos_token_id=special["<|im_end|>"],
        pad_token_id=special["<|endoftext|>"],
        torch_dtype="bfloat16",
    )


def _qwen3_next_tiny(special: dict[str, int]) -> PreTrainedConfig:
    return _qwen3_next(special, hidden=256, layers=4, heads=4, gdn_k_heads=2, gdn_v_heads=4,
                       gdn_dim=64, head_dim=64, experts=4, moe_inter=256)


def _qwen3_next_small(special: dict[str, int]) -> PreTrainedConfig:
    return _qwen3_next(special, hidden=1024, layers=8, heads=8, gdn_k_heads=4, gdn_v_heads=8,
                       gdn_dim=128, head_dim=128, experts=8, moe_inter=512)


def _flash_next(special: dict[str, int], *, hidden: int, layers: int, heads: int,
                gdn_k_heads: int, gdn_v_heads: int, gdn_dim: int, head_dim: int,
                experts: int, moe_inter: int, idx_heads: int, idx_dim: int, budget: int,
                ratio: int, hc_lowrank: int) -> PreTrainedConfig:
    from transformers import Qwen4ExpTextConfig

    layer_types = ["indexed_attention" if (i + 1) % 4 == 0 else "linear_attention"
                   for i in range(layers)]
    return Qwen4ExpTextConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 4),
        head_dim=head_dim,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=gdn_dim,
        linear_value_head_dim=gdn_dim,
        linear_num_key_heads=gdn_k_heads,
        linear_num_value_heads=gdn_v_heads,
        num_experts=experts,
        num_experts_per_tok=2,
        moe_intermediate_size=moe_inter,
        shared_expert_intermediate_size=moe_inter,
        layer_types=layer_types,
        max_position_embeddings=65536,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                         "partial_rotary_factor": 0.25},
        initializer_range=0.08,
        tie_word_embeddings=False,
        hc_count=2,
        hc_lowrank=hc_lowrank,
        ple_layer_ids=[2],
        ple_embed_dim=hidden,
        ple_conv_kernel_size=4,
        ngram_size=3,
        heads_per_ngram=2,
        ngram_vocab_size_base=1000,
        make_ngram_vocab_size_divisible_by=16,
        split_ngram_parts=4,
        indexer_n_heads=idx_heads,
        indexer_kv_heads=1,
        indexer_head_dim=idx_dim,
        indexer_budget=budget,
        indexer_compress_ratio=ratio,
        output_gate_type="sigmoid",
        # vLLM reads the number of MTP layers from this key (Qwen4Exp MTP config convertor).
        mtp_num_hidden_layers=1,
        bos_token_id=special["<|endoftext|>"],
        eos_token_id=special["<|im_end|>"],
        pad_token_id=special["<|endoftext|>"],
        torch_dtype="bfloat16",
    )


def _flash_next_adjust(model, seed: int) -> None:
    """Make every Flash-Next component visible in the outputs of a random checkpoint.

    transformers initialises the PLE conv to zero (its output would vanish and its state would
    never matter) and every RMSNorm weight to zero (identity under the `1 + w` convention, so a
    wrong convention would go unnoticed). Give them seeded random values instead.
    """
    import torch
    from transformers.models.qwen4_exp import modeling_qwen4_exp as hf

    gen = torch.Generator().manual_seed(10_000 + seed)
    for _, module in sorted(model.named_modules(), key=lambda kv: kv[0]):
        if isinstance(module, hf.Qwen4ExpTextPLELayer):
            w = module.conv1d.weight
            w.copy_(torch.randn(w.shape, generator=gen) * 0.3)
        elif isinstance(module, hf.Qwen4ExpTextRMSNorm):
            w = module.weight
            w.copy_(torch.randn(w.shape, generator=gen) * 0.1)
        elif isinstance(module, hf.Qwen4ExpTextRMSNormGated):
            w = module.weight
            w.copy_(1.0 + torch.randn(w.shape, generator=gen) * 0.1)


def _flash_next_mtp_weights(config: PreTrainedConfig, seed: int) -> dict:
    """The MTP draft layer in the layout of Qwen4Exp checkpoints (vLLM's in-tree `Qwen4ExpMTP`
    reads these names): `mtp.fc_embedding`, `mtp.fc_hidden`, `mtp.pre_fc_norm_embedding`,
    `mtp.pre_fc_norm_hidden` (over all hc streams), `mtp.layers.0.*` (one QSA decoder layer,
    experts stored per expert like the main layers), `mtp.hyper_connection_mixer.*`.
    The lm_head and embeddings are shared with the main model."""
    import copy

    import torch
    from transformers.models.qwen4_exp import modeling_qwen4_exp as hf

    gen = torch.Generator().manual_seed(20_000 + seed)
    std = config.initializer_range
    layer_cfg = copy.deepcopy(config)
    layer_cfg.num_hidden_layers = 1
    layer_cfg.layer_types = ["indexed_attention"]
    layer_cfg.ple_layer_ids = []
    layer = hf.Qwen4ExpTextDecoderLayer(layer_cfg, 0)
    mixer = hf.Qwen4ExpTextGatedResidual(layer_cfg, use_combine=False)
    hidden, hc = config.hidden_size, config.hc_count
    out: dict[str, torch.Tensor] = {}

    def rand(shape, scale=std):
        return torch.randn(shape, generator=gen) * scale

    for prefix, module in (("mtp.layers.0.", layer), ("mtp.hyper_connection_mixer.", mixer)):
        for name, param in sorted(module.named_parameters()):
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                value = rand(param.shape, 0.1)
            elif name.endswith("experts.gate_up_proj"):
                value = rand(param.shape)
                inter = param.shape[1] // 2
                for e in range(param.shape[0]):
                    base = f"{prefix}{name.rsplit('.', 1)[0]}.{e}."
                    out[base + "gate_proj.weight"] = value[e, :inter]
                    out[base + "up_proj.weight"] = value[e, inter:]
                continue
            elif name.endswith("experts.down_proj"):
                value = rand(param.shape)
                for e in range(param.shape[0]):
                    out[f"{prefix}{name.rsplit('.', 1)[0]}.{e}.down_proj.weight"] = value[e]
                continue
            else:
                value = rand(param.shape)
            out[prefix + name] = value
    out["mtp.fc_embedding.weight"] = rand((hidden, hidden))
    out["mtp.fc_hidden.weight"] = rand((hidden, hidden))
    out["mtp.pre_fc_norm_embedding.weight"] = rand((hidden,), 0.1)
    out["mtp.pre_fc_norm_hidden.weight"] = rand((hc * hidden,), 0.1)
    return {k: v.to(torch.bfloat16).contiguous() for k, v in sorted(out.items())}


def _flash_next_tiny(special: dict[str, int]) -> PreTrainedConfig:
    return _flash_next(special, hidden=256, layers=4, heads=4, gdn_k_heads=2, gdn_v_heads=4,
                       gdn_dim=64, head_dim=64, experts=4, moe_inter=256, idx_heads=2,
                       idx_dim=64, budget=60, ratio=4, hc_lowrank=32)


def _tiny_tower(out_hidden: int, **extra) -> dict:
    """The embedded vision-language models' vision tower: 2 blocks of hidden 64, 16-pixel
    patches, 2x2 merge, an 8x8 learned position table, raised `initializer_range` so an image
    visibly moves the logprobs."""
    return dict(depth=2, hidden_size=64, num_heads=2, intermediate_size=128,
                out_hidden_size=out_hidden, patch_size=16, temporal_patch_size=2,
                spatial_merge_size=2, num_position_embeddings=64, initializer_range=0.08,
                **extra)


def _vision_language(config_cls, architecture: str, special: dict[str, int], text: dict,
                     vision: dict) -> PreTrainedConfig:
    """A Qwen-VL-style config: text and vision parts with the vision tokens' ids."""
    cfg = config_cls(text_config=text, vision_config=vision,
                     image_token_id=special["<|image_pad|>"],
                     video_token_id=special["<|video_pad|>"],
                     vision_start_token_id=special["<|vision_start|>"],
                     vision_end_token_id=special["<|vision_end|>"],
                     tie_word_embeddings=False)
    cfg.architectures = [architecture]
    return cfg


def _flash_next_vl_tiny(special: dict[str, int]) -> PreTrainedConfig:
    """flash-next-tiny's text model (the vocabulary grown by the 4 vision tokens, padded to a
    multiple of 16; no MTP layer) under a 2-block vision tower: 16-pixel patches, 2x2 merge,
    an 8x8 learned position table. `initializer_range` is raised like the text model's so an
    image visibly moves the logprobs."""
    from transformers import Qwen4ExpConfig

    text = _flash_next_tiny(special).to_dict()
    text.update(vocab_size=VOCAB_SIZE + 16, mtp_num_hidden_layers=0)
    # transformers' default M-RoPE section, written out: vLLM turns M-RoPE on only when the
    # config names it.
    text["rope_parameters"] = dict(text["rope_parameters"], mrope_section=[11, 11, 10])
    vision = _tiny_tower(text["hidden_size"],
                         rope_parameters={"rope_type": "axial", "rope_theta": 10000.0})
    return _vision_language(Qwen4ExpConfig, "Qwen4ExpForConditionalGeneration", special,
                            text, vision)


def _qwen3_5_vl_tiny(special: dict[str, int]) -> PreTrainedConfig:
    """Qwen3.5 as every Qwen3.5 checkpoint is published: `Qwen3_5ForConditionalGeneration`
    (a vision-language class; vLLM serves text through it too). The text model is
    qwen3-next-tiny's shape without experts (3 GDN layers + 1 gated attention layer, hidden
    256, head size 64), with Qwen3.5's interleaved M-RoPE over half of each head; the vision
    tower has 2 blocks, 16-pixel patches and a 2x2 merge like the real one."""
    from transformers import Qwen3_5Config

    text = dict(
        vocab_size=VOCAB_SIZE + 16, hidden_size=256, intermediate_size=512,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        linear_conv_kernel_dim=4, linear_key_head_dim=64, linear_value_head_dim=64,
        linear_num_key_heads=2, linear_num_value_heads=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        max_position_embeddings=65536, initializer_range=0.08,
        eos_token_id=special["<|im_end|>"], pad_token_id=special["<|endoftext|>"],
        # M-RoPE sections sum to the rotary half-width: 64 * 0.5 / 2 = 16
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                         "partial_rotary_factor": 0.5, "mrope_section": [6, 5, 5],
                         "mrope_interleaved": True},
    )
    return _vision_language(Qwen3_5Config, "Qwen3_5ForConditionalGeneration", special, text,
                            _tiny_tower(text["hidden_size"]))


def _qwen3_5_processor_files() -> dict[str, dict]:
    """The image and video processor configs Qwen3.5 checkpoints publish (their types, patch,
    merge and normalisation), with the published pixel bounds."""
    common = {"patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
              "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
              "processor_class": "Qwen3VLProcessor"}
    return {
        "preprocessor_config.json": {
            **common, "size": {"longest_edge": 16777216, "shortest_edge": 65536},
            "image_processor_type": "Qwen2VLImageProcessorFast"},
        "video_preprocessor_config.json": {
            **common, "size": {"longest_edge": 25165824, "shortest_edge": 4096},
            "video_processor_type": "Qwen3VLVideoProcessor"},
    }


def _flash_next_small(special: dict[str, int]) -> PreTrainedConfig:
    return _flash_next(special, hidden=1024, layers=8, heads=8, gdn_k_heads=4, gdn_v_heads=8,
                       gdn_dim=128, head_dim=128, experts=8, moe_inter=512, idx_heads=4,
                       idx_dim=128, budget=2048, ratio=4, hc_lowrank=128)


def _flash_next_twins(fmt: str, what: str) -> tuple[ModelSpec, ModelSpec]:
    """flash-next-tiny (the same seed, config and extra weights, so the same float weights)
    rewritten in the quantization format `fmt` of `models.quantize`, and its dequantized
    float reference."""
    same = {"seed": 3, "extra_weights": _flash_next_mtp_weights,
            "adjust_weights": _flash_next_adjust, "revision": 1}
    return (ModelSpec(f"flash-next-tiny-{fmt}", f"flash-next-tiny quantized: {what}",
                      _flash_next_tiny, quantize=fmt, **same),
            ModelSpec(f"flash-next-tiny-{fmt}-dequant", f"flash-next-tiny-{fmt}'s weights "
                      "dequantized (its float reference)", _flash_next_tiny,
                      quantize=f"{fmt}-dequant", **same))


CATALOG: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec("qwen3-next-tiny", "Qwen3-Next, 4 layers (3 GDN + 1 attention), hidden 256",
                  _qwen3_next_tiny, seed=1),
        ModelSpec("qwen3-next-tiny-w8a8", "qwen3-next-tiny quantized: compressed-tensors W8A8 "
                  "int8 (dense linears; routed experts in bf16)", _qwen3_next_tiny, seed=1,
                  quantize="w8a8"),
        ModelSpec("qwen3-next-tiny-w8a8-dequant", "qwen3-next-tiny-w8a8's weights dequantized "
                  "to bf16 (its float reference)", _qwen3_next_tiny, seed=1,
                  quantize="w8a8-dequant"),
        ModelSpec("qwen3-next-small", "Qwen3-Next, 8 layers, hidden 1024 (benchmarks)",
                  _qwen3_next_small, seed=2),
        ModelSpec("flash-next-tiny", "Flash-Next (qwen4_exp), 4 layers, GDN + QSA + PLE + HC + MoE",
                  _flash_next_tiny, seed=3, extra_weights=_flash_next_mtp_weights,
                  adjust_weights=_flash_next_adjust, revision=1),
        *_flash_next_twins("w8a8", "compressed-tensors W8A8 int8 (GDN, attention and "
                           "shared-expert projections; routed experts, gates, MTP layer in the "
                           "float dtype)"),
        *_flash_next_twins("fp8", "compressed-tensors FP8 dynamic (float8 e4m3 per channel, "
                           "the RDNA4 format; the w8a8 entry's projections)"),
        ModelSpec("flash-next-vl-tiny", "Flash-Next with its vision tower "
                  "(Qwen4ExpForConditionalGeneration), flash-next-tiny's text model",
                  _flash_next_vl_tiny, seed=5, adjust_weights=_flash_next_adjust,
                  model_class="Qwen4ExpForConditionalGeneration", vision=True),
        ModelSpec("qwen3.5-vl-tiny", "Qwen3.5 (Qwen3_5ForConditionalGeneration), 4 layers "
                  "(3 GDN + 1 attention), hidden 256, a 2-block vision tower",
                  _qwen3_5_vl_tiny, seed=6, model_class="Qwen3_5ForConditionalGeneration",
                  vision=True, processor_files=_qwen3_5_processor_files),
        ModelSpec("flash-next-small", "Flash-Next (qwen4_exp), 8 layers, hidden 1024 (benchmarks)",
                  _flash_next_small, seed=4, extra_weights=_flash_next_mtp_weights,
                  adjust_weights=_flash_next_adjust, revision=1),
    )
}
