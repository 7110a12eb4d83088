"""compat/vision_imports.py: vLLM's Qwen-VL / Qwen3.5 model files and processor load where
torchvision does not, and nothing changes where it does.

Imports are process-wide, so each import case runs in a fresh interpreter. On this machine
torchvision is absent (the set-up removes it: it cannot load beside torch 2.13.0+cpu), which is
the case the stand-ins are for; the case with torchvision is simulated by telling the finder
torchvision loads.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from vllm_hybridcache.compat import vision_imports as vi

pytestmark = pytest.mark.skipif(vi.torchvision_unavailable() is None,
                                reason="torchvision loads here: the stand-ins never engage")


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=300)


def test_without_the_finder_vllms_qwen3_5_file_does_not_import():
    """Negative control: the failure the stand-in is for."""
    out = _python("import vllm.model_executor.models.qwen3_5")
    assert out.returncode != 0
    assert "No module named 'torchvision'" in out.stderr


def test_with_the_stand_ins_the_model_file_imports_and_the_processor_loads(embedded_model):
    """One interpreter (each costs a vLLM import): the model file imports with the PIL twin in
    the torchvision module's place, the processor loads, processes an image and refuses a
    video with why."""
    path = embedded_model("qwen3.5-vl-tiny")
    out = _python(f"""
        from vllm_hybridcache.compat import install_pil_image_processor_fallback
        assert install_pil_image_processor_fallback()
        import vllm.model_executor.models.qwen3_5
        import transformers.models.qwen2_vl.image_processing_qwen2_vl as m
        import transformers.models.qwen2_vl.image_processing_pil_qwen2_vl as pil
        assert m.smart_resize is pil.smart_resize
        assert m.Qwen2VLImageProcessor is pil.Qwen2VLImageProcessorPil
        assert m.__hybridcache_stand_in_for__ == {vi.PIL_PROCESSOR!r}
        from transformers.models.qwen3_vl import Qwen3VLProcessor
        from vllm_hybridcache.compat.vision_imports import VideoNeedsTorchvision
        p = Qwen3VLProcessor.from_pretrained({str(path)!r})
        # the checkpoint's settings, not only the defaults
        assert p.video_processor.size["longest_edge"] == 25165824, p.video_processor.size
        assert p.video_processor.merge_size == 2 and p.image_processor.merge_size == 2
        import numpy as np
        from PIL import Image
        img = Image.fromarray(np.zeros((64, 96, 3), dtype=np.uint8))
        out = p.image_processor(images=[img], return_tensors="pt")
        print(tuple(out["image_grid_thw"][0].tolist()))
        try:
            p.video_processor(videos=[np.zeros((4, 64, 64, 3), dtype=np.uint8)])
        except VideoNeedsTorchvision as e:
            print("refused:", e)
    """)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert lines[-2] != "" and lines[-2].startswith("(1, ")
    assert lines[-1].startswith("refused:") and "torchvision" in lines[-1]


def test_a_checkpoint_without_a_video_processor_config_loads_too(embedded_model, tmp_path):
    """transformers then derives the video processor's name from the image processor's type
    (`Qwen2VLImageProcessor` -> `Qwen2VLVideoProcessor`); the stand-in answers for that name."""
    import json
    import shutil

    src = embedded_model("qwen3.5-vl-tiny")
    dst = tmp_path / "no-video-config"
    shutil.copytree(src, dst)
    (dst / "video_preprocessor_config.json").unlink()
    pre = json.loads((dst / "preprocessor_config.json").read_text())
    pre["image_processor_type"] = "Qwen2VLImageProcessor"
    (dst / "preprocessor_config.json").write_text(json.dumps(pre))
    out = _python(f"""
        from vllm_hybridcache.compat import install_pil_image_processor_fallback
        install_pil_image_processor_fallback()
        import vllm.model_executor.models.qwen3_5
        from transformers.models.qwen3_vl import Qwen3VLProcessor
        p = Qwen3VLProcessor.from_pretrained({str(dst)!r})
        print(type(p.video_processor).__name__, p.video_processor.patch_size)
    """)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["Qwen2VLVideoProcessor", "16"]  # the checkpoint's patch


def test_without_the_stand_in_the_processor_does_not_load(embedded_model):
    """Negative control: the image finder alone, no video stand-in (as if its installation had
    failed): transformers cannot build Qwen3VLProcessor."""
    path = embedded_model("qwen3.5-vl-tiny")
    out = _python(f"""
        from vllm_hybridcache.compat import vision_imports as vi
        vi.install_video_processor_stand_in = lambda: False
        vi.install_pil_image_processor_fallback()
        import vllm.model_executor.models.qwen3_5
        from transformers.models.qwen3_vl import Qwen3VLProcessor
        Qwen3VLProcessor.from_pretrained({str(path)!r})
    """)
    assert out.returncode != 0
    assert "Torchvision" in out.stderr or "torchvision" in out.stderr


def test_where_torchvision_loads_the_finder_steps_aside(monkeypatch):
    monkeypatch.setattr(vi, "torchvision_unavailable", lambda: None)
    assert vi._FINDER.find_spec(vi.TORCHVISION_PROCESSOR) is None
    if not vi._video_installed:
        assert vi.install_video_processor_stand_in() is False
    monkeypatch.undo()
    # and without: it answers for that one name only
    assert vi._FINDER.find_spec(vi.TORCHVISION_PROCESSOR) is not None
    assert vi._FINDER.find_spec("transformers.models.qwen2_vl.processing_qwen2_vl") is None


class _Model:
    def __init__(self, mm):
        self.multimodal_config = mm


class _Config:
    def __init__(self, mm):
        self.model_config = _Model(mm)


def test_the_config_hook_turns_videos_off_only_without_torchvision(monkeypatch):
    from vllm.config.multimodal import MultiModalConfig

    mm = MultiModalConfig()
    assert mm.get_limit_per_prompt("video") > 0
    vi.videos_off_without_torchvision(_Config(mm))
    assert mm.get_limit_per_prompt("video") == 0
    assert mm.get_limit_per_prompt("image") > 0
    # with torchvision, nothing changes
    mm = MultiModalConfig(limit_per_prompt={"video": 2})
    monkeypatch.setattr(vi, "torchvision_unavailable", lambda: None)
    vi.videos_off_without_torchvision(_Config(mm))
    assert mm.get_limit_per_prompt("video") == 2
    vi.videos_off_without_torchvision(_Config(None))  # a text-only model: nothing to do
