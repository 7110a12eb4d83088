"""`Qwen4ExpForConditionalGeneration` for vLLM: Flash-Next with its vision tower.

vLLM's side of an image, in the order it happens:

1. processing (`FlashNextVLProcessor`, in the front end): our torchvision-free image processor
   (`vision_processor.py`) turns each image into flat patches and a grid `(1, h, w)`; every
   `<|image_pad|>` of the prompt (the chat template's placeholder
   `<|vision_start|><|image_pad|><|vision_end|>`) is expanded to `h * w / merge**2` pads, one
   per row the tower returns. vLLM hashes each processed item (its content `identifier`).
2. positions (`get_mrope_input_positions`): transformers' `get_rope_index` for images: text
   runs count on; an image's rows take (t, h, w) = (start, start + row, start + col) over the
   merged grid, and the text after it resumes at `start + max(h, w) / merge`.
3. encoder (`embed_multimodal`): the tower on the item's patches; vLLM caches the output per
   item hash and scatters the rows into the pads' embeddings.
4. language model: the text model with M-RoPE QSA layers (`vision_qsa.py`); PLE still reads
   the prompt's token ids (the pads included), as transformers does, so the engine hands the
   model the raw ids next to the embeddings (`requires_raw_input_tokens`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from functools import cached_property
from pathlib import Path

import numpy as np
import torch
from vllm.config import VllmConfig
from vllm.model_executor.models.interfaces import SupportsMRoPE, SupportsMultiModal
from vllm.multimodal import MULTIMODAL_REGISTRY
from vllm.multimodal.inputs import MultiModalFieldConfig, MultiModalKwargsItems
from vllm.multimodal.parse import MultiModalDataItems
from vllm.multimodal.processing import (
    BaseDummyInputsBuilder,
    BaseMultiModalProcessor,
    BaseProcessingInfo,
    PromptReplacement,
    PromptUpdate,
)

from vllm_hybridcache.flash_next.model import FlashNextForCausalLM
from vllm_hybridcache.flash_next.vision import FlashNextVisionModel
from vllm_hybridcache.flash_next.vision_processor import ImageSettings, grid_for, process_images
from vllm_hybridcache.flash_next.vision_qsa import MRopeQSAAttention

IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"


def image_settings(hf_config, model_dir: str | None = None) -> ImageSettings:
    """Patch geometry from the vision config; pixel bounds and normalisation from the
    checkpoint's `preprocessor_config.json` when it has one (read as plain JSON: the file may
    name a torchvision-based class), else `ImageSettings`' defaults."""
    v = hf_config.vision_config
    fields = dict(patch_size=int(v.patch_size), temporal_patch_size=int(v.temporal_patch_size),
                  merge_size=int(v.spatial_merge_size))
    pre = Path(model_dir) / "preprocessor_config.json" if model_dir else None
    if pre is not None and pre.is_file():
        raw = json.loads(pre.read_text())
        size = raw.get("size") or {}
        if raw.get("min_pixels") or size.get("shortest_edge"):
            fields["min_pixels"] = int(raw.get("min_pixels") or size["shortest_edge"])
        if raw.get("max_pixels") or size.get("longest_edge"):
            fields["max_pixels"] = int(raw.get("max_pixels") or size["longest_edge"])
        for key in ("image_mean", "image_std"):
            if raw.get(key):
                fields[key] = tuple(float(x) for x in raw[key])
    return ImageSettings(**fields)


def mrope_positions(input_tokens: Sequence[int], items: Sequence[tuple[int, tuple[int, int, int]]],
                    merge: int) -> tuple[torch.Tensor, int]:
    """M-RoPE positions `[3, len(input_tokens)]` and the decode delta, for image items given
    as (offset of the first pad, grid (t, h, w) in patches), as transformers computes them."""
    n = len(input_tokens)
    rows: list[np.ndarray] = []
    cur, done = 0, 0
    for offset, (t, h, w) in sorted(items):
        if offset < done:
            raise ValueError("overlapping image placeholder ranges")
        text = offset - done
        rows.append(np.broadcast_to(np.arange(text), (3, text)) + cur)
        cur += text
        lh, lw = h // merge, w // merge
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(lh), np.arange(lw), indexing="ij")
        rows.append(np.stack([tt, hh, ww]).reshape(3, -1) + cur)
        cur += max(h, w) // merge
        done = offset + t * lh * lw
    rows.append(np.broadcast_to(np.arange(n - done), (3, n - done)) + cur)
    pos = np.concatenate(rows, axis=1)
    if pos.shape[1] != n:
        raise ValueError(f"image placeholders do not fit the prompt ({pos.shape[1]} != {n})")
    delta = int(pos.max()) + 1 - n if n else 0
    return torch.from_numpy(np.ascontiguousarray(pos)).long(), delta


class FlashNextVLProcessingInfo(BaseProcessingInfo):
    def get_supported_mm_limits(self) -> Mapping[str, int | None]:
        return {"image": None}

    def get_supported_mm_processor_kwargs(self) -> dict[str, set[str]]:
        return {"text_kwargs": set(), "images_kwargs": set()}

    @cached_property
    def settings(self) -> ImageSettings:
        return image_settings(self.get_hf_config(), self.ctx.model_config.model)

    def get_image_size_with_most_features(self) -> tuple[int, int]:
        side = int(self.settings.max_pixels ** 0.5)
        return side, side

    def get_mm_max_tokens_per_item(self, seq_len: int,
                                   mm_counts: Mapping[str, int]) -> Mapping[str, int]:
        w, h = self.get_image_size_with_most_features()
        t, gh, gw = grid_for(w, h, self.settings)
        return {"image": t * gh * gw // self.settings.merge_size ** 2}


class FlashNextVLDummyInputsBuilder(BaseDummyInputsBuilder[FlashNextVLProcessingInfo]):
    def get_dummy_text(self, mm_counts: Mapping[str, int]) -> str:
        return IMAGE_PLACEHOLDER * mm_counts.get("image", 0)

    def get_dummy_mm_data(self, seq_len: int, mm_counts: Mapping[str, int], mm_options):
        w, h = self.info.get_image_size_with_most_features()
        return {"image": self._get_dummy_images(width=w, height=h,
                                                num_images=mm_counts.get("image", 0),
                                                overrides=(mm_options or {}).get("image"))}


def _as_pil(image):
    from PIL import Image

    if isinstance(image, Image.Image):
        return image
    arr = image.numpy() if isinstance(image, torch.Tensor) else np.asarray(image)
    if arr.ndim == 3 and arr.shape[0] in (1, 3, 4) and arr.shape[-1] not in (1, 3, 4):
        arr = arr.transpose(1, 2, 0)  # CHW -> HWC
    if arr.dtype != np.uint8:
        raise ValueError("image arrays must be uint8 HWC (PIL layout)")
    return Image.fromarray(arr.squeeze(-1) if arr.shape[-1] == 1 else arr)


class FlashNextVLProcessor(BaseMultiModalProcessor[FlashNextVLProcessingInfo]):
    def _call_hf_processor(self, hf_data: Mapping[str, object],
                           hf_kwargs: Mapping[str, object]):
        from transformers import BatchFeature

        images = [_as_pil(im) for im in (hf_data.get("images") or [])]
        if not images:
            return BatchFeature()
        pixels, grids = process_images(images, self.info.settings)
        return BatchFeature({"pixel_values": torch.from_numpy(pixels),
                             "image_grid_thw": torch.from_numpy(grids)})

    def _get_mm_fields_config(self, hf_inputs, hf_processor_mm_kwargs
                              ) -> Mapping[str, MultiModalFieldConfig]:
        grid = hf_inputs.get("image_grid_thw", torch.empty((0, 3), dtype=torch.long))
        return dict(pixel_values=MultiModalFieldConfig.flat_from_sizes("image", grid.prod(-1)),
                    image_grid_thw=MultiModalFieldConfig.batched("image", keep_on_cpu=True))

    def _get_prompt_updates(self, mm_items: MultiModalDataItems,
                            hf_processor_mm_kwargs: Mapping[str, object],
                            out_mm_kwargs: MultiModalKwargsItems) -> Sequence[PromptUpdate]:
        pad = int(self.info.get_hf_config().image_token_id)
        merge = self.info.settings.merge_size

        def replacement(i: int) -> list[int]:
            grid = out_mm_kwargs["image"][i]["image_grid_thw"].data
            return [pad] * (int(grid.prod()) // merge ** 2)

        return [PromptReplacement(modality="image", target=[pad], replacement=replacement)]


@MULTIMODAL_REGISTRY.register_processor(FlashNextVLProcessor, info=FlashNextVLProcessingInfo,
                                        dummy_inputs=FlashNextVLDummyInputsBuilder)
class FlashNextForConditionalGeneration(FlashNextForCausalLM, SupportsMultiModal, SupportsMRoPE):
    """`Qwen4ExpForConditionalGeneration`: the tower `visual.*` plus our Flash-Next text model
    with M-RoPE QSA layers (module docstring)."""

    attention_cls = MRopeQSAAttention
    requires_raw_input_tokens = True  # PLE hashes the prompt's ids, image pads included

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        if not vllm_config.model_config.uses_mrope:
            raise ValueError(
                "Flash-Next vision needs M-RoPE, which vLLM turns on only when the text "
                "config's rope_parameters name an 'mrope_section' (transformers' default is "
                "[11, 11, 10]); add it to the checkpoint's config.json")
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        hf = vllm_config.model_config.hf_config
        self.image_token_id = int(hf.image_token_id)
        self.merge = int(hf.vision_config.spatial_merge_size)
        self.visual = FlashNextVisionModel(hf.vision_config)

    @classmethod
    def get_placeholder_str(cls, modality: str, i: int) -> str | None:
        if modality.startswith("image"):
            return IMAGE_PLACEHOLDER
        raise ValueError(f"Flash-Next in vllm-hybridcache takes images only, not {modality}")

    def get_language_model(self):
        return self.model

    def embed_multimodal(self, **kwargs: object):
        pixels = kwargs.get("pixel_values")
        grids = kwargs.get("image_grid_thw")
        if pixels is None:
            return []
        if isinstance(pixels, (list, tuple)):
            pixels = torch.cat(list(pixels))
        if isinstance(grids, (list, tuple)):
            grids = torch.stack([torch.as_tensor(g).reshape(3) for g in grids])
        grids = torch.as_tensor(grids).reshape(-1, 3).long()
        out = self.visual(pixels.to(self.visual.dtype), grids)
        return list(out.split((grids.prod(-1) // self.merge ** 2).tolist()))

    def embed_input_ids(self, input_ids: torch.Tensor, multimodal_embeddings=None, *,
                        is_multimodal: torch.Tensor | None = None) -> torch.Tensor:
        embeds = self.model.embed_tokens(input_ids)
        if multimodal_embeddings is None or len(multimodal_embeddings) == 0:
            return embeds
        mm = torch.cat(list(multimodal_embeddings)).to(embeds.dtype)
        embeds = embeds.clone()
        embeds[is_multimodal.to(embeds.device)] = mm
        return embeds

    def get_mrope_input_positions(self, input_tokens: list[int], mm_features
                                  ) -> tuple[torch.Tensor, int]:
        items = []
        for f in mm_features or ():
            if f.modality != "image":
                raise ValueError(f"Flash-Next takes images only, not {f.modality}")
            grid = f.data["image_grid_thw"].data
            items.append((int(f.mm_position.offset), tuple(int(x) for x in grid.reshape(3))))
        return mrope_positions(input_tokens, items, self.merge)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        visual: list[tuple[str, torch.Tensor]] = []

        def text_only():
            for name, tensor in weights:
                for p in ("model.visual.", "visual."):
                    if name.startswith(p):
                        visual.append((name[len(p):], tensor))
                        break
                else:
                    yield name, tensor

        loaded = super().load_weights(text_only())
        params = dict(self.visual.named_parameters())
        for name, tensor in visual:
            if name not in params:
                raise KeyError(f"unexpected Flash-Next vision tensor {name}")
            with torch.no_grad():
                params[name].copy_(tensor)
            loaded.add(f"visual.{name}")
        return loaded
