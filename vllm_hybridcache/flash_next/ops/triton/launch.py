"""Launch parameters per GPU architecture, in one place.

Why a table and not one set of numbers: the kernels in this package keep whole tiles in
registers (a GDN state tile is ``K x BV`` fp32, an attention tile ``G x D``), and how large a
tile may be before it spills depends on the wave size and on the register/LDS budget:

* RDNA3.5 (gfx1151, Strix Halo) and RDNA4 (gfx1201, R9700) run wave32 with 64 KB of LDS per
  workgroup processor and 256 VGPRs per lane at most. There are no fp32 matrix instructions
  (WMMA takes bf16/fp16), so the GDN chunk kernel's fp32 products run on FMA units with
  operands in registers: small token steps (``BT=16``) and value blocks (``BV=16``) with 8
  waves keep it near the register budget. ``num_stages=1``: RDNA has no async-copy pipeline
  that Triton exploits.
* CDNA (gfx90a/gfx942, MI200/MI300) is wave64 with 64 KB LDS and a larger register file
  (VGPRs + AGPRs): the same tiles compile without spills at 4 waves (256 lanes); two
  software-pipelining stages help the streaming attention loop.
* NVIDIA Ampere/Hopper (sm80/sm90): warp 32, 164-228 KB shared memory, 255 registers per
  thread; larger attention tiles (``BN=32``, 8 warps) compile without spills and
  ``num_stages=2`` hides global-memory latency in the gather loop.
* The interpreter (``TRITON_INTERPRET=1``, CPU CI) ignores warps/stages; there the smallest tiles
  that cover the test shapes keep it fast.

The numbers were chosen from the register, spill and LDS figures of
``python -m benchmarks.kernels_compile`` (ahead-of-time compilation for gfx1151, gfx1201,
gfx942 and sm90; docs/kernels.md has the table). No kernel has been timed on a GPU yet.

Every kernel wrapper asks :func:`config_for` for its parameters, so tuning a new chip is one
entry here. Autotuning is used only where the best choice depends on the problem size and the
kernel has no side effects on its inputs (the indexer score kernel, see ``indexer.py``); the
stateful kernels (GDN, conv) update caches in place, which autotuning would replay.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ArchProfile:
    """What the kernels need to know about a chip family.

    ``family`` is one of ``rdna``, ``cdna``, ``nvidia``, ``interpreter``. ``wave`` is the
    hardware SIMD width (32 or 64) and ``lds_bytes`` the per-workgroup shared memory.
    """

    family: str
    name: str
    wave: int
    lds_bytes: int


INTERPRETER = ArchProfile("interpreter", "triton-interpreter", 32, 1 << 30)


def interpreting() -> bool:
    """True when Triton runs kernels on the CPU through its interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=16)
def _profile_for_device(index: int) -> ArchProfile:
    props = torch.cuda.get_device_properties(index)
    arch = getattr(props, "gcnArchName", "") or ""
    if torch.version.hip is not None:
        base = arch.split(":")[0]
        if base.startswith("gfx11") or base.startswith("gfx12"):
            return ArchProfile("rdna", base, 32, 64 * 1024)
        return ArchProfile("cdna", base, 64, 64 * 1024)
    smem = int(getattr(props, "shared_memory_per_block_optin", 48 * 1024))
    return ArchProfile("nvidia", f"sm{props.major}{props.minor}", 32, smem)


def profile(device: torch.device | None = None) -> ArchProfile:
    """The profile of ``device`` (the current CUDA/HIP device when None)."""
    if interpreting() or not torch.cuda.is_available():
        return INTERPRETER
    if device is None or device.type != "cuda":
        index = torch.cuda.current_device()
    else:
        index = device.index if device.index is not None else torch.cuda.current_device()
    return _profile_for_device(index)


# Per kernel, per family: the launch parameters. Keys are documented in docs/kernels.md.
# Register/spill figures quoted below come from ``python -m benchmarks.kernels_compile`` (AOT
# compilation at Flash-Next's dimensions, bf16 activations); no kernel has been timed on a GPU
# yet. Keys are documented in docs/kernels.md.
_TABLE: dict[str, dict[str, dict[str, int]]] = {
    # Depthwise causal conv (GDN conv and PLE dilated conv): channels per program, tokens per
    # inner step. Memory bound; wide channel blocks give coalesced loads of token-major rows.
    # BD=128, BT=16: 141 VGPRs on gfx1151, 168 registers on sm90, no spills (BD=256 spilled
    # on sm90).
    "conv": {
        "interpreter": {"BD": 32, "BT": 16, "num_warps": 1, "num_stages": 1},
        "rdna": {"BD": 128, "BT": 16, "num_warps": 4, "num_stages": 1},
        "cdna": {"BD": 128, "BT": 16, "num_warps": 4, "num_stages": 1},
        "nvidia": {"BD": 128, "BT": 16, "num_warps": 4, "num_stages": 1},
    },
    # GDN chunked prefill: BT tokens per step (a divisor of the 64-token chunk, so 64-aligned
    # splits stay bit-exact), BV the value-column block of the K x BV state tile. fp32 products
    # run on FMA units (RDNA has no fp32 matrix instructions; TF32 is not accurate enough) with
    # operands in registers, so small steps win: gfx1151 BT=16/BV=16/8 warps spills 126 VGPRs
    # (BT=64/BV=32/4 warps: 3483); gfx942 BT=16/BV=16/4 warps: 234 VGPRs, no spills; sm90
    # BT=16/BV=32/8 warps had the least stack of the configurations tried.
    "gdn_chunk": {
        "interpreter": {"BT": 32, "BV": 32, "num_warps": 1, "num_stages": 1},
        "rdna": {"BT": 16, "BV": 16, "num_warps": 8, "num_stages": 1},
        "cdna": {"BT": 16, "BV": 16, "num_warps": 4, "num_stages": 1},
        "nvidia": {"BT": 16, "BV": 32, "num_warps": 8, "num_stages": 1},
    },
    # GDN recurrent step (decode / MTP verify): one program per (sequence, head, BV block); the
    # 128 x BV fp32 state tile is the working set (gfx1151: 143 VGPRs at BV=16, no spills).
    "gdn_recurrent": {
        "interpreter": {"BV": 32, "num_warps": 1, "num_stages": 1},
        "rdna": {"BV": 16, "num_warps": 2, "num_stages": 1},
        "cdna": {"BV": 32, "num_warps": 2, "num_stages": 1},
        "nvidia": {"BV": 32, "num_warps": 4, "num_stages": 1},
    },
    # Indexer block pooling (mean + RMSNorm + RoPE of complete key groups). sm90: BB=16 spilled
    # in the paged variant (255 registers), BB=8 does not (149).
    "indexer_pool": {
        "interpreter": {"BB": 8, "num_warps": 1, "num_stages": 1},
        "rdna": {"BB": 16, "num_warps": 4, "num_stages": 1},
        "cdna": {"BB": 16, "num_warps": 4, "num_stages": 1},
        "nvidia": {"BB": 8, "num_warps": 4, "num_stages": 1},
    },
    # Indexer top-k: groups scanned per step of the radix search. Each step compares BN scores
    # against 16 candidate digits, a [16, BN] tile: BN=256 is 32 values per lane at 128 lanes
    # (wave32 x 4), BN=512 at 256 lanes (wave64 x 4).
    "indexer_topk": {
        "interpreter": {"BN": 64, "num_warps": 1, "num_stages": 1},
        "rdna": {"BN": 256, "num_warps": 4, "num_stages": 1},
        "cdna": {"BN": 512, "num_warps": 4, "num_stages": 1},
        "nvidia": {"BN": 256, "num_warps": 4, "num_stages": 1},
    },
    # Sparse attention over the selection: BN selected tokens gathered per step, D=256.
    # gfx1151: BN=16/8 warps spills 96 VGPRs (BN=32/4 warps: 401); sm90: BN=32/8 warps 209
    # registers, no spills. RDNA has no async copies for Triton to pipeline: 1 stage.
    "sparse_attn": {
        "interpreter": {"BN": 16, "num_warps": 1, "num_stages": 1},
        "rdna": {"BN": 16, "num_warps": 8, "num_stages": 1},
        "cdna": {"BN": 16, "num_warps": 4, "num_stages": 2},
        "nvidia": {"BN": 32, "num_warps": 8, "num_stages": 2},
    },
}


def config_for(kernel: str, device: torch.device | None = None) -> dict[str, int]:
    """Launch parameters of ``kernel`` on ``device`` (a copy; callers may adjust it)."""
    fam = profile(device).family
    return dict(_TABLE[kernel][fam])


def indexer_score_autotune_configs() -> list:
    """Autotune candidates for the indexer score kernel (pure function of its inputs).

    The number of pooled blocks per sequence varies from a handful to thousands, and the best
    block tile depends on it and on the chip; autotune keys on the padded block count.
    """
    import triton

    if interpreting():
        return [triton.Config({"BB": 16}, num_warps=1, num_stages=1)]
    out = []
    for bb in (32, 64, 128):
        for warps in (2, 4, 8):
            out.append(triton.Config({"BB": bb}, num_warps=warps, num_stages=1))
    return out
