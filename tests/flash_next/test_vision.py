"""Flash-Next vision without an engine: our image processor against transformers' PIL Qwen2-VL
processor, our tower against transformers' `Qwen4ExpVisionModel` (same weights)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_hybridcache.flash_next.vision import FlashNextVisionModel
from vllm_hybridcache.flash_next.vision_processor import (
    ImageSettings,
    grid_for,
    process_images,
    smart_resize,
)

SETTINGS = ImageSettings()


def _image(w: int, h: int, seed: int):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


def _vision_config():
    from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpVisionConfig

    return Qwen4ExpVisionConfig(depth=2, hidden_size=64, num_heads=2, intermediate_size=128,
                                out_hidden_size=96, patch_size=16, temporal_patch_size=2,
                                spatial_merge_size=2, num_position_embeddings=64,
                                rope_parameters={"rope_type": "axial", "rope_theta": 10000.0})


@pytest.mark.parametrize("size", [(64, 64), (100, 37), (300, 500), (8, 8)])
def test_processor_matches_transformers_pil_processor(size):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    ref = Qwen2VLImageProcessorPil(
        patch_size=SETTINGS.patch_size, temporal_patch_size=SETTINGS.temporal_patch_size,
        merge_size=SETTINGS.merge_size, image_mean=list(SETTINGS.image_mean),
        image_std=list(SETTINGS.image_std),
        size={"shortest_edge": SETTINGS.min_pixels, "longest_edge": SETTINGS.max_pixels})
    images = [_image(*size, seed=1), _image(48, 80, seed=2)]
    want = ref(images=images, return_tensors="np")
    pixels, grids = process_images(images, SETTINGS)
    assert grids.tolist() == want["image_grid_thw"].tolist()
    assert [tuple(g) for g in grids] == [grid_for(im.width, im.height, SETTINGS)
                                          for im in images]
    np.testing.assert_allclose(pixels, want["pixel_values"], rtol=0, atol=1e-6)


def test_smart_resize_refuses_degenerate_images():
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(1, 500, 32, 1024, 65536)
    with pytest.raises(ValueError, match="no pixels"):
        smart_resize(0, 5, 32, 1024, 65536)


def test_tower_matches_transformers():
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpVisionModel

    cfg = _vision_config()
    torch.manual_seed(0)
    ref = Qwen4ExpVisionModel(cfg).float().eval()
    with torch.no_grad():
        for p in ref.parameters():  # transformers' init leaves biases/norms trivial
            p.add_(torch.randn_like(p) * 0.05)
    ours = FlashNextVisionModel(cfg).float().eval()
    missing = ours.load_state_dict(ref.state_dict(), strict=True)
    assert not missing.missing_keys and not missing.unexpected_keys
    pixels, grids = process_images([_image(64, 96, 3), _image(160, 64, 4)], SETTINGS)
    pv, g = torch.from_numpy(pixels), torch.from_numpy(grids)
    with torch.no_grad():
        want = ref(pv, grid_thw=g).pooler_output
        got = ours(pv, g)
    assert got.shape == want.shape == (int((g.prod(-1) // 4).sum()), 96)
    assert (got - want).abs().max().item() < 1e-5
    # negative control: the tower must depend on where a patch sits (RoPE + position table)
    with torch.no_grad():
        swapped = ours(pv, torch.tensor([[1, g[0, 2], g[0, 1]], [1, g[1, 1], g[1, 2]]]))
    assert (swapped[: want.shape[0] // 2] - want[: want.shape[0] // 2]).abs().max() > 1e-3
