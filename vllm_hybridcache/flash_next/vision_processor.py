"""Flash-Next's image processor: PIL + numpy, no torchvision.

Why our own: transformers' default Qwen2-VL image processor is built on torchvision, which the
CPU install cannot provide next to torch's CPU build. This module does what its PIL backend
does, step by step, in the layout the vision tower reads:

1. convert to RGB;
2. `smart_resize`: both sides a multiple of `patch_size * merge_size`, the pixel count within
   `[min_pixels, max_pixels]`, the aspect ratio kept as closely as possible; PIL bicubic;
3. rescale to [0, 1] and normalise with `image_mean` / `image_std` (float32);
4. patchify: `[grid_h * grid_w, C * temporal_patch_size * P * P]`, patches ordered in
   `merge_size x merge_size` blocks, the single frame repeated `temporal_patch_size` times.

The output equals transformers' `Qwen2VLImageProcessorPil` for the same settings (tested); the
one difference is scope: images only (no videos) and no batching beyond a list of images.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ImageSettings:
    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 32 * 32
    max_pixels: int = 256 * 256
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size


def smart_resize(height: int, width: int, factor: int, min_pixels: int,
                 max_pixels: int) -> tuple[int, int]:
    """Target (height, width): multiples of `factor`, pixel count in range, aspect kept."""
    if min(height, width) <= 0:
        raise ValueError(f"image of size {width}x{height} has no pixels")
    if max(height, width) / min(height, width) > 200:
        raise ValueError("absolute aspect ratio must be smaller than 200, got "
                         f"{max(height, width) / min(height, width)}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def grid_for(width: int, height: int, s: ImageSettings) -> tuple[int, int, int]:
    """The patch grid (t, h, w) an image of this size is processed into."""
    h, w = smart_resize(height, width, s.factor, s.min_pixels, s.max_pixels)
    return 1, h // s.patch_size, w // s.patch_size


def process_image(image, s: ImageSettings) -> tuple[np.ndarray, tuple[int, int, int]]:
    """One PIL image -> (flat patches float32 [h*w, C*T*P*P], grid (1, h, w))."""
    from PIL import Image

    image = image.convert("RGB")
    h, w = smart_resize(image.height, image.width, s.factor, s.min_pixels, s.max_pixels)
    if (image.height, image.width) != (h, w):
        image = image.resize((w, h), resample=Image.Resampling.BICUBIC)
    arr = np.asarray(image, dtype=np.float32).transpose(2, 0, 1) * np.float32(1 / 255)
    mean = np.asarray(s.image_mean, dtype=np.float32)[:, None, None]
    std = np.asarray(s.image_std, dtype=np.float32)[:, None, None]
    arr = ((arr - mean) / std).astype(np.float32)
    c, p, m = arr.shape[0], s.patch_size, s.merge_size
    gh, gw = h // p, w // p
    x = arr.reshape(c, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
    x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], s.temporal_patch_size, p, p))
    return np.ascontiguousarray(x.reshape(gh * gw, c * s.temporal_patch_size * p * p)), (1, gh,
                                                                                         gw)


def process_images(images, s: ImageSettings) -> tuple[np.ndarray, np.ndarray]:
    """Images -> (pixel_values [sum(h*w), D], image_grid_thw [N, 3] int64)."""
    patches, grids = [], []
    for image in images:
        p, g = process_image(image, s)
        patches.append(p)
        grids.append(g)
    return np.concatenate(patches), np.asarray(grids, dtype=np.int64)
