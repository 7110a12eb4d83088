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
from vllm_hybridcache.models.tokenizer import ADDED_TOKENS, SPECIAL_TOKENS, train_tokenizer

TEMPLATE_PATH = Path(__file__).parent / "templates" / "qwen_chat.jinja"


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


def hf_tokenizer():
    """The tokenizer wrapped for transformers, with its special tokens and chat template."""
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=_trained_tokenizer(),
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        additional_special_tokens=list(SPECIAL_TOKENS),
        model_max_length=65536,
        clean_up_tokenization_spaces=False,
    )
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS])
    tok.chat_template = TEMPLATE_PATH.read_text(encoding="utf-8")
    return tok


def special_ids() -> dict[str, int]:
    tok = _trained_tokenizer()
    return {t: tok.token_to_id(t) for t in (*SPECIAL_TOKENS, *ADDED_TOKENS)}


def build_checkpoint(spec: ModelSpec, out: Path) -> None:
    """Write config, weights, tokenizer and generation config of `spec` into `out`."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    config = spec.build_config(special_ids())
    torch.manual_seed(spec.seed)
    with torch.device("cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
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
    hf_tokenizer().save_pretrained(out)
    GenerationConfig(
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
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
