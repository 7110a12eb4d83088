"""Test-only: the CPU ISA emulation of `HYBRIDCACHE_TEST_CPU_ISA=avx2` (see tests/conftest.py).

tests/conftest.py puts this folder on PYTHONPATH when the switch is set, so Python imports this
file at start-up in every process the tests spawn (vLLM's engine core and workers on the CPU
platform are spawned, and tests/serving and tests/benchmarks start servers), and calls
`apply()` in the test process itself. Outside that switch nothing imports it.
"""

from __future__ import annotations

import os

PROBES = ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_vnni_supported",
          "_is_amx_tile_supported", "_is_amx_fp16_supported")


def apply() -> str | None:
    """Emulate the ISA named by HYBRIDCACHE_TEST_CPU_ISA in this process; returns it (or None).

    vLLM picks its kernel library (`_C_AVX2`), its CPU attention ISA and its GDN path from
    torch.cpu's feature probes, which read CPUID and ignore ATEN_CPU_CAPABILITY, so they answer
    False here; torch's own kernels follow ATEN_CPU_CAPABILITY and oneDNN's ONEDNN_MAX_CPU_ISA.
    """
    isa = os.environ.get("HYBRIDCACHE_TEST_CPU_ISA", "")
    if not isa:
        return None
    if isa != "avx2":
        raise RuntimeError(f"HYBRIDCACHE_TEST_CPU_ISA={isa}: only avx2 is known")
    os.environ["ATEN_CPU_CAPABILITY"] = "avx2"
    os.environ["ONEDNN_MAX_CPU_ISA"] = "AVX2"
    import torch

    for probe in PROBES:
        setattr(torch.cpu, probe, lambda: False)
    return isa


apply()
