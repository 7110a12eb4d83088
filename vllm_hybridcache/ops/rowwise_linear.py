"""A row-invariant linear layer for the CPU (csrc/rowwise_linear_cpu.cpp).

Why: Flash-Next's split-invariant forward needs a token's row of every GEMM to be the same bits
whatever the call's other rows are (how long the step is, which tokens an expert gets). A
BLAS chooses its kernel and blocking by the shape, so the first split-invariant forward ran
every GEMM on padded 64-row tiles (docs/split-invariance.md, "Cost"). This kernel fixes an
output element's arithmetic by its own row and column alone (lane-wise fused multiply-adds in
ascending k, one fixed tree over the lanes, the bias, one rounding), so one call of any shape
gives every row the bits it would get alone. float32 and bf16 (widened exactly; on a host with
AVX512-BF16, bf16 runs that host's pair dot product instead, twice as fast: `arithmetic`). A
call of few rows computes dot products straight from the operands' rows; a call of many rows
packs both operands lane by lane and runs GotoBLAS's blocking over the same sums (the same
bits).
"""

from __future__ import annotations

import functools
import logging
from types import ModuleType

import torch

logger = logging.getLogger("vllm_hybridcache")

DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16)


@functools.cache
def _module() -> ModuleType | None:
    from vllm_hybridcache.ops.csrc_build import load_rowwise_linear

    try:
        return load_rowwise_linear()
    except Exception as e:  # no compiler, no csrc/: the caller keeps its tiled GEMMs
        logger.warning("hybridcache: the row-invariant CPU linear could not be built (%s: %s)",
                       type(e).__name__, e)
        return None


def available() -> bool:
    """Whether the kernel is built (compiled on first use, then cached) in this process."""
    return _module() is not None


def lanes() -> int:
    """Partial sums per output element: the build's vector width (8 or 16)."""
    mod = _module()
    if mod is None:
        raise RuntimeError("the row-invariant CPU linear is not built in this process")
    return int(mod.lanes())


def arithmetic() -> str:
    """The build's arithmetic per dtype, e.g. ``float32:fma16;bfloat16:dpbf16x16``: lane sums
    of fused multiply-adds (``fma``; ``muladd`` without FMA) or, for bf16 on an AVX512-BF16
    host, of bf16 pair dot products (``dpbf16``), over that many lanes. The engine fingerprint
    holds it: links made by one arithmetic are never restored into another."""
    mod = _module()
    if mod is None:
        raise RuntimeError("the row-invariant CPU linear is not built in this process")
    return str(mod.arithmetic())


def rowwise_linear(x: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` with each output element computed from its own row of `x`
    and row of `weight` alone (module docstring); x [..., K], weight [N, K], one dtype."""
    mod = _module()
    if mod is None:
        raise RuntimeError("the row-invariant CPU linear is not built in this process")
    if x.dtype not in DTYPES or weight.dtype != x.dtype:
        raise TypeError(f"float32 or bf16 x and weight of one dtype, got {x.dtype} and "
                        f"{weight.dtype}")
    return mod.rowwise_linear(x, weight, bias)
