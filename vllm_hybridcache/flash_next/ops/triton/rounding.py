"""Round-to-nearest-even into a narrower float type, spelled out in integer arithmetic.

Why: transformers rounds some intermediates to the activation dtype (the conv result before
SiLU, the indexer's pooled/normed/rotated keys); the kernels must round at the same points, with
the same rounding (IEEE round-to-nearest-even). Compiled Triton's ``x.to(tl.bfloat16)`` does that,
but the CPU interpreter (``TRITON_INTERPRET=1``, what CI runs) truncates fp32 -> bf16, which would
make the CI results differ from the GPU's by one bf16 ulp at every rounding point. Doing the
rounding on the fp32 bit pattern gives the same bits on both; the final ``.to(bf16)`` of an
already-rounded value is exact under either conversion. Finite inputs only (NaN/inf pass through
bit-manipulated; they do not occur at these points).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_to(x, DT: tl.constexpr):
    """fp32 ``x`` rounded (nearest-even) to dtype ``DT``, returned as fp32."""
    if DT == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(DT).to(tl.float32)
