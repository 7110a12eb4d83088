"""Building one embedded checkpoint with transformers' own config and model classes.

Using transformers' classes (not hand-written tensors) means the weight names and shapes are the
real checkpoint layout, so vLLM's loaders and the transformers reference both read them.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch

from vllm_hybridcache.models.catalog import CATALOG, VOCAB_SIZE, ModelSpec
from vllm_hybridcache.models.store import (
    ModelStoreError,
    cache_root,
    publish,
    read_fingerprint,
    versions_key,
)
from vllm_hybridcache.models.tokenizer import (
    ADDED_TOKENS,
    SPECIAL_TOKENS,
    VISION_TOKENS,
    train_tokenizer,
)

TEMPLATE_PATH = Path(__file__).parent / "templates" / "qwen_chat.jinja"
# The vision-language template renders an image content part as Qwen-VL's placeholder (vLLM
# expands its pad to one per image row); text parts render as in the text template.
_TEXT_PART = "{%- if part.type == 'text' -%}{{ part.text }}{%- endif -%}"
_VL_PARTS = ("{%- if part.type == 'text' -%}{{ part.text }}"
             "{%- elif part.type in ('image', 'image_url', 'input_image') -%}"
             "<|vision_start|><|image_pad|><|vision_end|>{%- endif -%}")


def model_names() -> list[str]:
    return sorted(CATALOG)


def spec_for(name: str) -> ModelSpec:
    try:
        return CATALOG[name]
    except KeyError:
        raise ModelStoreError(
            f"unknown embedded model {name!r}; known: {', '.join(model_names())}"
        ) from None


@lru_cache(maxsize=1)
def _trained_tokenizer():
    return train_tokenizer(VOCAB_SIZE)


def chat_template(vision: bool = False) -> str:
    text = TEMPLATE_PATH.read_text(encoding="utf-8")
    if not vision:
        return text
    if _TEXT_PART not in text:
        raise ModelStoreError("the chat template's content-part macro changed; update build.py")
    return text.replace(_TEXT_PART, _VL_PARTS)


def hf_tokenizer(vision: bool = False):
    """The tokenizer wrapped for transformers, with its special tokens and chat template
    (`vision`: plus the vision tokens, appended after the trained vocabulary)."""
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=_trained_tokenizer(),
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        additional_special_tokens=list(SPECIAL_TOKENS) + (list(VISION_TOKENS) if vision else []),
        model_max_length=65536,
        clean_up_tokenization_spaces=False,
    )
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS])
    tok.chat_template = chat_template(vision)
    return tok


def special_ids(vision: bool = False) -> dict[str, int]:
    tok = _trained_tokenizer()
    ids = {t: tok.token_to_id(t) for t in (*SPECIAL_TOKENS, *ADDED_TOKENS)}
    if vision:
        wrapped = hf_tokenizer(vision=True)
        ids.update({t: wrapped.convert_tokens_to_ids(t) for t in VISION_TOKENS})
        if sorted(ids[t] for t in VISION_TOKENS) != list(range(VOCAB_SIZE,
                                                               VOCAB_SIZE + len(VISION_TOKENS))):
            raise ModelStoreError(f"vision tokens did not land after the vocabulary: {ids}")
    return ids


def build_checkpoint(spec: ModelSpec, out: Path) -> None:
    """Write config, weights, tokenizer and generation config of `spec` into `out`."""
    import transformers
    from transformers import GenerationConfig

    config = spec.build_config(special_ids(spec.vision))
    torch.manual_seed(spec.seed)
    with torch.device("cpu"):
        cls = getattr(transformers, spec.model_class)
        model = (cls.from_config(config, dtype=torch.float32) if hasattr(cls, "from_config")
                 else cls._from_config(config, dtype=torch.float32))
    if spec.adjust_weights is not None:
        with torch.no_grad():
            spec.adjust_weights(model, spec.seed)
    model = model.to(torch.bfloat16).eval()
    if spec.extra_weights is not None:
        extra = spec.extra_weights(config, spec.seed)
    else:
        extra = {}
    model.save_pretrained(out, safe_serialization=True, max_shard_size="10GB")
    if extra:
        from safetensors.torch import save_file

        save_file(extra, str(out / "model-extra.safetensors"), metadata={"format": "pt"})
        _merge_index(out, extra)
    if spec.quantize is not None:
        from vllm_hybridcache.models.quantize import quantize_checkpoint

        quantize_checkpoint(out, spec.quantize)
    hf_tokenizer(spec.vision).save_pretrained(out)
    if spec.processor_files is not None:
        import json

        for name, content in spec.processor_files().items():
            (out / name).write_text(json.dumps(content, indent=2, sort_keys=True) + "\n")
    text_config = config.get_text_config()
    GenerationConfig(
        eos_token_id=text_config.eos_token_id,
        pad_token_id=text_config.pad_token_id,
        do_sample=False,
    ).save_pretrained(out)


def _merge_index(out: Path, extra: dict[str, torch.Tensor]) -> None:
    """Add extra tensors (e.g. the MTP layer) to the safetensors index so loaders find them."""
    import json

    index_path = out / "model.safetensors.index.json"
    if index_path.exists():
        index = json.loads(index_path.read_text())
    else:
        from safetensors import safe_open

        with safe_open(str(out / "model.safetensors"), "pt") as f:
            names = list(f.keys())
        index = {"metadata": {}, "weight_map": dict.fromkeys(names, "model.safetensors")}
    for name in extra:
        index["weight_map"][name] = "model-extra.safetensors"
    index["weight_map"] = dict(sorted(index["weight_map"].items()))
    index_path.write_text(json.dumps(index, indent=2) + "\n")


def model_dir(name: str) -> Path:
    # A spec revision is part of the folder name, so a changed catalog entry is rebuilt
    # instead of silently reusing a checkpoint written from the old definition.
    revision = spec_for(name).revision
    suffix = f"-r{revision}" if revision else ""
    return cache_root() / f"{name}{suffix}-{versions_key()}"


def ensure_model(name: str) -> Path:
    """Return the folder of embedded model `name`, writing it first if needed."""
    spec = spec_for(name)
    final = model_dir(name)
    if read_fingerprint(final) is not None:
        return final
    return publish(lambda tmp: build_checkpoint(spec, tmp), final)
