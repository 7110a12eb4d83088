"""Helpers shared by the kernel tests (ragged batches as the serving engine builds them)."""

from __future__ import annotations

import torch


def cu_seqlens(lengths: list[int]) -> torch.Tensor:
    """Cumulative offsets ``[0, l0, l0+l1, ...]`` as int32, vLLM's varlen convention."""
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32)


# Lengths the issue asks for: 1, 63, 64, 65 and several chunks, in one ragged batch.
RAGGED = [1, 63, 64, 65, 130]
