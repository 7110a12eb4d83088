"""Flash-Next's vision tower (transformers' `Qwen4ExpVisionModel`), plain torch.

Module and parameter names mirror transformers, so the `model.visual.*` tensors of a
`Qwen4ExpForConditionalGeneration` checkpoint load by name. The tower takes the processor's
flat patches `[sum(t*h*w), C*T*P*P]` (Qwen2-VL layout: patches ordered in 2x2 spatial-merge
blocks) and each item's grid `(t, h, w)` in patches, and returns one row per merged patch
(`t*h*w / merge**2` rows per item), in the language model's hidden size:

  Conv3d patch embedding -> + learned position table resampled bilinearly (align_corners) to
  the item's grid -> blocks (LayerNorm, bidirectional attention within one frame with 2-D
  axial RoPE over (row, col), LayerNorm, GELU-tanh MLP) -> merger (LayerNorm, 2x2 patches
  concatenated, Linear-GELU-Linear).

The resampling indices and the merge-block position ids come from transformers' own helpers
(`transformers.vision_utils`), so the tower reads the table at the very same taps.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class VisionPatchEmbed(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.patch_size = config.patch_size
        self.temporal_patch_size = config.temporal_patch_size
        self.in_channels = config.in_channels
        self.embed_dim = config.hidden_size
        k = (self.temporal_patch_size, self.patch_size, self.patch_size)
        self.proj = nn.Conv3d(self.in_channels, self.embed_dim, kernel_size=k, stride=k,
                              bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.view(-1, self.in_channels, self.temporal_patch_size, self.patch_size,
                   self.patch_size)
        return self.proj(x.to(self.proj.weight.dtype)).view(-1, self.embed_dim)


class VisionRotary:
    """Axial 2-D RoPE: the same frequencies over row and column, `[h | w | h | w]` layout,
    rotating the whole head (fp32 angles, as transformers computes them)."""

    def __init__(self, head_dim: int, theta: float) -> None:
        spatial = head_dim // 2
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, spatial, 2, dtype=torch.float)
                                          / spatial))

    def __call__(self, pos_hw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = pos_hw[..., None].float() * self.inv_freq.to(pos_hw.device)  # [N, 2, hd/4]
        hw = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)
        emb = torch.cat([hw, hw], dim=-1)
        return emb.cos(), emb.sin()


class VisionAttention(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.head_dim = config.hidden_size // config.num_heads
        self.qkv = nn.Linear(config.hidden_size, config.hidden_size * 3, bias=True)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.scaling = self.head_dim ** -0.5

    def forward(self, x: torch.Tensor, cu_seqlens: list[int],
                cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).reshape(n, 3, self.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
        c, s = cos[:, None].float(), sin[:, None].float()
        q = (q.float() * c + _rotate_half(q.float()) * s).to(x.dtype)
        k = (k.float() * c + _rotate_half(k.float()) * s).to(x.dtype)
        out = []
        for a, b in itertools.pairwise(cu_seqlens):  # attention within one frame
            qi, ki, vi = (t[a:b].transpose(0, 1)[None] for t in (q, k, v))
            o = F.scaled_dot_product_attention(qi, ki, vi, scale=self.scaling)
            out.append(o[0].transpose(0, 1))
        return self.proj(torch.cat(out).reshape(n, -1))


class VisionMLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        from transformers.activations import ACT2FN

        self.linear_fc1 = nn.Linear(config.hidden_size, config.intermediate_size, bias=True)
        self.linear_fc2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=True)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act_fn(self.linear_fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.attn = VisionAttention(config)
        self.mlp = VisionMLP(config)

    def forward(self, x, cu_seqlens, cos, sin):
        x = x + self.attn(self.norm1(x), cu_seqlens, cos, sin)
        return x + self.mlp(self.norm2(x))


class VisionPatchMerger(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.hidden_size = config.hidden_size * config.spatial_merge_size ** 2
        self.norm = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.hidden_size, self.hidden_size)
        self.act_fn = nn.GELU()
        self.linear_fc2 = nn.Linear(self.hidden_size, config.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x).view(-1, self.hidden_size)
        return self.linear_fc2(self.act_fn(self.linear_fc1(x)))


class FlashNextVisionModel(nn.Module):
    """The tower; `forward(pixel_values, grid_thw)` -> `[sum(t*h*w) / merge**2, out_hidden]`."""

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.spatial_merge_size = config.spatial_merge_size
        self.patch_embed = VisionPatchEmbed(config)
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.hidden_size)
        self.num_grid_per_side = int(config.num_position_embeddings ** 0.5)
        rope = config.rope_parameters or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ValueError(f"Flash-Next vision supports axial RoPE only, got {rope}")
        self.rotary = VisionRotary(config.hidden_size // config.num_heads,
                                   float(rope.get("rope_theta", 10000.0)))
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.depth))
        self.merger = VisionPatchMerger(config)

    @property
    def dtype(self) -> torch.dtype:
        return self.patch_embed.proj.weight.dtype

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        from transformers.vision_utils import (
            get_vision_interpolation_indices_and_weights,
            get_vision_position_ids,
        )

        grid_thw = grid_thw.to(torch.long).cpu()
        idx, w = get_vision_interpolation_indices_and_weights(
            grid_thw, num_grid_per_side=self.num_grid_per_side, mode="bilinear",
            align_corners=True, spatial_merge_size=self.spatial_merge_size)
        pos_hw = get_vision_position_ids(grid_thw, self.spatial_merge_size)
        frames = torch.repeat_interleave(grid_thw[:, 1] * grid_thw[:, 2], grid_thw[:, 0])
        cu = [0, *frames.cumsum(0).tolist()]
        dev = pixel_values.device
        h = self.patch_embed(pixel_values)
        pos = (self.pos_embed(idx.to(dev)) * w.to(dev)[:, :, None]).sum(1)
        h = h + pos.to(h.dtype)
        cos, sin = self.rotary(pos_hw.to(dev))
        for blk in self.blocks:
            h = blk(h, cu, cos, sin)
        return self.merger(h)
